"""record.py — appends a benchmark's measurements to the results table, bench/results/results.csv.

    python3 bench/record.py OUTPUT.json [...] [--commit HASH] [--table PATH] [--ab SETTING]
    python3 bench/record.py --compact [--table PATH]

Every benchmark writes a JSON file; this turns it into rows of the results table (one
measurement per row) and appends them. It knows the JSON of
  bench/wgrad_bench          (bench.json: per-layer variants and the Llama-3.1-8B totals;
                             with --soak, soak.json: clock, power and energy per variant)
  bench/torch_unfused.py     (torch-unfused.json: the fused step against torch's unfused way)
  bench/host_overhead.py     (host-overhead.json: host time per Linear per step)
  forge-bench                (forge-bench-*.json: whole training steps, with --profile their
                             GPU time by kernel category; forge-parity-*.json)
and refuses anything else. Rows: date (UTC), gpu, commit, benchmark, case, variant, metric,
value, command (--ab marks an A/B call's runs). The commit defaults to `git rev-parse --short
HEAD` of this checkout, with "+dirty" when the tree has uncommitted changes. bench/render.py
renders the current tables from the table.

Commands are kept without the machine they ran on (relative_command): a path under this
checkout, or in a build folder (build/, build-*/) of any checkout, is written relative to the
checkout's root; any other absolute path becomes "$OUT/..." (below /root/out or /tmp: the part
under it; elsewhere: its last component).

The table is bounded: beside its current rows it holds at most COMPACT_ABOVE others, or the
last call's. New rows are only ever appended; once more than COMPACT_ABOVE rows are not current
(superseded by a later run of the same figure, an A/B comparison's, or measured with a
FORGE_DEBUG_* switch), record.py compacts the table after appending (--compact: now): every
current row (current(), the rows render.py shows) and the rows just appended stay as they are,
in their order; each other row goes into history.csv.gz beside the table, summarised with the
others of its GPU, commit, benchmark, case, variant, metric and setting (its command, output
folders as "$OUT"): first and last date, n, median, min and max. The history is only appended
to, one gzip member per compaction; a setting measured at one commit adds one summary per figure
however often it ran. Raw rows that were committed before a compaction stay in git history.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gzip
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
from typing import Dict, Iterable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # this checkout
TABLE = os.path.join(HERE, "results", "results.csv")
COLUMNS = ("date", "gpu", "commit", "benchmark", "case", "variant", "metric", "value", "command")
# Beside the table: the summaries of the rows that compact() took out of it.
HISTORY_NAME = "history.csv.gz"
HISTORY_COLUMNS = ("first_date", "last_date", "gpu", "commit", "benchmark", "case", "variant",
                   "metric", "n", "median", "min", "max", "command")
# After an append, a table holding more rows than this that are not current is compacted.
COMPACT_ABOVE = 5000


# The mark of an A/B comparison's runs (--ab): alternated within one call to compare settings
# or builds; in the table, never current (render.py).
AB_MARK = "(gpu_check.sh ab)"


class RecordError(ValueError):
    pass


# An absolute path in a command: it starts the command or follows a space, "=", a quote, "("
# or "<", and runs to the next space, quote or bracket.
_ABSOLUTE = re.compile(r"""(?<![^\s=('"<])/[^\s'"()<>]*""")
# A CMake build folder of a checkout (build/, build-sm90/, ...): builds live at its root.
_BUILD = re.compile(r"/(build(?:-[^/]*)?(?:/.*)?)$")
# Folders outside a checkout where benchmarks write: the device machine's $OUT, scratch.
_SCRATCH = ("/root/out", "/tmp")


def relative_path(path: str, root: str = ROOT) -> str:
    """One absolute path of a command, without the machine: under the checkout (root), or a
    build folder of any checkout -> relative to the checkout; anything else -> "$OUT/..." (under
    /root/out or /tmp: the part below it; elsewhere: the last component)."""
    root = root.rstrip("/")
    if path == root:
        return "."
    if path.startswith(root + "/"):
        return path[len(root) + 1:]
    build = _BUILD.search(path)
    if build:
        return build.group(1)
    for scratch in _SCRATCH:
        if path == scratch or path.startswith(scratch + "/"):
            return "$OUT" + path[len(scratch):].rstrip("/")
    name = os.path.basename(path.rstrip("/"))
    return "$OUT/" + name if name else "$OUT"


def relative_command(command: str, root: str = ROOT) -> str:
    """A command as the table keeps it: every absolute path made repository-relative or a
    "$OUT/..." placeholder (relative_path). A command without one is returned as it is, so
    applying this twice gives what applying it once gave."""
    return _ABSOLUTE.sub(lambda m: relative_path(m.group(0), root), command)


def current_commit() -> str:
    def git(*args):
        return subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def iso_date(text: str) -> str:
    """'2026-11-30 04:37 UTC' or '2026-11-29T18:34:22' -> '2026-11-30T04:37Z'."""
    text = text.replace(" UTC", "").replace("Z", "").strip()
    for fmt in ("%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M:%S"):
        try:
            return datetime.datetime.strptime(text, fmt).strftime("%Y-%m-%dT%H:%MZ")
        except ValueError:
            continue
    raise RecordError(f"date: cannot read {text!r}")


def _row(base: dict, case: str, variant: str, metric: str, value) -> dict:
    return dict(base, case=case, variant=variant, metric=metric, value=f"{float(value):.6g}")


def wgrad_rows(d: dict, base: dict) -> Iterable[dict]:
    """bench/wgrad_bench's bench.json. A --run-scalars run's variants (the kernels of a CUDA
    graph's step) are their own: "<variant> (run scalars)"."""
    base = dict(base, benchmark="wgrad")
    suffix = " (run scalars)" if "--run-scalars" in d.get("command", "").split() else ""
    for r in d["results"]:
        case = f"{r['layer']} T={r['T']}"
        if "ms" in r:
            yield _row(base, case, r["variant"] + suffix, "ms", r["ms"])
        elif "value" in r:
            yield _row(base, case, r["variant"] + suffix, "value", r["value"])
    for tokens, totals in d.get("model_totals_ms", {}).items():
        for variant, ms in totals.items():
            yield _row(base, f"llama-3.1-8b linears T={tokens}", variant + suffix, "ms", ms)
    for variant, ms in d.get("elementwise_embedding_ms", {}).items():
        yield _row(base, "elementwise 128256x4096", variant + suffix, "ms", ms)


# The figures of a soak row, in the order the power page shows them.
SOAK_METRICS = ("ms", "sm_mhz", "watts", "mj_per_call", "power_cap_share")


def soak_rows(d: dict, base: dict) -> Iterable[dict]:
    """bench/wgrad_bench --soak's soak.json: per variant and T, run back to back, its ms per
    call, the SM clock, the power, the energy per call and the share of samples under the
    power cap (the last four absent where nvidia-smi gave no samples)."""
    base = dict(base, benchmark="wgrad_soak")
    for r in d["results"]:
        case = f"{d['layer']} T={r['T']}"
        for metric in SOAK_METRICS:
            if metric in r:
                yield _row(base, case, r["variant"], metric, r[metric])


def torch_unfused_rows(d: dict, base: dict) -> Iterable[dict]:
    """bench/torch_unfused.py's torch-unfused.json."""
    base = dict(base, benchmark="torch_unfused")
    for r in d["results"]:
        case = f"{r['layer']} T={r['tokens']}"
        for variant in ("forge_fused", "torch_dw", "torch_adamw", "torch_unfused"):
            if variant in r:
                yield _row(base, case, variant, "ms", r[variant])
    for tokens, totals in d.get("totals", {}).items():
        for variant, ms in totals.items():
            yield _row(base, f"llama-3.1-8b linears T={tokens}", variant, "ms", ms)


def host_overhead_rows(d: dict, base: dict) -> Iterable[dict]:
    """bench/host_overhead.py's host-overhead.json."""
    base = dict(base, benchmark="host_overhead")
    for r in d["results"]:
        metric = "us_per_linear" if "us_per_linear" in r else "us_per_param"
        yield _row(base, r["case"], r["variant"], metric, r[metric])


def step_rows(d: dict, base: dict) -> Iterable[dict]:
    """forge-bench's forge-bench-*.json: whole training steps (and, profiled, their GPU time by
    kernel category)."""
    env = d["environment"]
    command = env.get("command", "").split()
    mode_suffix = "-graph" if "--cuda-graph" in command else ""
    # (--memory-limit-gib: a smaller card's share, its own case)
    limit = (f" limit={command[command.index('--memory-limit-gib') + 1]}GiB"
             if "--memory-limit-gib" in command[:-1] else "")
    # (several ranks: their case says how many; rank 0 of a simulated job is its own benchmark,
    # "ranks", with this rank's weights and states beside its peak)
    par = env.get("parallel") or {}
    ranks = (f" {par['world']} ranks" + (f" tp={par['tp']}" if par.get("tp", 1) > 1 else "")
             + (" fsdp" if par.get("fsdp") else "")) if par else ""
    base = dict(base, benchmark="ranks" if par.get("simulated") else "step")
    metrics = ("peak_gib", "first_peak_gib", "steady_peak_gib", "step_ms", "tokens_per_s") + (
        ("weights_gib", "states_gib", "held_gib", "saved_gib", "forward_extra_gib",
         "backward_extra_gib", "step_extra_gib") if par.get("simulated") else ())
    for r in d["results"]:
        if r.get("status") != "ok":
            if r.get("status") == "oom":
                yield _row(dict(base, value="nan"), _step_case(r) + ranks + limit,
                           r["mode"] + mode_suffix, "oom", 1)
            continue
        case, variant = _step_case(r) + ranks + limit, r["mode"] + mode_suffix
        for metric in metrics:
            if r.get(metric) is not None:
                yield _row(base, case, variant, metric, r[metric])
        # --profile: GPU ms per step by kernel category ("profile_ms <category>")
        for category, ms in ((r.get("profile") or {}).get("categories") or {}).items():
            yield _row(base, case, variant, f"profile_ms {category}", ms)


def _step_case(r: dict) -> str:
    return (f"{r['model']} seq={r['seq']}" + (f" batch={r['batch']}" if r.get("batch") else "")
            + (" ckpt" if r.get("ckpt") else "") + (" compiled" if r.get("compiled") else ""))


def parity_rows(d: dict, base: dict) -> Iterable[dict]:
    """forge-bench --parity's forge-parity-*.json: each run's mean loss over the second half
    (what the seeds' spread is measured in), and its mean |Δloss| per step over the second
    half against every torch run of the file (the references)."""
    base = dict(base, benchmark="parity")
    settings = d.get("settings", [])
    model = settings[settings.index("--model") + 1] if "--model" in settings else "?"
    runs = {name: r["losses"] for name, r in d["runs"].items() if r.get("losses")}
    for name, losses in runs.items():
        half = losses[len(losses) // 2:]
        yield _row(base, f"{model} {len(losses)} steps", name, "last_half_mean_loss",
                   sum(half) / len(half))
    for ref_name, ref in runs.items():
        if not ref_name.startswith("torch"):
            continue
        for name, losses in runs.items():
            # (a FORGE run at another seed: against the torch runs of its seed only)
            if name == ref_name or (_seed_of(name) and _seed_of(name) != _seed_of(ref_name)):
                continue
            n = min(len(ref), len(losses))
            a, b = ref[n // 2:n], losses[n // 2:n]
            mean = sum(abs(x - y) for x, y in zip(a, b)) / max(1, len(a))
            yield _row(base, f"{model} {n} steps", f"{name} vs {ref_name}",
                       "mean_abs_dloss_last_half", mean)
    # the mixed-precision reference's spread over seeds, and each run's place in it
    spread = d.get("amp_seed_spread") or {}
    if "radius" in spread:
        steps = min(len(losses) for losses in runs.values())
        case = f"{model} {steps} steps, {len(spread['seeds'])} amp seeds"
        # (the reference's name in the variant: AdamW's and Muon's reports share the case)
        reference = d.get("reference", "amp")
        yield _row(base, case, f"{reference} seeds", "last_half_mean_loss_radius",
                   spread["radius"])
        for name, e in spread["runs"].items():
            yield _row(base, case, name, "last_half_mean_loss_offset", e["offset"])
        for name, e in spread.get("families", {}).items():
            yield _row(base, case, f"{name} over {e['seeds']} seeds",
                       "last_half_mean_loss_offset", e["offset"])


def _seed_of(run: str) -> int:
    """forge-bench --parity's runs over seeds: name-seedK is seed K, name alone seed 0."""
    head, sep, tail = run.rpartition("-seed")
    return int(tail) if sep and tail.isdigit() else 0


def rows_of(path: str, commit: str) -> List[dict]:
    with open(path) as f:
        d = json.load(f)
    name = os.path.basename(path)
    if "environment" in d:
        env = d["environment"]
        base = {"date": iso_date(env["date"]), "gpu": env.get("card", env.get("gpu", "cpu")),
                "commit": commit, "command": env.get("command", "")}
        convert = parity_rows if "comparisons" in d else step_rows
    elif d.get("benchmark") == "wgrad_soak":
        base = {"date": iso_date(d["date"]), "gpu": d["gpu"], "commit": commit,
                "command": d.get("command", "")}
        convert = soak_rows
    elif "model_totals_ms" in d:
        base = {"date": iso_date(d["date"]), "gpu": d["gpu"], "commit": commit,
                "command": d.get("command", "")}
        convert = wgrad_rows
    elif "totals" in d and "torch" in d:
        base = {"date": iso_date(d["date"]), "gpu": d["gpu"], "commit": commit,
                "command": d.get("command", "")}
        convert = torch_unfused_rows
    elif d.get("benchmark") == "host_overhead":
        base = {"date": iso_date(d["date"]), "gpu": d.get("gpu", "cpu"), "commit": commit,
                "command": d.get("command", "")}
        convert = host_overhead_rows
    else:
        raise RecordError(f"{name}: not the JSON of a known benchmark")
    rows = list(convert(d, base))
    if not rows:
        raise RecordError(f"{name}: no measurements in it")
    return rows


def append(rows: List[dict], table: str = TABLE) -> None:
    """Appends rows to the table, their commands made relative (relative_command)."""
    new = not os.path.exists(table) or os.path.getsize(table) == 0
    os.makedirs(os.path.dirname(table), exist_ok=True)
    with open(table, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow(dict({k: row[k] for k in COLUMNS},
                                 command=relative_command(row["command"])))


def read(table: str = TABLE) -> List[Dict[str, str]]:
    with open(table, newline="") as f:
        return list(csv.DictReader(f))


def write(rows: List[Dict[str, str]], table: str = TABLE) -> None:
    """Replaces the table with rows (written beside it, then renamed over it)."""
    tmp = table + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in COLUMNS})
    os.replace(tmp, table)


def migrate(table: str = TABLE, root: str = ROOT) -> int:
    """Rewrites the table's command cells as append() writes them (relative_command); every
    other cell, and every row's place, stays. Returns how many cells changed (0 the second
    time)."""
    rows = read(table)
    changed = 0
    for row in rows:
        command = relative_command(row["command"], root)
        changed += command != row["command"]
        row["command"] = command
    if changed:
        write(rows, table)
    return changed


Key = Tuple[str, str, str, str, str]  # (gpu, benchmark, case, variant, metric)


def current(rows: List[Dict[str, str]]) -> Dict[Key, Dict[str, str]]:
    """The figures the rendered pages show: the latest row per (gpu, benchmark, case, variant,
    metric), the later one in the table where two have the same date. An A/B comparison's rows
    (command marked AB_MARK) and rows measured with a FORGE_DEBUG_* switch set are never
    current. In the order of the rows in the table, so the pages depend on these rows alone:
    the same with or without the rows compact() takes out."""
    latest: Dict[Key, Tuple[int, Dict[str, str]]] = {}
    for i, r in enumerate(rows):
        if r["command"].startswith(AB_MARK) or "FORGE_DEBUG_" in r["command"]:
            continue  # (a comparison's run, an experiment's setting)
        key = (r["gpu"], r["benchmark"], r["case"], r["variant"], r["metric"])
        if key not in latest or r["date"] >= latest[key][1]["date"]:
            latest[key] = (i, r)
    return {key: r for key, (_, r) in sorted(latest.items(), key=lambda item: item[1][0])}


# A "$OUT/..." path of a command: which output folder a run wrote to is not part of what it
# measured, so a summary's command says "$OUT" alone.
_OUT_PATH = re.compile(r"""\$OUT[^\s'"()<>]*""")


def setting(command: str, root: str = ROOT) -> str:
    """The command a summary of runs names: relative_command's, every "$OUT/..." as "$OUT"
    (the repetitions of one setting differ only there)."""
    return _OUT_PATH.sub("$OUT", relative_command(command, root))


def summarise(rows: List[Dict[str, str]], root: str = ROOT) -> List[Dict[str, str]]:
    """One summary per (gpu, commit, benchmark, case, variant, metric, setting) of rows, in the
    order each first appears: first and last date, n (rows), median, min and max value."""
    groups: Dict[tuple, List[Dict[str, str]]] = {}
    for r in rows:
        key = (r["gpu"], r["commit"], r["benchmark"], r["case"], r["variant"], r["metric"],
               setting(r["command"], root))
        groups.setdefault(key, []).append(r)
    out = []
    for (gpu, commit, bench, case, variant, metric, command), group in groups.items():
        values = sorted(v for v in (_number(r["value"]) for r in group) if not math.isnan(v))
        figures = ([f"{statistics.median(values):.6g}", f"{values[0]:.6g}", f"{values[-1]:.6g}"]
                   if values else ["nan"] * 3)
        dates = sorted(r["date"] for r in group)
        out.append(dict(zip(HISTORY_COLUMNS, [dates[0], dates[-1], gpu, commit, bench, case,
                                              variant, metric, str(len(group)), *figures,
                                              command])))
    return out


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return math.nan


def history_path(table: str = TABLE) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(table)), HISTORY_NAME)


def append_history(summaries: List[Dict[str, str]], history: str) -> None:
    """Appends summaries to the history as one more gzip member: what is there stays byte for
    byte (git stores the growth as a small delta)."""
    new = not os.path.exists(history) or os.path.getsize(history) == 0
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=HISTORY_COLUMNS, lineterminator="\n")
    if new:
        writer.writeheader()
    writer.writerows(summaries)
    with open(history, "ab") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
            gz.write(buf.getvalue().encode())


