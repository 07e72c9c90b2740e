"""step_profile.py — where a training step's GPU time goes (forge-bench --profile N).

After a case's timed steps, N more steps run under torch.profiler (of a CUDA-graphed case, N
more replays: the kernels inside them are recorded, the phases are not timed apart). The
device time of every kernel is summed per step, by category (FORGE's fused weight-gradient +
update, FORGE's element-wise step, cuBLAS GEMMs, attention, torch's optimizer, the rest) and
by kernel. The step's wall time minus its kernel time is time the GPU had nothing to run
(launch or CPU bound, or kernels serialized behind the host). On a CPU run the same table
holds the operators' self CPU time. The host's CUDA runtime calls (launches, synchronizations,
allocations) are summed the same way. Then the step's phases (forward, backward, optimizer)
are timed on both sides, host clock and GPU events, for the same steps: a phase whose GPU
time equals its host time kept the GPU waiting on the host. Last, one more step runs under
cProfile: the host's time by Python function (cProfile's own overhead inflates it), with the
backward on the calling thread so that cProfile sees it on every Python version.
"""
from __future__ import annotations

import cProfile
import gc
import os
import pstats
import re
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

# (category, regex on the kernel name), first match wins.
CATEGORIES = [
    ("forge wgrad + update", r"wgrad_"),
    ("forge element-wise step", r"forge::.*(elementwise_kernel|state_kernel)"),
    ("torch optimizer", r"(?i)adam|multi_tensor_apply"),
    ("attention", r"(?i)flash|fmha|attention|sdpa"),
    ("GEMM (cuBLAS)", r"(?i)gemm|nvjet|cutlass|xmma|^sm\d+_"),
    ("other", r""),
]
TOP_KERNELS = 15
TOP_HOST_FUNCTIONS = 30
TOP_API_CALLS = 8


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"  # unreachable: the last pattern matches everything


def _event_us(evt, cuda: bool) -> float:
    """µs of one profiler event that counts: a kernel (or memcpy/memset) on a GPU run, an
    operator's self CPU time on a CPU run; 0 for the rest. User annotations (such as
    torch.optim's "Optimizer.step#AdamW.step") also appear on the GPU timeline, as ranges
    around kernels already counted: they are skipped."""
    on_device = evt.device_type == torch.autograd.DeviceType.CUDA
    if on_device != cuda or getattr(evt, "is_user_annotation", False):
        return 0.0
    if cuda:
        return float(evt.time_range.elapsed_us())
    return float(evt.self_cpu_time_total)


def _is_runtime_call(evt) -> bool:
    """A host-side CUDA runtime or driver call (cudaLaunchKernel, cudaStreamSynchronize,
    cuLaunchKernelEx, ...), as the profiler records them on the CPU timeline."""
    return (evt.device_type == torch.autograd.DeviceType.CPU
            and re.match(r"cu[A-Z]|cuda[A-Z]", evt.name) is not None)


class _GcTimer:
    """Python's garbage collections while active: count and milliseconds (a collection of
    the oldest generation walks every object of the process: torch's, the model's)."""

    def __init__(self):
        self.count, self.ms, self._t0 = 0, 0.0, None

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.count += 1
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def phase_times(phases: Sequence[Tuple[str, Callable[[], object]]], steps: int,
                device: torch.device) -> dict:
    """Runs `steps` steps made of `phases` (in order) and returns, per phase, the median host
    milliseconds to issue it and (on a GPU) the median GPU milliseconds between the events
    recorded around it, how long the host waited for the GPU after the last phase, and the
    garbage collections per step."""
    cuda = device.type == "cuda"
    host: Dict[str, List[float]] = {name: [] for name, _ in phases}
    gpu: Dict[str, List[float]] = {name: [] for name, _ in phases}
    waits: List[float] = []
    with _GcTimer() as collections:
        _timed_phases(phases, steps, cuda, host, gpu, waits)
    return dict(
        peak_gib=_phase_peaks(phases) if cuda else None,
        host_ms={k: round(statistics.median(v), 2) for k, v in host.items()},
        gpu_ms={k: round(statistics.median(v), 2) for k, v in gpu.items()} if cuda else None,
        host_waited_ms=round(statistics.median(waits), 2) if cuda else None,
        gc_per_step=round(collections.count / steps, 2),
        gc_ms_per_step=round(collections.ms / steps, 2))


