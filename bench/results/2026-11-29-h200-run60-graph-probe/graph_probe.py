"""graph_probe.py — can a whole training step (forward, backward, optimizer) of forge-bench's
models be captured as one CUDA graph, and what does a replay cost against the eager step?

A probe for issue 5's host-bound seq-512 step. FORGE's updates are captured with the step
number of the capture (the library reads step and lr at call time), so its replays here
time the step but do not train correctly; torch's fused AdamW runs with capturable=True.

    python bench/graph_probe.py --model llama-3.1-8b --seq 512 --modes torch-adamw forge-bf16
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch


def run(model_name: str, seq: int, mode: str, steps: int) -> None:
    from forge import bench
    device = torch.device("cuda")
    model = bench.build_model(model_name, device, torch.bfloat16)
    model.train()
    if mode == "torch-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=bench.LR, fused=True, capturable=True)
    else:
        opt = bench.make_optimizer(mode, model, device)
    tokens = torch.randint(0, model.config.vocab_size, (1, seq), device=device)

    def step():
        loss = bench.model_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def timed(fn, n):
        times, host = [], []
        for _ in range(n):
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            h0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - h0) * 1e3)
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1))
        return statistics.median(times), statistics.median(host)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_ms, eager_host = timed(step, 3 + steps)  # warm-up included: median
        eager_ms, eager_host = timed(step, steps)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    try:
        with torch.cuda.graph(graph, stream=side):
            static_loss = step()
    except Exception as e:  # noqa: BLE001 — the probe's answer
        print(f"{mode}: capture FAILED: {type(e).__name__}: {str(e)[:600]}", flush=True)
        return
    capture_s = time.perf_counter() - t0
    graph_ms, graph_host = timed(graph.replay, steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"{mode}: eager {eager_ms:.1f} ms (host {eager_host:.1f}); graph replay "
          f"{graph_ms:.1f} ms (host {graph_host:.2f}); capture {capture_s:.1f} s; peak during "
          f"capture+replay {peak:.2f} GiB; loss {float(static_loss):.3f}", flush=True)
    del graph, static_loss, opt, model
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--modes", nargs="+", default=["torch-adamw", "forge-bf16"])
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for mode in a.modes:
        run(a.model, a.seq, mode, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
