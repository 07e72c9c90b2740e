#!/usr/bin/env python3
"""Summarizes `gpu_check.sh trace` runs: for each (layer, T, states) the median step time over
the repetitions of each build and setting, and the M+U share (one CTA in its main loop while
the other updates) of the median run; then the Llama-3.1-8B totals (224 layers) per column.

    python3 bench/trace_sweep.py OUT_DIR      # OUT_DIR/<build>-<setting>-r<rep>/trace.md
    python3 bench/trace_sweep.py --overlap trace-4096x4096-T512.csv
    python3 bench/trace_sweep.py --gaps trace-4096x4096-T512.csv

--overlap reads one launch's raw records (wgrad_bench --trace's CSV) and gives the median
main-loop and update µs of the CTAs grouped by how much of that phase another CTA of the same
SM spent updating: does a phase run slower beside an update? --gaps gives how long a CTA slot
stands empty between the end of one CTA and the start of the next on the same SM.
"""
import csv
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def read_table(path):
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 15 or not re.match(r"^[0-9.]+$", cells[3]):
            continue
        rows.append(dict(case=f"{cells[0]} T={cells[1]} {cells[2]}", ms=float(cells[3]),
                         main=float(cells[6]), update=float(cells[7]), mu=float(cells[13])))
    return rows


def main(out_dir):
    runs = defaultdict(lambda: defaultdict(list))  # (build, ns) -> case -> [row]
    for d in sorted(Path(out_dir).iterdir()):
        m = re.match(r"^(default|defs\d+)-(.+)-r(\d+)$", d.name)
        if not m or not (d / "trace.md").exists():
            continue
        for row in read_table(d / "trace.md"):
            runs[(m.group(1), m.group(2))][row["case"]].append(row)
    if not runs:
        print("no trace runs under", out_dir)
        return 1
    keys = sorted(runs, key=lambda k: (k[0] != "default", k[0], k[1] != "default", k[1]))
    cases = list(dict.fromkeys(c for k in keys for c in runs[k]))
    print("median ms over repetitions (M+U share of the median run); columns: build/setting")
    print("| case | " + " | ".join(f"{b}/{ns}" for b, ns in keys) + " |")
    print("| --- " * (len(keys) + 1) + "|")
    for case in cases:
        cells = []
        for k in keys:
            rows = sorted(runs[k].get(case, []), key=lambda r: r["ms"])
            if not rows:
                cells.append("-")
                continue
            med = rows[len(rows) // 2]
            cells.append(f"{statistics.median(r['ms'] for r in rows):.4f} ({med['mu']:.2f}, n={len(rows)})")
        print(f"| {case} | " + " | ".join(cells) + " |")
    # Llama-3.1-8B: per decoder layer q, k, v, o, gate, up (2 of each shape) and down.
    per_layer = {"q_proj/o_proj": 2, "k_proj/v_proj": 2, "gate_proj/up_proj": 2, "down_proj": 1}
    print("\nLlama-3.1-8B totals, 224 layers (ms, from the medians):")
    for tokens in sorted({int(re.search(r"T=(\d+)", c).group(1)) for c in cases}):
        for states in ("bf16", "bf16 SR"):
            totals, complete = [], True
            for k in keys:
                total = 0.0
                for layer, n in per_layer.items():
                    name = next((c for c in runs[k] if c.startswith(layer + " ")
                                 and f" T={tokens} " in c and c.endswith(" " + states)), None)
                    if name is None:
                        complete = False
                        break
                    total += statistics.median(r["ms"] for r in runs[k][name]) * n * 32
                totals.append(total)
            if complete:
                print(f"T={tokens} {states}: " + ", ".join(
                    f"{b}/{s} {t:.2f}" for (b, s), t in zip(keys, totals)))
    return 0


def read_records(path):
    """One launch's raw records (wgrad_bench --trace's CSV), as ints."""
    with open(path) as f:
        return [{k: int(v) for k, v in r.items()} for r in csv.DictReader(f)]


def overlap(path):
    rows = read_records(path)
    by_sm = defaultdict(list)
    for r in rows:
        by_sm[r["sm"]].append(r)
    cycles_per_us = (sum(r["clock_end"] - r["clock_start"] for r in rows)
                     / sum(r["ns_end"] - r["ns_start"] for r in rows) * 1e3)
    groups = {"main": defaultdict(list), "update": defaultdict(list)}
    for ctas in by_sm.values():
        for a in ctas:
            for phase, start, end in (("main", a["clock_start"], a["clock_main_end"]),
                                      ("update", a["clock_main_end"], a["clock_end"])):
                beside = sum(max(0, min(end, b["clock_end"]) - max(start, b["clock_main_end"]))
                             for b in ctas if b is not a)
                share = beside / max(end - start, 1)
                key = "< 0.1" if share < 0.1 else "0.1-0.5" if share < 0.5 else ">= 0.5"
                groups[phase][key].append((end - start) / cycles_per_us)
    print(f"{path}: median µs per CTA phase, by the share of it another CTA spent updating")
    for phase, by_share in groups.items():
        print(f"  {phase}: " + ", ".join(
            f"{k}: {statistics.median(v):.2f} (n={len(v)})" for k, v in sorted(by_share.items())))
    return 0


def gaps(path, slots_per_sm=2):
    """How long a CTA slot of an SM stands empty between one CTA's end and the next CTA's
    start on it (global timer). The SM's CTAs in order of start each take the slot that
    freed last before it (the first wave fills the empty slots)."""
    by_sm = defaultdict(list)
    for r in read_records(path):
        by_sm[r["sm"]].append((r["ns_start"], r["ns_end"]))
    waits = []
    for ctas in by_sm.values():
        ends = []
        for start, end in sorted(ctas):
            if len(ends) < slots_per_sm:
                ends.append(end)
                continue
            freed = [e for e in ends if e <= start]
            slot = max(freed) if freed else min(ends)
            waits.append((start - slot) / 1e3)
            ends[ends.index(slot)] = end
    waits.sort()
    print(f"{path}: a slot empty between CTAs for a median {statistics.median(waits):.2f} µs "
          f"(p90 {waits[int(0.9 * (len(waits) - 1))]:.2f} µs, n={len(waits)})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--overlap":
        sys.exit(overlap(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "--gaps":
        sys.exit(gaps(sys.argv[2]))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out"))
