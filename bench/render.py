"""render.py — the current tables and plots, rendered from the results table.

    python3 bench/render.py [--table bench/results/results.csv] [--out bench/results]

For every (GPU, benchmark, case, variant, metric) the latest row of bench/results/results.csv
is current (record.current), except the rows of an A/B comparison (their command marked
"(gpu_check.sh ab)": runs alternated to compare settings or builds within one call) and rows
measured with a FORGE_DEBUG_* switch set: they are never current. The pages depend on the
current rows alone, so record.py's compaction (which keeps exactly those) changes none of them.
Writes, replacing what was there:
  wgrad.md / wgrad.png     the fused step over Llama-3.1-8B's 224 linear layers against
                           cuBLAS dW and the unfused ways (bench/wgrad_bench,
                           bench/torch_unfused.py), totals and per layer
  steps.md                 whole training steps (forge-bench): peak memory and step time
  ranks.md                 GPUs needed per model: rank 0 of N simulated (forge-bench
                           --simulate-ranks), its peak against an H100's and an H200's
  parity.md                convergence parity (forge-bench --parity)
  host.md                  the host's cost per layer (bench/host_overhead.py)
  power.md                 each variant run back to back: its SM clock, power and energy per
                           call (bench/wgrad_bench --soak)
Each page has one section per GPU (or host), the baselines' GPU (docs/performance.md) first: a figure from one card
never stands in a table beside another card's. Every section says which dates, commits and
commands its figures come from; wgrad.png plots the first section's totals.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results")
# The GPU of the baselines (docs/performance.md) and of the targets: its section comes first.
ANCHOR_GPU = "NVIDIA H200"

# wgrad_bench / torch_unfused variants shown in the totals, with their column titles.
WGRAD_TOTALS = [
    ("wgrad", "fused_bf16", "FORGE bf16 W + states, nearest"),
    ("wgrad", "fused_sr", "FORGE bf16, stochastic rounding (default)"),
    ("wgrad", "fused_int8", "FORGE int8 states"),
    ("wgrad", "fused_sr_int8", "FORGE SR W + int8 states"),
    ("wgrad", "fused_fp8", "FORGE fp8 states"),
    ("wgrad", "fused_sr_fp8", "FORGE SR W + fp8 states"),
    ("wgrad", "fused_sr_int4", "FORGE SR W + int4 states"),
    ("wgrad", "fused_master", "FORGE fp32 master + states"),
    ("wgrad", "cublas_fp32_out", "cuBLAS dW alone"),
    ("wgrad", "unfused", "cuBLAS dW + our AdamW pass"),
    ("torch_unfused", "torch_unfused", "cuBLAS dW + torch fused AdamW"),
]
WGRAD_LAYER = [
    ("fused_adamw_bf16_states", "FORGE bf16"),
    ("fused_adamw_bf16_sr_weight_bf16_sr_states", "FORGE SR"),
    ("fused_adamw_int8_states", "FORGE int8"),
    ("fused_adamw_fp8_states", "FORGE fp8"),
    ("cublas_dw_fp32_out", "cuBLAS dW"),
    ("unfused_cublas_plus_adamw_bf16", "unfused"),
    ("epilogue_only_T32", "update alone (T = 32)"),
]


Key = Tuple[str, str, str, str]  # (benchmark, case, variant, metric)


# The latest row per (gpu, benchmark, case, variant, metric). It is record.py's, which keeps
# exactly these rows when it compacts the table.
current = record.current


def by_gpu(cur) -> List[Tuple[str, Dict[Key, Dict[str, str]]]]:
    """current()'s figures split per GPU: ANCHOR_GPU first, then the others by name."""
    split: Dict[str, Dict[Key, Dict[str, str]]] = collections.defaultdict(dict)
    for (gpu, *key), r in cur.items():
        split[gpu][tuple(key)] = r
    return sorted(split.items(), key=lambda item: (item[0] != ANCHOR_GPU, item[0]))


def sources(rows) -> List[str]:
    seen = collections.OrderedDict()
    for r in sorted(rows, key=lambda r: r["date"]):
        seen[(r["date"], r["gpu"], r["commit"], r["command"])] = None
    return [f"- {d}, {g}, commit {c}: `{cmd}`" for d, g, c, cmd in seen]


def fmt(value: str, digits: int = 1) -> str:
    try:
        return f"{float(value):.{digits}f}"
    except ValueError:
        return value


