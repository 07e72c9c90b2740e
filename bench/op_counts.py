#!/usr/bin/env python3
"""op_counts.py — the operations one training step runs, phase by phase, in one forge-bench
mode against another: the aten operators torch.profiler records, and on CUDA the kernels.

forge-bench --profile says how long each category of kernels takes; this says which
operations a mode adds or drops (forge.lean's recomputation, a loss, FORGE's Linear backward
against torch's), counted exactly, on any device. Counts do not depend on widths, so by default
the model is forge-bench's (MODEL_CONFIGS: its family, layer count, heads ratio, options) with
small widths, which a CPU steps in seconds; --full keeps the widths. Every aten event counts,
nested ones too (aten::to, the _to_copy inside it, the copy_ inside that): compare counts, not
sums, across modes.

    python3 bench/op_counts.py --model llama-3.1-8b --modes torch-adamw forge-bf16-lean
    python3 bench/op_counts.py --model llama-3.1-8b --modes forge-bf16 forge-bf16-lean \\
        --device cuda --full --seq 512 --json out/ops.json

Prints, per phase (forward, backward, optimizer), the totals and every operation whose count
differs, largest difference first; --json also writes every count.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

from forge.tools import bench  # noqa: E402

# The widths of the narrow model (heads keep the model's ratio of query to key/value heads).
NARROW = dict(hidden_size=128, intermediate_size=448, num_attention_heads=4, vocab_size=512)


def narrow_config(name: str) -> str:
    """Registers MODEL_CONFIGS[name] with NARROW's widths as "<name>-narrow"; returns its name."""
    cfg = dict(bench.MODEL_CONFIGS[name])
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    cfg.update(NARROW, num_key_value_heads=max(1, NARROW["num_attention_heads"] * kv // heads))
    if "head_dim" in cfg:
        cfg["head_dim"] = NARROW["hidden_size"] // NARROW["num_attention_heads"]
    cfg.pop("bos_token_id", None)
    cfg.pop("eos_token_id", None)
    narrow = f"{name}-narrow"
    bench.MODEL_CONFIGS[narrow] = cfg
    return narrow


def count_phases(model_name: str, mode: str, device: torch.device, seq: int,
                 warmup: int = 2) -> Dict[str, Dict[str, int]]:
    """{phase: {operation: count}} of one step in `mode` after `warmup` steps; CUDA kernels
    are keyed "kernel: <name>"."""
    from torch.profiler import ProfilerActivity, profile
    if mode.endswith(bench.GRAPH_SUFFIX):
        raise SystemExit(f"{mode}: a graph replay is one launch; count the eager mode")
    lean = mode in bench.LEAN_MODES
    model = bench.build_model(model_name, device, torch.bfloat16)
    model.train()
    bench.prepare_model(model, model_name, mode)
    optimizer = bench.make_optimizer(mode, model, device)
    generator = torch.Generator().manual_seed(0)
    vocab = getattr(getattr(model, "config", None), "vocab_size", NARROW["vocab_size"])
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=generator).to(device)
    for _ in range(warmup):
        bench.train_step(model, optimizer, tokens, lean)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    counts = {}
    for phase, run in bench.train_phases(model, optimizer, tokens, lean):
        with profile(activities=activities) as prof:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
        c: Dict[str, int] = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                c[f"kernel: {e.name}"] += 1
            elif e.name.startswith("aten::"):
                c[e.name] += 1
        counts[phase] = dict(c)
    return counts


def differences(a: Dict[str, int], b: Dict[str, int]) -> List[tuple]:
    """(operation, count in a, count in b) where they differ, largest |b - a| first."""
    rows = [(k, a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), r[0]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(bench.MODEL_CONFIGS))
    ap.add_argument("--modes", nargs=2, default=["torch-adamw", "forge-bf16-lean"],
                    metavar=("A", "B"), help="forge-bench modes (eager)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--full", action="store_true", help="the model's own widths")
    ap.add_argument("--json", help="write every count here")
    args = ap.parse_args(argv)
    for mode in args.modes:
        if mode not in bench.KNOWN_MODES:
            ap.error(f"--modes: unknown mode {mode!r}")
    name = args.model if args.full else narrow_config(args.model)
    device = torch.device(args.device)
    a_mode, b_mode = args.modes
    a = count_phases(name, a_mode, device, args.seq)
    b = count_phases(name, b_mode, device, args.seq)
    print(f"{name}, seq {args.seq}, {device}: one step's operations, {a_mode} (A) against "
          f"{b_mode} (B)")
    for phase in a:
        print(f"\n{phase}: A {sum(a[phase].values())}, B {sum(b[phase].values())} events")
        for op, ca, cb in differences(a[phase], b[phase]):
            print(f"  {op[:90]:90s} {ca:6d} {cb:6d} {cb - ca:+6d}")
    result = {"model": name, "seq": args.seq, "device": str(device), "modes": args.modes,
              "counts": {"A": a, "B": b}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    return result


if __name__ == "__main__":
    main()
