#!/usr/bin/env python3
"""Medians over repeated wgrad_bench runs, per setting: what `gpu_check.sh ab` prints.

The card's SM clock moves between and within calls under its power cap (docs/design.md), so a difference of a
few percent needs several full benchmarks per setting, alternating, in one call. This reads
them and gives, per setting, the median of each Llama-3.1-8B total (224 layers), its lowest
and highest repetition, and the median of each layer's fused-step times.

    python3 bench/ab_totals.py DIR   # DIR/<setting>-r<rep>/bench.md or DIR/bench-<setting>-r<rep>.md
"""
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_NUMBER = re.compile(r"\s*\**([0-9]+(?:\.[0-9]+)?)")


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(cell):
    m = _NUMBER.match(cell)
    return float(m.group(1)) if m else None


def read_bench(text):
    """(totals, layers): totals[column][T] and layers[(layer, T)][column], in ms, from one
    wgrad_bench bench.md. Columns are the tables' own headers."""
    totals, layers = defaultdict(dict), defaultdict(dict)
    header, section = None, None
    for line in text.splitlines():
        if line.startswith("## "):
            section, header = line, None
            continue
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if cells[0] in ("T", "layer (out×in)"):
            header = cells
            continue
        if header is None or set(cells[0]) <= set("- "):
            continue
        if header[0] == "T" and section and section.startswith("## Llama"):
            for name, cell in zip(header[1:], cells[1:]):
                value = _number(cell)
                if value is not None and "speedup" not in name:
                    totals[name][cells[0]] = value
        elif header[0] == "layer (out×in)":
            for name, cell in zip(header[2:], cells[2:]):
                value = _number(cell)
                if value is not None and "ms" in name and "epilogue" not in name:
                    layers[(cells[0], cells[1])][name] = value
    return totals, layers


def collect(out_dir):
    """setting -> [bench.md text], in repetition order."""
    runs = defaultdict(list)
    root = Path(out_dir)
    for path in sorted(root.glob("*-r*/bench.md")) + sorted(root.glob("bench-*-r*.md")):
        name = path.parent.name if path.name == "bench.md" else path.stem[len("bench-"):]
        m = re.match(r"^(.+)-r(\d+)$", name)
        if m:
            runs[m.group(1)].append((int(m.group(2)), path.read_text()))
    return {s: [text for _, text in sorted(v)] for s, v in runs.items()}


def _totals_table(runs, title, cell):
    """Markdown: the Llama totals per setting and T, each cell cell(values over repetitions)."""
    per_setting = {s: [read_bench(t)[0] for t in texts] for s, texts in runs.items()}
    columns = []
    for tables in per_setting.values():
        for table in tables:
            columns += [c for c in table if c not in columns]
    lines = [title, "",
             "| setting | T | " + " | ".join(columns) + " |",
             "| --- | --- | " + " | ".join("---" for _ in columns) + " |"]
    for setting, tables in per_setting.items():
        ts = sorted({t for table in tables for col in table.values() for t in col}, key=int)
        for t in ts:
            row = []
            for c in columns:
                values = [table[c][t] for table in tables if t in table.get(c, {})]
                row.append(cell(values) if values else "")
            lines.append(f"| {setting} | {t} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def median_table(runs):
    """Markdown: the Llama totals per setting (median over repetitions, n in brackets)."""
    title = "Llama-3.1-8B totals, 224 layers: median ms over the repetitions (n)"
    return _totals_table(runs, title, lambda v: f"{statistics.median(v):.1f} ({len(v)})")


def spread_table(runs):
    """Markdown: the same totals' lowest and highest repetition. A difference between settings
    inside these ranges is not one this call can tell (2.7 % has been measured between two
    builds of code a change did not touch)."""
    return _totals_table(runs, "The same totals: lowest – highest repetition, ms",
                         lambda v: f"{min(v):.1f} – {max(v):.1f}")


def layer_table(runs, column_prefix="fused bf16 ms"):
    """Markdown: one fused column per layer and T, median per setting."""
    settings = list(runs)
    medians = {}
    for s, texts in runs.items():
        values = defaultdict(list)
        for text in texts:
            for key, cols in read_bench(text)[1].items():
                for name, v in cols.items():
                    if name.startswith(column_prefix):
                        values[key].append(v)
        medians[s] = {k: statistics.median(v) for k, v in values.items()}
    keys = sorted({k for m in medians.values() for k in m}, key=lambda k: (k[0], int(k[1])))
    lines = [f"Per layer, '{column_prefix}': median ms", "",
             "| layer | T | " + " | ".join(settings) + " |",
             "| --- | --- | " + " | ".join("---" for _ in settings) + " |"]
    for k in keys:
        lines.append(f"| {k[0]} | {k[1]} | " +
                     " | ".join(f"{medians[s][k]:.3f}" if k in medians[s] else "" for s in settings) +
                     " |")
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs = collect(argv[1])
    if not runs:
        print(f"ab_totals: no <setting>-r<rep>/bench.md under {argv[1]}", file=sys.stderr)
        return 1
    print(median_table(runs))
    print()
    print(spread_table(runs))
    print()
    print(layer_table(runs))
    print()
    print(layer_table(runs, "fused bf16 SR W + SR states"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