WGRAD_TITLE = "The fused step over Llama-3.1-8B's 224 linear layers"
WGRAD_INTRO = ("Milliseconds, sum over the layers of each layer's median (bench/wgrad_bench: L2 "
               "flushed before each call, variants interleaved call by call; "
               "bench/torch_unfused.py: torch's dW GEMM then `torch._fused_adamw_`). bf16 inputs "
               "and weights, AdamW.")


def render_wgrad(cur, png: str = "") -> List[str]:
    """One GPU's totals and per-layer table; plots the totals into png when given."""
    totals = {}
    used = []
    for (bench, case, variant, metric), r in cur.items():
        if metric == "ms" and case.startswith("llama-3.1-8b linears T="):
            tokens = int(case.rsplit("=", 1)[1])
            totals[(bench, variant, tokens)] = float(r["value"])
            used.append(r)
    if not totals:
        return []
    ts = sorted({t for _, _, t in totals})
    cols = [(b, v, title) for b, v, title in WGRAD_TOTALS if any((b, v, t) in totals for t in ts)]
    lines = ["| T | " + " | ".join(title for _, _, title in cols) + " |",
             "| --- |" + " --- |" * len(cols)]
    for t in ts:
        cells = [fmt(totals[(b, v, t)]) if (b, v, t) in totals else "" for b, v, _ in cols]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    # per layer, latest wgrad run
    layer_rows = [r for (b, c, v, m), r in cur.items() if b == "wgrad" and m == "ms"
                  and not c.startswith(("llama", "elementwise"))]
    if layer_rows:
        cases = sorted({r["case"] for r in layer_rows},
                       key=lambda c: (c.split(" T=")[0], int(c.split("T=")[1])))
        by = {(r["case"], r["variant"]): r["value"] for r in layer_rows}
        lines += ["", "Per layer (ms):", "",
                  "| layer | " + " | ".join(t for _, t in WGRAD_LAYER) + " |",
                  "| --- |" + " --- |" * len(WGRAD_LAYER)]
        for c in cases:
            lines.append(f"| {c} | " + " | ".join(fmt(by.get((c, v), ""), 3)
                                                   for v, _ in WGRAD_LAYER) + " |")
        used += layer_rows
    if png:
        _plot_wgrad(totals, ts, cols, png)
        lines = ["![totals](" + os.path.basename(png) + ")", ""] + lines
    return lines + ["", "Measured:"] + sources(used)


