"""step_profile.py — where a training step's GPU time goes (forge-bench --profile N).

After a case's timed steps, N more steps run under torch.profiler. The device time of every
kernel is summed per step, by category (FORGE's fused weight-gradient + update, FORGE's
element-wise step, cuBLAS GEMMs, attention, torch's optimizer, the rest) and by kernel. The
step's wall time minus its kernel time is time the GPU had nothing to run (launch or
CPU bound, or kernels serialized behind the host). On a CPU run the same table holds the
operators' self CPU time.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List

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


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"  # unreachable: the last pattern matches everything


def _self_time_us(evt, cuda: bool) -> float:
    """The event's self time in µs: device time for a kernel, CPU time otherwise (the
    attribute names changed across torch versions)."""
    names = (["self_device_time_total", "self_cuda_time_total"] if cuda
             else ["self_cpu_time_total"])
    for name in names:
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_steps(step: Callable[[], object], steps: int, device: torch.device) -> dict:
    """Runs `step` `steps` times under torch.profiler; returns per-step milliseconds by
    category and for the TOP_KERNELS largest kernels, and the kernel launches per step."""
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
    for evt in prof.key_averages():
        is_kernel = evt.device_type == torch.autograd.DeviceType.CUDA
        if cuda != is_kernel:
            continue
        us = _self_time_us(evt, cuda)
        if us <= 0:
            continue
        entry = kernels.setdefault(evt.key, [0.0, 0])
        entry[0] += us
        entry[1] += evt.count
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
                  calls=round(n / steps)) for name, (us, n) in top])


def markdown(info: dict, rows: List[dict]) -> str:
    """One section per profiled case: step wall time, kernel time by category, top kernels."""
    lines = [f"# forge-bench --profile, {info['date'][:10]}, {info['gpu']}", "",
             f"torch {info['torch']}, forge {info['forge']}. Command: `{info['command']}`", "",
             "Per step, from torch.profiler over the profiled steps (after the timed ones). "
             "wall = the case's median step time without the profiler; idle = wall − kernel "
             "time (the GPU had nothing to run).", ""]
    for row in rows:
        prof = row.get("profile")
        if not prof:
            continue
        wall = row.get("step_ms")
        title = f"{row['model']} seq {row['seq']}{' ckpt' if row['ckpt'] else ''} {row['mode']}"
        lines += [f"## {title}", ""]
        idle = f", idle {wall - prof['kernel_ms']:.1f} ms" if wall is not None else ""
        lines += [f"wall {wall} ms, kernels {prof['kernel_ms']:.1f} ms ({prof['timing']} time)"
                  f"{idle}, {prof['launches']} launches per step", "",
                  "| category | ms per step |", "| --- | --- |"]
        lines += [f"| {k} | {v:.2f} |" for k, v in prof["categories"].items() if v > 0]
        lines += ["", "| kernel | category | ms per step | calls per step |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| `{t['name'][:100]}` | {t['category']} | {t['ms']:.2f} | {t['calls']} |"
                  for t in prof["top"]]
        lines.append("")
    return "\n".join(lines)
