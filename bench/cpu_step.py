"""cpu_step.py — FORGE's fused step on the CPU against torch's dW GEMM + torch.optim.AdamW.

For each nn.Linear shape of forge-train's default model (the "tiny" preset, batch 16 × seq
128 = 2048 tokens, fp32), one layer's optimizer work per training step:
  forge   forge_wgrad_step (libforge's CPU backend through the C ABI): dW = dYᵀX tile by tile,
          AdamW applied to each tile, fp32 weight and states;
  torch   dw = dy.t() @ x (torch's GEMM), then torch.optim.AdamW.step() on that gradient
          (torch's default implementation for CPU tensors).
Both with torch.get_num_threads() threads (--threads). Forge and torch alternate within every
round and the table shows per-shape medians; the totals weigh each shape by how often the
model has it, and "tokens/s" is what that time alone would allow per training step.

    python bench/cpu_step.py [--model tiny] [--tokens 2048] [--rounds 30] [--threads N]
                             [--shapes OUTxIN,...]

Speed targets live here, never in unit tests (tests/python/test_train.py only checks that it
runs). libforge is found as forge finds it (FORGE_LIBRARY, the package, build*/).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from forge import _lib  # noqa: E402
from forge.tools import models as forge_models  # noqa: E402

WARMUP = 3


def model_shapes(name: str):
    """{(out, in): count} of the nn.Linear weights of preset `name`."""
    model = forge_models.build_model(name, torch.device("cpu"))[0]
    counts = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shape = tuple(m.weight.shape)
            counts[shape] = counts.get(shape, 0) + 1
    return counts


class ForgeLayer:
    """One fp32 weight with fp32 AdamW states, stepped by forge_wgrad_step on the CPU."""

    def __init__(self, lib, out_f: int, in_f: int, x: torch.Tensor, dy: torch.Tensor,
                 threads: int):
        self.lib = lib
        self.weight = torch.randn(out_f, in_f) * 0.02
        hp = lib.hparams_default(_lib.RULE_ADAMW)
        hp.lr, hp.weight_decay, hp.step = 1e-3, 0.01, 1
        layout = lib.state_layout(hp, _lib.STATE_FP32, out_f, in_f)
        self.states = [torch.empty(layout.state_bytes[i], dtype=torch.uint8)
                       for i in range(layout.num_states)]
        p = _lib.Param()
        p.rows, p.cols = out_f, in_f
        p.weight_format, p.weight = _lib.WEIGHT_FP32, self.weight.data_ptr()
        p.state_format = _lib.STATE_FP32
        for i, s in enumerate(self.states):
            p.state[i] = s.data_ptr()
        device = _lib.Device()
        device.kind, device.num_threads = _lib.DEVICE_CPU, threads
        lib.state_init(p, hp, device)
        self.x, self.dy = x, dy  # kept alive: the struct holds their addresses
        a = _lib.WgradArgs()
        a.abi_version, a.device, a.tokens = _lib.ABI_VERSION, device, x.shape[0]
        a.x, a.x_dtype, a.ldx = x.data_ptr(), _lib.DTYPE_FP32, x.stride(0)
        a.dy, a.dy_dtype, a.lddy = dy.data_ptr(), _lib.DTYPE_FP32, dy.stride(0)
        a.param, a.hparams = p, hp
        self.args = a

    def step(self):
        self.lib.wgrad_step(self.args)


class TorchLayer:
    """The same weight stepped the unfused way: torch's GEMM, then torch.optim.AdamW."""

    def __init__(self, out_f: int, in_f: int, x: torch.Tensor, dy: torch.Tensor):
        self.weight = torch.nn.Parameter(torch.randn(out_f, in_f) * 0.02)
        self.opt = torch.optim.AdamW([self.weight], lr=1e-3, weight_decay=0.01)
        self.x, self.dy = x, dy

    def step(self):
        self.weight.grad = self.dy.t() @ self.x  # [out, in]
        self.opt.step()
        self.weight.grad = None


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def parse_shapes(text: str):
    """{(out, in): count} from "OUTxIN,..."; ValueError naming a bad item."""
    shapes = {}
    for item in text.split(","):
        try:
            out_f, in_f = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"{item!r} is not OUTxIN") from None
        if out_f <= 0 or in_f <= 0:
            raise ValueError(f"{item!r}: both sizes must be positive")
        shapes[(out_f, in_f)] = shapes.get((out_f, in_f), 0) + 1
    return shapes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="forge-train preset whose shapes are timed")
    p.add_argument("--shapes", help="OUTxIN,... instead of the model's (each counted once)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch × seq)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="0: torch.get_num_threads()")
    args = p.parse_args(argv)
    for flag, value in (("--tokens", args.tokens), ("--rounds", args.rounds)):
        if value <= 0:
            p.error(f"{flag} must be positive, got {value}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else None
    except ValueError as e:
        p.error(f"--shapes: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if shapes is None:
        try:
            shapes = model_shapes(args.model)
        except ValueError as e:
            p.error(f"--model: {e}")
    lib = _lib.get()
    torch.manual_seed(0)

    rows, total, total_min = [], {"forge": 0.0, "torch": 0.0}, {"forge": 0.0, "torch": 0.0}
    for (out_f, in_f), count in shapes.items():
        x = torch.randn(args.tokens, in_f)
        dy = torch.randn(args.tokens, out_f) * 0.01
        layers = {"forge": ForgeLayer(lib, out_f, in_f, x, dy, threads),
                  "torch": TorchLayer(out_f, in_f, x, dy)}
        times = {name: [] for name in layers}
        for r in range(WARMUP + args.rounds):
            order = list(layers) if r % 2 == 0 else list(reversed(layers))
            for name in order:
                dt = timed(layers[name].step)
                if r >= WARMUP:
                    times[name].append(dt)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        best = {name: min(t) * 1e3 for name, t in times.items()}
        for name in total:
            total[name] += ms[name] * count
            total_min[name] += best[name] * count
        rows.append((f"{out_f}x{in_f}", count, ms["forge"], ms["torch"], best["forge"],
                     best["torch"]))

    print(f"CPU fused step vs torch, {args.tokens} tokens, fp32 weight and AdamW states, "
          f"{threads} thread(s), torch {torch.__version__}, libforge {lib.path}; ms per layer "
          f"and step, median (fastest) of {args.rounds} alternating rounds")
    print()
    print("| W (out×in) | layers | forge fused ms | torch dW + AdamW ms | torch / forge |")
    print("| --- | --- | --- | --- | --- |")
    for shape, count, f_ms, t_ms, f_min, t_min in rows:
        print(f"| {shape} | {count} | {f_ms:.3f} ({f_min:.3f}) | {t_ms:.3f} ({t_min:.3f}) | "
              f"{t_ms / f_ms:.2f}x ({t_min / f_min:.2f}x) |")
    f_tot, t_tot = total["forge"], total["torch"]
    f_best, t_best = total_min["forge"], total_min["torch"]
    print(f"| all ({args.model if not args.shapes else 'given'}) | {sum(shapes.values())} | "
          f"{f_tot:.3f} ({f_best:.3f}) | {t_tot:.3f} ({t_best:.3f}) | {t_tot / f_tot:.2f}x "
          f"({t_best / f_best:.2f}x) |")
    print()
    print(f"these layers alone (medians): forge {args.tokens / f_tot * 1e3:,.0f} tokens/s, "
          f"torch {args.tokens / t_tot * 1e3:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