def read_history(history: str) -> List[Dict[str, str]]:
    if not os.path.exists(history):
        return []
    with gzip.open(history, "rt", newline="") as f:
        return list(csv.DictReader(f))


def compact(table: str = TABLE, keep_last: int = 0, root: str = ROOT) -> Tuple[int, int]:
    """Bounds the table: keeps every current row (current()) and the last keep_last rows as
    they are, in their order, and moves every other row into the history beside it as
    summaries (summarise()). The commands it keeps are relative_command's. The summaries are
    appended before the table is replaced, so a run cut short between the two leaves a row
    summarised twice, never lost. Returns (rows summarised, summaries appended)."""
    rows = read(table)
    for r in rows:
        r["command"] = relative_command(r["command"], root)
    keep = {id(r) for r in current(rows).values()}
    if keep_last > 0:
        keep.update(id(r) for r in rows[-keep_last:])
    old = [r for r in rows if id(r) not in keep]
    summaries = summarise(old, root)
    if summaries:
        append_history(summaries, history_path(table))
    write([r for r in rows if id(r) in keep], table)
    return len(old), len(summaries)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="*", help="a benchmark's JSON output")
    parser.add_argument("--commit", default=None, help="the measured commit (default: HEAD)")
    parser.add_argument("--table", default=TABLE, help=f"the table (default {TABLE})")
    parser.add_argument("--ab", metavar="SETTING", default=None,
                        help="runs of a `gpu_check.sh ab` call with this setting (\"default\" or "
                             "VAR=value[,VAR=value...]): their commands are marked so, and "
                             "render.py never takes them as current")
    parser.add_argument("--compact", action="store_true",
                        help="compact the table now (no JSON): keep the current rows, summarise "
                             f"the others into {HISTORY_NAME} beside it")
    args = parser.parse_args(argv)
    if args.compact:
        if args.json:
            parser.error("--compact takes no JSON files")
        try:
            report_compact(args.table)
        except OSError as e:
            print(f"record: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return 0
    if not args.json:
        parser.error("no JSON file given")
    commit = args.commit or current_commit()
    # Every file is read before any row is appended: one bad file leaves the table as it was.
    try:
        batches = [(path, rows_of(path, commit)) for path in args.json]
    except (OSError, KeyError, json.JSONDecodeError, RecordError) as e:
        print(f"record: {type(e).__name__}: {e}; nothing appended", file=sys.stderr)
        return 1
    if args.ab is not None:
        setting = "" if args.ab == "default" else args.ab.replace(",", " ") + " "
        for _, batch in batches:
            for row in batch:
                row["command"] = f"{AB_MARK} {setting}{row['command']}"
    rows = [row for _, batch in batches for row in batch]
    try:
        append(rows, args.table)
    except OSError as e:
        print(f"record: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for path, batch in batches:
        print(f"record: {len(batch)} rows from {path}")
    print(f"record: {len(rows)} rows appended to {args.table}")
    table = read(args.table)
    if len(table) - len(current(table)) > COMPACT_ABOVE:
        try:
            report_compact(args.table, keep_last=len(rows))
        except OSError as e:  # (the rows are appended; the table is as it was before this)
            print(f"record: compacting: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    return 0


def report_compact(table: str, keep_last: int = 0) -> None:
    summarised, summaries = compact(table, keep_last)
    print(f"record: {summarised} rows that are not current summarised as {summaries} rows of "
          f"{history_path(table)}; {len(read(table))} rows stay in {table}")


if __name__ == "__main__":
    sys.exit(main())
