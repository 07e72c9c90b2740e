#!/usr/bin/env python3
"""Summarizes `gpu_check.sh trace` runs: for each (layer, T, states) the median step time over
the repetitions of each build and stagger, and the M+U share (one CTA in its main loop while
the other updates) of the median run.

    python3 bench/trace_sweep.py OUT_DIR      # OUT_DIR/<build>-s<ns>-r<rep>/trace.md
"""
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
        m = re.match(r"^(\w+)-s(\d+)-r(\d+)$", d.name)
        if not m or not (d / "trace.md").exists():
            continue
        for row in read_table(d / "trace.md"):
            runs[(m.group(1), int(m.group(2)))][row["case"]].append(row)
    if not runs:
        print("no trace runs under", out_dir)
        return 1
    keys = sorted(runs, key=lambda k: (k[0] != "default", k[1]))
    cases = list(dict.fromkeys(c for k in keys for c in runs[k]))
    print("median ms over repetitions (M+U share of the median run); columns: build/stagger ns")
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out"))