def _plot_wgrad(totals, ts, cols, path) -> None:
    if not cols:
        return  # (no variant of the totals table was measured)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(cols)
    for i, (b, v, title) in enumerate(cols):
        xs = [j + i * width for j, t in enumerate(ts) if (b, v, t) in totals]
        ys = [totals[(b, v, t)] for t in ts if (b, v, t) in totals]
        ax.bar(xs, ys, width, label=title)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ts))])
    ax.set_xticklabels([f"T = {t}" for t in ts])
    ax.set_ylabel("ms (224 layers)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Llama-3.1-8B linear layers: dW + AdamW update")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The largest per-rank peak a card is taken to fit (its capacity less what its driver, the
# CUDA context and NCCL's buffers take): an 80 GB H100 and a 141 GB H200.
RANK_FITS = (("H100 80 GB", 75.0), ("H200 141 GB", 130.0))
STEPS_TITLE = "Whole training steps"
STEPS_INTRO = ("forge-bench: random-init models from their public configs, batch 1, bf16 "
               "parameters, median step of 8 after 2 warm-ups (forward, backward, optimizer), "
               "peak = torch.cuda.max_memory_allocated. Cells: peak GiB of the first step / of "
               "the steps after it (one peak where a run did not record them apart), step ms "
               "(`-graph`: the step replayed as one CUDA graph).")


def render_steps(cur) -> List[str]:
    rows = [r for (b, _, _, _), r in cur.items() if b == "step"]
    if not rows:
        return []
    cases = sorted({r["case"] for r in rows})
    variants = sorted({r["variant"] for r in rows})
    by = {(r["case"], r["variant"], r["metric"]): r["value"] for r in rows}
    lines = ["| case | " + " | ".join(variants) + " |", "| --- |" + " --- |" * len(variants)]
    for c in cases:
        cells = []
        for v in variants:
            if (c, v, "oom") in by:
                cells.append("OOM")
            elif (c, v, "step_ms") in by:
                first, steady = by.get((c, v, "first_peak_gib")), by.get((c, v, "steady_peak_gib"))
                if first is not None and steady is not None:
                    memory = f"{fmt(first)} / {fmt(steady)} GiB"
                else:
                    memory = f"{fmt(by.get((c, v, 'peak_gib'), ''))} GiB"
                cells.append(f"{memory}, {fmt(by[(c, v, 'step_ms')])} ms")
            else:
                cells.append("")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines + ["", "Measured:"] + sources(rows)


RANKS_TITLE = "GPUs needed per model"
RANKS_INTRO = ("forge-bench --simulate-ranks N (--fsdp, --tp K): rank 0 of an N-rank job alone "
               "on one card (torch's fake process group), the model built on the meta device and "
               "only rank 0's shards made, so its peak is the real rank's; its step time leaves "
               "out all communication. Cells: rank 0's peak GiB (its weights + optimizer states "
               "GiB), step ms. A card fits a rank whose peak is at most "
               + " or ".join(f"{limit} GiB ({card})" for card, limit in RANK_FITS) + ".")


def _ranks_of(case: str) -> Tuple[str, int]:
    """('llama-3.1-70b seq=4096 ckpt fsdp', 8) from 'llama-3.1-70b seq=4096 ckpt 8 ranks fsdp'."""
    words = case.split()
    i = words.index("ranks")
    return " ".join(words[:i - 1] + words[i + 1:]), int(words[i - 1])


def render_ranks(cur) -> List[str]:
    rows = [r for (b, _, _, _), r in cur.items() if b == "ranks"]
    if not rows:
        return []
    by = {(r["case"], r["variant"], r["metric"]): r["value"] for r in rows}
    cases = sorted({r["case"] for r in rows}, key=lambda c: (_ranks_of(c)[0], _ranks_of(c)[1]))
    variants = sorted({r["variant"] for r in rows})
    lines = ["| case | ranks | " + " | ".join(variants) + " |",
             "| --- | --- |" + " --- |" * len(variants)]
    need: Dict[Tuple[str, str, str], int] = {}  # (job, variant, card) -> fewest ranks that fit
    for c in cases:
        job, world = _ranks_of(c)
        cells = []
        for v in variants:
            if (c, v, "oom") in by:
                cells.append("OOM")
                continue
            peak = by.get((c, v, "peak_gib"))
            if peak is None:
                cells.append("")
                continue
            held = [by.get((c, v, m)) for m in ("weights_gib", "states_gib")]
            held = " + ".join(fmt(x) for x in held if x is not None)
            cells.append(f"{fmt(peak)} ({held}), {fmt(by.get((c, v, 'step_ms'), ''))} ms")
            for card, limit in RANK_FITS:
                if float(peak) <= limit:
                    key = (job, v, card)
                    need[key] = min(need.get(key, world), world)
        lines.append(f"| {job} | {world} | " + " | ".join(cells) + " |")
    jobs = sorted({_ranks_of(c)[0] for c in cases})
    lines += ["", "Fewest ranks measured whose rank 0 fits:", "",
              "| case | " + " | ".join(f"{v}: {card}" for v in variants for card, _ in RANK_FITS)
              + " |", "| --- |" + " --- |" * (len(variants) * len(RANK_FITS))]
    for job in jobs:
        lines.append(f"| {job} | " + " | ".join(
            str(need.get((job, v, card), "none measured")) for v in variants
            for card, _ in RANK_FITS) + " |")
    return lines + _rank_bytes(cases, variants, by) + ["", "Measured:"] + sources(rows)


# rank 0's bytes by phase (forge-bench's memory_phases), in the order a step meets them
RANK_BYTES = [("weights_gib", "weights"), ("states_gib", "states"),
              ("held_gib", "held between steps"), ("saved_gib", "saved by the forward"),
              ("forward_extra_gib", "forward's transients"),
              ("backward_extra_gib", "backward's transients"), ("step_extra_gib", "step's")]


def _rank_bytes(cases, variants, by) -> List[str]:
    """Where rank 0's bytes go, for every measured case that has the phases."""
    lines = []
    for c in cases:
        job, world = _ranks_of(c)
        for v in variants:
            if (c, v, "held_gib") not in by:
                continue
            if not lines:
                lines = ["", "Where rank 0's bytes go (GiB; a phase's transients are what it "
                         "allocates above what it starts from):", "",
                         "| case | ranks | variant | " + " | ".join(n for _, n in RANK_BYTES)
                         + " | peak |", "| --- | --- | --- |" + " --- |" * (len(RANK_BYTES) + 1)]
            lines.append(f"| {job} | {world} | {v} | " + " | ".join(
                fmt(by.get((c, v, m), "")) for m, _ in RANK_BYTES)
                + f" | {fmt(by.get((c, v, 'peak_gib'), ''))} |")
    return lines


SOAK_TITLES = {"ms": "ms per call", "sm_mhz": "SM MHz", "watts": "W",
               "mj_per_call": "mJ per call", "power_cap_share": "under the power cap"}


def render_soak(cur) -> List[str]:
    """wgrad_bench --soak's figures: a row per (case, variant), a column per metric."""
    rows = [r for (b, _, _, _), r in cur.items() if b == "wgrad_soak"]
    if not rows:
        return []
    by = {(r["case"], r["variant"], r["metric"]): r["value"] for r in rows}
    keys = sorted({(r["case"], r["variant"]) for r in rows},
                  key=lambda k: (int(k[0].rsplit("T=", 1)[1]), k[1]))
    lines = ["| case | variant | " + " | ".join(SOAK_TITLES[m] for m in record.SOAK_METRICS) + " |",
             "| --- | --- |" + " --- |" * len(record.SOAK_METRICS)]
    for case, variant in keys:
        cells = [fmt(by.get((case, variant, m), ""), {"ms": 4, "power_cap_share": 2}.get(m, 1))
                 for m in record.SOAK_METRICS]
        lines.append(f"| {case} | {variant} | " + " | ".join(cells) + " |")
    return lines + ["", "Measured:"] + sources(rows)


def render_simple(cur, bench: str, digits: int) -> List[str]:
    rows = [r for (b, _, _, _), r in cur.items() if b == bench]
    if not rows:
        return []
    lines = ["| case | variant | metric | value |", "| --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["case"], r["variant"])):
        lines.append(f"| {r['case']} | {r['variant']} | {r['metric']} | "
                     f"{fmt(r['value'], digits)} |")
    return lines + ["", "Measured:"] + sources(rows)


def page(title: str, intro: str, cur, section) -> List[str]:
    """A page: its title and intro, then one section per GPU that has figures for it
    (section(figures of one GPU, whether it is the first section) -> lines, or [])."""
    lines: List[str] = []
    for gpu, figures in by_gpu(cur):
        body = section(figures, not lines)
        if body:
            lines += ["", f"## {gpu}", ""] + body
    return [f"# {title}", "", intro] + lines + [""] if lines else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", default=record.TABLE)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    cur = current(record.read(args.table))
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "wgrad.png")
    pages = {
        "wgrad.md": page(WGRAD_TITLE, WGRAD_INTRO, cur,
                         lambda figures, first: render_wgrad(figures, png if first else "")),
        "steps.md": page(STEPS_TITLE, STEPS_INTRO, cur, lambda figures, _: render_steps(figures)),
        "ranks.md": page(RANKS_TITLE, RANKS_INTRO, cur, lambda figures, _: render_ranks(figures)),
        "parity.md": page(
            "Convergence parity",
            "forge-bench --parity: forge-train's model named in each case (by default the "
            "~100M one, bf16, seq 512 × batch 8; the commands say), on text; mean |Δloss| over "
            "the second half of the run against the reference.",
            cur, lambda figures, _: render_simple(figures, "parity", 4)),
        "host.md": page(
            "The host's cost per layer per step",
            "bench/host_overhead.py: a stack of tiny Linears (or transformers Conv1Ds, "
            "`--layer conv1d`, or element-wise parameters, `--layer scale`), so that only the "
            "host's work per layer is timed (median µs per layer or parameter per step).",
            cur, lambda figures, _: render_simple(figures, "host_overhead", 1)),
        "power.md": page(
            "Clock, power and energy per call",
            "bench/wgrad_bench --soak (scripts/gpu_check.sh soak): each variant of one layer "
            "run back to back for some seconds, no L2 flush; the SM clock and power are the "
            "means of nvidia-smi's 50 ms samples after the variant's first second, the energy "
            "per call their power × ms. T = 32: the update alone; T = 0: the AdamW pass alone.",
            cur, lambda figures, _: render_soak(figures)),
    }
    for name, lines in pages.items():
        if lines:
            with open(os.path.join(args.out, name), "w") as f:
                f.write("\n".join(lines))
            print(f"render: {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
