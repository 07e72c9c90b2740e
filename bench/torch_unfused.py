#!/usr/bin/env python3
"""torch_unfused.py — FORGE's fused step against the unfused way as torch runs it, per
Llama-3.1-8B linear layer (wgrad_bench's comparison, from Python).

wgrad_bench's column (c) is cuBLAS dW plus a hand-written flat AdamW pass (16-byte vectors,
full occupancy). That pass streams faster than the kernel torch.optim.AdamW(fused=True)
launches (docs/performance.md, "What we measure against": 36.0 ms over the model's linear
weights on the H200, ~2.7 TB/s). This program times what a torch user runs instead of FORGE, on the same
shapes and formats:

  torch dW      torch.mm(dy.t(), x) into a bf16 gradient: the GEMM of Linear's backward (cuBLAS)
  torch AdamW   torch._fused_adamw_ on the bf16 weight and bf16 states: the one kernel
                AdamW(fused=True).step() launches for them (its step tensor stays at 1:
                the optimizer's own launch that bumps it each step is left out)
  torch (c)     the two in a row
  FORGE fused   forge_wgrad_step (ctypes binding), AdamW, bf16 weight, bf16 states

All four run interleaved call by call (round i starts at variant i mod 4), each after an L2
flush and behind a sleep kernel that hides the host's launch cost; medians of --iters rounds.
Hyper-parameters are torch's AdamW defaults with lr 1e-3: β = (0.9, 0.999), eps 1e-8,
weight decay 1e-2. Llama totals: 32 layers × (2 q/o + 2 k/v + 2 gate/up + 1 down).

    python3 bench/torch_unfused.py [--tokens 512,2048,4096] [--iters 20] [--out DIR]

Needs a CUDA device and libforge built with CUDA (found as python/forge/_lib.py says).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from forge import _lib  # noqa: E402

SHAPES = [("q_proj/o_proj", 4096, 4096, 2), ("k_proj/v_proj", 1024, 4096, 2),
          ("gate_proj/up_proj", 14336, 4096, 2), ("down_proj", 4096, 14336, 1)]
LAYERS = 32
WARMUP = 5
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 1e-2
# NOTE: ~0.5 ms at the H200's clocks: longer than the host takes to enqueue one variant, so
# every timed call starts on a GPU that already has its work queued.
SLEEP_CYCLES = 1_000_000
VARIANTS = ["forge_fused", "torch_dw", "torch_adamw", "torch_unfused"]


def uniform(shape, scale, gen, positive=False):
    u = torch.rand(shape, generator=gen, device="cuda", dtype=torch.float32)
    t = scale * (u + 0.01) if positive else scale * (2 * u - 1)
    return t.to(torch.bfloat16)


def forge_args(lib, x, dy, w, m, v):
    """forge_wgrad_args for dW = dyᵀ·x, AdamW on bf16 w with bf16 states m, v."""
    tokens, cols = x.shape
    rows = dy.shape[1]
    hp = lib.hparams_default(_lib.RULE_ADAMW)
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = LR, BETA1, BETA2, EPS, WEIGHT_DECAY
    hp.decoupled_weight_decay = 1
    param = _lib.Param()
    param.rows, param.cols = rows, cols
    param.weight_format, param.weight = _lib.WEIGHT_BF16, w.data_ptr()
    param.state_format = _lib.STATE_BF16
    param.state[0], param.state[1] = m.data_ptr(), v.data_ptr()
    args = _lib.WgradArgs()
    args.abi_version = _lib.ABI_VERSION
    args.device.kind, args.device.index = _lib.DEVICE_CUDA, torch.cuda.current_device()
    args.device.stream = torch.cuda.current_stream().cuda_stream
    args.tokens = tokens
    args.x, args.x_dtype, args.ldx = x.data_ptr(), _lib.DTYPE_BF16, cols
    args.dy, args.dy_dtype, args.lddy = dy.data_ptr(), _lib.DTYPE_BF16, rows
    args.param, args.hparams = param, hp
    return args


def medians_ms(fns, iters, flush):
    """Median ms of each fn over `iters` interleaved rounds (see the header)."""
    for fn in fns:
        for _ in range(WARMUP):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for i in range(iters):
        marks = []
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            flush.fill_(i & 0xFF)
            torch.cuda._sleep(SLEEP_CYCLES)
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fns[j]()
            stop.record()
            marks.append((j, start, stop))
        torch.cuda.synchronize()
        for j, start, stop in marks:
            times[j].append(start.elapsed_time(stop))
    return [statistics.median(t) for t in times]


def bench_shape(lib, name, out, inp, tokens_list, iters, flush, gen):
    t_max = max(tokens_list)
    x_all = uniform((t_max, inp), 1.0, gen)      # [T, in]
    dy_all = uniform((t_max, out), 1e-2, gen)    # [T, out]
    # FORGE's and torch's parameters apart, each with its own states.
    fw = uniform((out, inp), 0.02, gen)          # [out, in]
    fm = uniform((out, inp), 1e-3, gen)
    fv = uniform((out, inp), 1e-6, gen, positive=True)
    tw, tm, tv = fw.clone(), fm.clone(), fv.clone()
    grad = torch.empty_like(tw)                  # [out, in], torch's dW
    step = torch.ones((), device="cuda", dtype=torch.float32)
    rows = []
    for tokens in tokens_list:
        x, dy = x_all[:tokens], dy_all[:tokens]
        args = forge_args(lib, x, dy, fw, fm, fv)
        forge_step = [1]

        def forge_fused():
            args.hparams.step = forge_step[0]
            forge_step[0] = forge_step[0] % 1000 + 1
            lib.wgrad_step(args)

        def torch_dw():
            torch.mm(dy.t(), x, out=grad)

        def torch_adamw():
            torch._fused_adamw_([tw], [grad], [tm], [tv], [], [step], lr=LR, beta1=BETA1,
                                beta2=BETA2, weight_decay=WEIGHT_DECAY, eps=EPS,
                                amsgrad=False, maximize=False)

        def torch_unfused():
            torch_dw()
            torch_adamw()

        ms = medians_ms([forge_fused, torch_dw, torch_adamw, torch_unfused], iters, flush)
        for t in (fw, fm, fv, tw, tm, tv):
            if not torch.isfinite(t.float()).all():
                raise SystemExit(f"{name} T={tokens}: non-finite weight or state after timing")
        row = dict(layer=name, out=out, inp=inp, tokens=tokens, **dict(zip(VARIANTS, ms)))
        rows.append(row)
        print(f"{name:18s} T={tokens:<5d} FORGE fused {ms[0]:.3f} ms | torch dW {ms[1]:.3f} | "
              f"torch AdamW {ms[2]:.3f} | torch (c) {ms[3]:.3f} | speedup {ms[3] / ms[0]:.2f}x",
              flush=True)
    return rows


def llama_totals(rows, tokens_list):
    """{T: {variant: ms}}: each layer's median × its occurrences per decoder layer × LAYERS."""
    per_layer = {name: n for name, _, _, n in SHAPES}
    return {t: {v: sum(r[v] * per_layer[r["layer"]] * LAYERS for r in rows if r["tokens"] == t)
                for v in VARIANTS}
            for t in tokens_list}


