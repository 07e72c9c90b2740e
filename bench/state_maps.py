#!/usr/bin/env python3
"""state_maps.py — how faithfully a 16-value block-64 map keeps AdamW's update, on real moments.

Trains forge-train's model with torch.optim.AdamW (fp32, the CPU by default) for a few steps on
the built-in text, then codes each hidden weight's second moment v (and first moment m) the way
an int4 state stores it (a block of 64 consecutive elements of a row, its absmax, the nearest of
16 map values) and compares the update m / (√v + eps) computed from the coded moment with the
one from the exact moment:
  - ratio: Σ|update from the coded moment| / Σ|exact update|, per weight, averaged over the
    weights (below 1: the map shrinks the steps, as a smaller learning rate would);
  - median: the median element's ratio, averaged the same way;
  - spread: the within-block standard deviation of log10 v (the median block), which decides
    how much of a block a map's smallest value has to cover.
The maps: formats.h's (read through libforge: forge_state_from_fp32 and back would do the
same; here the values are written out from their definitions) and the alternatives it names.

    python3 bench/state_maps.py --steps 60          # ~2.5 min on 2 cores
"""
import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def decades(counts):
    """Dynamic-exponent magnitudes: decade i of len(counts) (the last is 1) holding counts[i]
    values at the midpoints of equal bins of [0.1, 1]."""
    return [v * 10.0 ** (i - len(counts) + 1) for i, n in enumerate(counts)
            for v in [0.1 + (k + 0.5) * 0.9 / n for k in range(n)]]


UNSIGNED_MAPS = {
    "linear (c + 1) / 16": [(c + 1) / 16 for c in range(16)],
    "dynamic exponent without zero (formats.h)": decades([1, 2, 4, 8]) + [1.0],
    "powers of two 2^-15 .. 1": [2.0 ** -c for c in range(15, -1, -1)],
}
_POSITIVE = decades([1, 2, 4])
SIGNED_MAP = sorted([-v for v in _POSITIVE] + [0.0] + _POSITIVE + [1.0])


def coded(x: torch.Tensor, values) -> torch.Tensor:
    """x ([rows, cols], cols a multiple of 64) through a block-64 map: nearest value, ties up."""
    table = torch.tensor(values, dtype=torch.float32)
    blocks = x.reshape(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    q = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)
    index = torch.bucketize(q, (table[1:] + table[:-1]) / 2, right=True)
    return (table[index] * absmax).reshape(x.shape)


def train(steps: int, device: str):
    from forge.tools import data, models
    torch.manual_seed(0)
    model, _, _ = models.build_model("100m", torch.device(device), vocab_size=256)
    batches = data.make_data(None, data.ByteTokenizer(), 256, 2, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(steps):
        rows = batches.batch(step, torch.device(device))
        out = model(rows[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                          rows[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    # the hidden weights (2-d, a multiple of 64 wide, not the embedding or the head)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
            for p in m.parameters()} | {id(getattr(head, "weight", None))}
    return [(opt.state[p]["exp_avg"].float().cpu(), opt.state[p]["exp_avg_sq"].float().cpu())
            for p in model.parameters()
            if p.dim() == 2 and p.size(1) % 64 == 0 and id(p) not in skip]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--device", default="cpu")
    p.add_argument("--eps", type=float, default=1e-8)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: must be >= 1, got {args.steps}")
    moments = train(args.steps, args.device)
    spread = statistics.median(
        v.reshape(-1, 64).clamp_min(1e-30).log10().std(1).median().item() for _, v in moments)
    print(f"{len(moments)} hidden weights after {args.steps} steps: within-block std of "
          f"log10 v {spread:.2f} (median)")

    def report(name, code_m, code_v):
        ratios, medians = [], []
        for m, v in moments:
            exact = m.abs() / (v.sqrt() + args.eps)
            mine = code_m(m).abs() / (code_v(v).sqrt() + args.eps)
            ratios.append((mine.sum() / exact.sum()).item())
            medians.append((mine / exact.clamp_min(1e-30)).median().item())
        print(f"  {name}: ratio {statistics.mean(ratios):.3f}, median element "
              f"{statistics.mean(medians):.3f}")

    print("second moments coded (first moments exact):")
    for name, values in UNSIGNED_MAPS.items():
        report(name, lambda m: m, lambda v, values=values: coded(v, values))
    print("first moments coded with the signed dynamic-exponent map (second moments exact):")
    report("signed dynamic exponent (formats.h)", lambda m: coded(m, SIGNED_MAP), lambda v: v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