def _phase_peaks(phases) -> Dict[str, float]:
    """One more step, phase by phase: the peak of allocated GPU memory within each (GiB), so
    the phase that sets the step's peak is known (the caching allocator counts at allocation
    time, on the host: no synchronization needed)."""
    peaks = {}
    for name, fn in phases:
        torch.cuda.reset_peak_memory_stats()
        fn()
        peaks[name] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return peaks


def _timed_phases(phases, steps: int, cuda: bool, host: Dict[str, List[float]],
                  gpu: Dict[str, List[float]], waits: List[float]) -> None:
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)]
            events[0].record()
        t = time.perf_counter()
        for i, (name, fn) in enumerate(phases):
            fn()
            now = time.perf_counter()
            host[name].append((now - t) * 1e3)
            t = now
            if cuda:
                events[i + 1].record()
        if cuda:
            events[-1].synchronize()
            waits.append((time.perf_counter() - t) * 1e3)
            for i, (name, _) in enumerate(phases):
                gpu[name].append(events[i].elapsed_time(events[i + 1]))


def host_profile(step: Callable[[], object], device: torch.device) -> dict:
    """One step under cProfile: the host's milliseconds and the TOP_HOST_FUNCTIONS functions
    by own time (ms per step). Its backward runs on the calling thread: on a GPU autograd
    otherwise runs it on a worker thread of its own, which cProfile before Python 3.12 (one
    thread's profiler) does not see, so FORGE's backward hooks would be missing."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    with torch.autograd.set_multithreading_enabled(False):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_, ncalls, tottime, _, _) in stats.stats.items():
        where = func if path == "~" else f"{os.path.basename(path)}:{line}({func})"
        rows.append((tottime, ncalls, where))
    rows.sort(reverse=True)
    return dict(ms=round(stats.total_tt * 1e3, 1),
                top=[dict(name=where[:120], ms=round(t * 1e3, 2), calls=n)
                     for t, n, where in rows[:TOP_HOST_FUNCTIONS]])


def profile_steps(step: Callable[[], object], steps: int, device: torch.device,
                  phases: Optional[Sequence[Tuple[str, Callable[[], object]]]] = None) -> dict:
    """Runs `step` `steps` times under torch.profiler, then `steps` times phase by phase
    (`phases`, the same step cut into named parts) when given, then once under cProfile;
    returns per-step milliseconds by category and for the TOP_KERNELS largest kernels, the
    kernel launches and the CUDA runtime calls per step, the phase times, and the host
    profile."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    kernels: Dict[str, List[float]] = {}  # name -> [µs, launches]
    api: Dict[str, List[float]] = {}      # CUDA runtime call -> [µs, calls]
    for evt in prof.events():
        if cuda and _is_runtime_call(evt):
            entry = api.setdefault(evt.name, [0.0, 0])
            entry[0] += float(evt.time_range.elapsed_us())
            entry[1] += 1
            continue
        us = _event_us(evt, cuda)
        if us <= 0:
            continue
        entry = kernels.setdefault(evt.name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    by_category: Dict[str, float] = {label: 0.0 for label, _ in CATEGORIES}
    for name, (us, _) in kernels.items():
        by_category[category(name)] += us / steps / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return dict(
        steps=steps, timing="device" if cuda else "cpu-self",
        kernel_ms=round(sum(v[0] for v in kernels.values()) / steps / 1e3, 3),
        launches=round(sum(v[1] for v in kernels.values()) / steps),
        categories={k: round(v, 3) for k, v in by_category.items()},
        top=[dict(name=name[:160], category=category(name), ms=round(us / steps / 1e3, 3),
                  calls=round(n / steps)) for name, (us, n) in top],
        api=[dict(name=name, ms=round(us / steps / 1e3, 3), calls=round(n / steps))
             for name, (us, n) in sorted(api.items(), key=lambda kv: -kv[1][0])[:TOP_API_CALLS]],
        phases=phase_times(phases, steps, device) if phases else None,
        host=host_profile(step, device))


def markdown(info: dict, rows: List[dict]) -> str:
    """One section per profiled case: step wall time, kernel time by category, top kernels."""
    lines = [f"# forge-bench --profile, {info['date'][:10]}, {info['gpu']}", "",
             f"torch {info['torch']}, forge {info['forge']}. Command: `{info['command']}`", "",
             "Per step, from torch.profiler over the profiled steps (after the timed ones). "
             "wall = the case's median step time without the profiler; GPU idle = wall − kernel "
             "time (the GPU had nothing to run: within a CUDA graph replay, the gaps between "
             "its kernels). On a CPU run: operators' self CPU times.", ""]
    for row in rows:
        prof = row.get("profile")
        if not prof:
            continue
        wall = row.get("step_ms")
        title = f"{row['model']} seq {row['seq']}{' ckpt' if row['ckpt'] else ''} {row['mode']}"
        if row.get("graph") and not row["mode"].endswith("-graph"):
            title += " (CUDA graph)"
        lines += [f"## {title}", ""]
        if prof["timing"] == "device":
            idle = f", GPU idle {wall - prof['kernel_ms']:.1f} ms" if wall is not None else ""
            summary = (f"wall {wall} ms, kernels {prof['kernel_ms']:.1f} ms{idle}, "
                       f"{prof['launches']} launches per step")
        else:  # CPU run: operators' self times, no GPU to be idle
            summary = (f"wall {wall} ms, operators' self CPU time {prof['kernel_ms']:.1f} ms, "
                       f"{prof['launches']} operator calls per step")
        each = row.get("step_ms_each")
        if each:
            summary += (f". Timed steps {min(each)}–{max(each)} ms, issued by the host in "
                        f"{row.get('host_ms')} ms (median)")
        again = prof.get("retimed")
        if again:
            summary += (f"; timed again after the profile: {again['step_ms']} ms, issued in "
                        f"{again['host_ms']} ms")
        lines += [summary, "",
                  "| category | ms per step |", "| --- | --- |"]
        lines += [f"| {k} | {v:.2f} |" for k, v in prof["categories"].items() if v > 0]
        lines += ["", "| kernel | category | ms per step | calls per step |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| `{t['name'][:100]}` | {t['category']} | {t['ms']:.2f} | {t['calls']} |"
                  for t in prof["top"]]
        if prof.get("api"):
            lines += ["", "| CUDA runtime call (host) | ms per step | calls per step |",
                      "| --- | --- | --- |"]
            lines += [f"| `{a['name']}` | {a['ms']:.2f} | {a['calls']} |" for a in prof["api"]]
        ph = prof.get("phases")
        if ph:
            gpu = ph["gpu_ms"] or {}
            peak = ph.get("peak_gib") or {}
            lines += ["", f"Phases, median of {prof['steps']} steps (host clock; GPU events "
                      "around each phase; peak allocated memory within the phase, one more "
                      "step):", "", "| phase | host ms | GPU ms | peak GiB |",
                      "| --- | --- | --- | --- |"]
            lines += [f"| {k} | {v:.1f} | "
                      + (f"{gpu[k]:.1f}" if k in gpu else "") + " | "
                      + (f"{peak[k]:.2f}" if k in peak else "") + " |"
                      for k, v in ph["host_ms"].items()]
            if ph["host_waited_ms"] is not None:
                lines += ["", f"After the last phase the host waited {ph['host_waited_ms']:.1f} ms "
                          "for the GPU."]
            lines += ["", f"Python garbage collections: {ph['gc_per_step']} per step, "
                      f"{ph['gc_ms_per_step']:.1f} ms per step."]
        host = prof.get("host")
        if host:
            lines += ["", f"Host, one step under cProfile: {host['ms']} ms.", "",
                      "| function | own ms | calls |", "| --- | --- | --- |"]
            lines += [f"| `{h['name']}` | {h['ms']:.2f} | {h['calls']} |" for h in host["top"]]
        lines.append("")
    return "\n".join(lines)