def report_md(header, rows, tokens_list):
    """The markdown report: the per-layer table, then the Llama totals."""
    md = ["# FORGE fused step against cuBLAS dW + torch's fused AdamW (torch_unfused.py)", "",
          f"- date: {header['date']}", f"- GPU: {header['gpu']}; torch {header['torch']}",
          f"- command: `{header['command']}`",
          f"- median of {header['iters']} interleaved rounds after {WARMUP} warm-ups, L2 flushed "
          "and the launch hidden behind a sleep kernel before each call; bf16 x, dy, W, m, v; "
          "AdamW", "",
          "| layer (out×in) | T | FORGE fused ms | torch dW ms | torch AdamW ms | torch (c) ms | "
          "speedup (c)/FORGE |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['layer']} {r['out']}x{r['inp']} | {r['tokens']} | {r['forge_fused']:.4f} | "
                  f"{r['torch_dw']:.4f} | {r['torch_adamw']:.4f} | {r['torch_unfused']:.4f} | "
                  f"{r['torch_unfused'] / r['forge_fused']:.2f}x |")
    md += ["", f"Llama-3.1-8B totals ({LAYERS} layers × 7 linear layers, ms):", "",
           "| T | FORGE fused | torch dW | torch AdamW | torch (c) | speedup |",
           "| --- | --- | --- | --- | --- | --- |"]
    for t, tot in llama_totals(rows, tokens_list).items():
        md.append(f"| {t} | {tot['forge_fused']:.2f} | {tot['torch_dw']:.2f} | "
                  f"{tot['torch_adamw']:.2f} | {tot['torch_unfused']:.2f} | "
                  f"{tot['torch_unfused'] / tot['forge_fused']:.2f}x |")
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,2048,4096", help="comma-separated T values")
    ap.add_argument("--iters", type=int, default=20, help="timed rounds per (layer, T)")
    ap.add_argument("--out", type=Path, help="folder for torch-unfused.md and .json")
    opts = ap.parse_args()
    try:
        tokens_list = [int(t) for t in opts.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: {opts.tokens!r} is not a comma-separated list of integers")
    if min(tokens_list) < 1:
        ap.error(f"--tokens: every T must be at least 1, got {opts.tokens!r}")
    if opts.iters < 1:
        ap.error(f"--iters: at least 1 timed round, got {opts.iters}")
    if not torch.cuda.is_available():
        raise SystemExit("torch_unfused.py needs a CUDA device")
    lib = _lib.get()
    if not lib.has_cuda:
        raise SystemExit(f"{lib.path} was built without the CUDA backend")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # > L2
    rows = []
    for name, out, inp, _ in SHAPES:
        rows += bench_shape(lib, name, out, inp, tokens_list, opts.iters, flush, gen)
        torch.cuda.empty_cache()

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = ("python3 bench/torch_unfused.py " + " ".join(sys.argv[1:])).strip()
    header = dict(date=date, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command=command, iters=opts.iters)
    text = report_md(header, rows, tokens_list)
    print(text)
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "torch-unfused.md").write_text(text)
        totals = llama_totals(rows, tokens_list)
        (opts.out / "torch-unfused.json").write_text(json.dumps(
            dict(header, results=rows, totals={str(k): v for k, v in totals.items()}),
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
