"""bench/record.py: benchmark JSON into rows of the results table."""
import json

import bench_scripts


def load_record():
    return bench_scripts.load("record")


def wgrad_json(tmp_path, command: str) -> str:
    d = {"date": "2026-12-04 15:00 UTC", "gpu": "NVIDIA H200", "sms": 132, "command": command,
         "iters": 30,
         "results": [{"layer": "q_proj/o_proj", "out": 4096, "in": 4096, "T": 512,
                      "variant": "fused_bf16_sr", "ms": 0.086, "tflops": 200.0, "gbps": 2500.0}],
         "model_totals_ms": {"512": {"fused_bf16_sr": 35.4}},
         "elementwise_embedding_ms": {"bf16_sr": 2.09}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_wgrad_run_scalars_rows_are_their_own_variants(tmp_path):
    """A --run-scalars run (the kernels of a CUDA graph's step) must not replace the launch
    scalars' figures in the rendered tables: its variants carry " (run scalars)"."""
    record = load_record()
    plain = record.rows_of(wgrad_json(tmp_path, "wgrad_bench --quick"), "abc1234")
    run = record.rows_of(wgrad_json(tmp_path, "wgrad_bench --quick --run-scalars"), "abc1234")
    assert sorted(r["variant"] for r in plain) == ["bf16_sr", "fused_bf16_sr", "fused_bf16_sr"]
    assert sorted(r["variant"] for r in run) == ["bf16_sr (run scalars)",
                                                 "fused_bf16_sr (run scalars)",
                                                 "fused_bf16_sr (run scalars)"]
    assert [r["value"] for r in plain] == [r["value"] for r in run]
    assert all(r["commit"] == "abc1234" and r["benchmark"] == "wgrad" for r in plain + run)


def test_a_missing_file_appends_nothing(tmp_path):
    """Every file is read before any row is written: a call naming a good file and a missing
    one leaves the table as it was, so repeating the corrected call records each row once."""
    record = load_record()
    table = tmp_path / "results.csv"
    good = wgrad_json(tmp_path, "wgrad_bench --quick")
    assert record.main([good, str(tmp_path / "missing.json"), "--commit", "abc1234",
                        "--table", str(table)]) == 1
    assert not table.exists()
    assert record.main([good, "--commit", "abc1234", "--table", str(table)]) == 0
    assert len(record.read(str(table))) == 3


def test_ab_runs_are_recorded_but_never_current(tmp_path):
    """The runs of an A/B call (record.py --ab SETTING) go into the table, their commands
    marked with the setting, and render.py's current figures stay the last plain run's."""
    record = load_record()
    render = bench_scripts.load("render")
    table = tmp_path / "results.csv"
    assert record.main([wgrad_json(tmp_path, "wgrad_bench"), "--commit", "abc1234",
                        "--table", str(table)]) == 0
    later = json.loads((tmp_path / "bench.json").read_text())
    later["date"] = "2026-12-04 16:00 UTC"
    later["model_totals_ms"]["512"]["fused_bf16_sr"] = 99.0
    (tmp_path / "bench.json").write_text(json.dumps(later))
    for setting in ("default", "FORGE_DEBUG_STAGGER_NS=0,FORGE_DEBUG_GROUP_M=1"):
        assert record.main([str(tmp_path / "bench.json"), "--commit", "abc1234", "--ab",
                            setting, "--table", str(table)]) == 0
    rows = record.read(str(table))
    assert len(rows) == 9
    assert rows[-1]["command"] == ("(gpu_check.sh ab) FORGE_DEBUG_STAGGER_NS=0 "
                                   "FORGE_DEBUG_GROUP_M=1 wgrad_bench")
    assert rows[3]["command"] == "(gpu_check.sh ab) wgrad_bench"
    totals = [r for r in render.current(rows).values() if r["case"].startswith("llama")]
    assert [r["value"] for r in totals] == ["35.4"], totals


def test_each_gpu_keeps_its_own_current_figures(tmp_path):
    """A later run on another card must not replace a figure in the baselines' GPU's table, nor
    stand beside its figures: render.py keeps the latest row per GPU and writes one section per
    GPU, the anchor's first."""
    record = load_record()
    render = bench_scripts.load("render")
    table = tmp_path / "results.csv"
    with open(wgrad_json(tmp_path, "wgrad_bench")) as f:
        first = json.load(f)
    first["model_totals_ms"] = {"512": {"fused_sr": 35.4}}  # a column of the totals table
    (tmp_path / "bench.json").write_text(json.dumps(first))
    assert record.main([str(tmp_path / "bench.json"), "--commit", "abc1234",
                        "--table", str(table)]) == 0
    later = dict(first, date="2026-12-04 16:00 UTC", gpu="NVIDIA H100 80GB HBM3",
                 model_totals_ms={"512": {"fused_sr": 39.4}})
    (tmp_path / "bench.json").write_text(json.dumps(later))
    assert record.main([str(tmp_path / "bench.json"), "--commit", "def5678",
                        "--table", str(table)]) == 0
    cur = render.current(record.read(str(table)))
    totals = {gpu: r["value"] for (gpu, _, case, _, _), r in cur.items()
              if case.startswith("llama")}
    assert totals == {"NVIDIA H200": "35.4", "NVIDIA H100 80GB HBM3": "39.4"}
    out = tmp_path / "rendered"
    assert render.main(["--table", str(table), "--out", str(out)]) == 0
    page = (out / "wgrad.md").read_text()
    h200, h100 = page.index("## NVIDIA H200"), page.index("## NVIDIA H100 80GB HBM3")
    assert h200 < page.index("| 512 | 35.4 |") < h100 < page.index("| 512 | 39.4 |")
    assert page.index("commit abc1234") < h100 < page.index("commit def5678")


def soak_json(tmp_path, command: str) -> str:
    d = {"benchmark": "wgrad_soak", "date": "2026-12-08 02:00 UTC", "gpu": "NVIDIA H100 80GB HBM3",
         "command": command, "layer": "gate_proj/up_proj", "seconds": 5.0,
         "results": [{"variant": "cublas_dw_fp32_out", "T": 4096, "calls": 4000, "ms": 0.7312,
                      "sm_mhz": 1602.5, "watts": 689.0, "mj_per_call": 503.8,
                      "power_cap_share": 0.9},
                     {"variant": "fused_adamw_bf16_states", "T": 32, "calls": 9000,
                      "ms": 0.2401}]}
    path = tmp_path / "soak.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_a_soak_records_clock_power_and_energy_per_variant(tmp_path):
    """wgrad_bench --soak: each (variant, T) becomes rows of ms, SM clock, power, energy and the
    power cap's share (only ms where nvidia-smi gave no samples), rendered on power.md; a run
    with a FORGE_DEBUG_* switch (the two-CTA kernel forced) is recorded but never current."""
    record = load_record()
    render = bench_scripts.load("render")
    rows = record.rows_of(soak_json(tmp_path, "wgrad_bench --soak 5 --tokens 4096"), "abc1234")
    got = {(r["case"], r["variant"], r["metric"]): r["value"] for r in rows}
    assert got == {
        ("gate_proj/up_proj T=4096", "cublas_dw_fp32_out", "ms"): "0.7312",
        ("gate_proj/up_proj T=4096", "cublas_dw_fp32_out", "sm_mhz"): "1602.5",
        ("gate_proj/up_proj T=4096", "cublas_dw_fp32_out", "watts"): "689",
        ("gate_proj/up_proj T=4096", "cublas_dw_fp32_out", "mj_per_call"): "503.8",
        ("gate_proj/up_proj T=4096", "cublas_dw_fp32_out", "power_cap_share"): "0.9",
        ("gate_proj/up_proj T=32", "fused_adamw_bf16_states", "ms"): "0.2401"}
    assert all(r["benchmark"] == "wgrad_soak" for r in rows)
    table = tmp_path / "results.csv"
    assert record.main([soak_json(tmp_path, "wgrad_bench --soak 5 --tokens 4096"),
                        "--commit", "abc1234", "--table", str(table)]) == 0
    forced = json.loads((tmp_path / "soak.json").read_text())
    forced["command"] = "FORGE_DEBUG_PERSISTENT=0 wgrad_bench --soak 5 --tokens 4096"
    forced["results"][0]["ms"] = 0.9
    (tmp_path / "soak.json").write_text(json.dumps(forced))
    assert record.main([str(tmp_path / "soak.json"), "--commit", "abc1234",
                        "--table", str(table)]) == 0
    out = tmp_path / "rendered"
    assert render.main(["--table", str(table), "--out", str(out)]) == 0
    page = (out / "power.md").read_text()
    assert "| gate_proj/up_proj T=32 | fused_adamw_bf16_states | 0.2401 |  |  |  |  |" in page
    assert "| gate_proj/up_proj T=4096 | cublas_dw_fp32_out | 0.7312 | 1602.5 | 689.0 | 503.8 | 0.90 |" in page
    assert "0.9000" not in page


def test_a_profiled_step_records_its_kernel_categories(tmp_path):
    """forge-bench --profile: each case's GPU ms per step by kernel category become rows of
    their own metric beside the step's peak and time."""
    record = load_record()
    d = {"environment": {"date": "2026-12-05T16:09:57", "gpu": "NVIDIA H100 80GB HBM3",
                         "command": "forge-bench --cuda-graph --profile 3"},
         "results": [{"model": "llama-3.1-8b", "seq": 512, "ckpt": False, "mode": "forge-bf16",
                      "status": "ok", "peak_gib": 48.95, "step_ms": 91.7,
                      "profile": {"categories": {"forge wgrad + update": 43.252,
                                                 "GEMM (cuBLAS)": 23.188}}}]}
    path = tmp_path / "forge-bench.json"
    path.write_text(json.dumps(d))
    rows = {(r["variant"], r["metric"]): r["value"] for r in record.rows_of(str(path), "abc")}
    assert rows == {("forge-bf16-graph", "peak_gib"): "48.95",
                    ("forge-bf16-graph", "step_ms"): "91.7",
                    ("forge-bf16-graph", "profile_ms forge wgrad + update"): "43.252",
                    ("forge-bf16-graph", "profile_ms GEMM (cuBLAS)"): "23.188"}


def test_a_memory_limited_run_is_its_own_case(tmp_path):
    """forge-bench --memory-limit-gib: a smaller card's share; its cases (an OOM included) are
    not the uncapped ones."""
    record = load_record()
    d = {"environment": {"date": "2026-12-06T19:10:00", "gpu": "NVIDIA H100 80GB HBM3",
                         "command": "forge-bench --memory-limit-gib 29.8 --ckpt on"},
         "results": [{"model": "llama-3.1-8b", "seq": 2048, "ckpt": True,
                      "mode": "forge-int4-head", "status": "ok", "peak_gib": 26.3},
                     {"model": "llama-3.1-8b", "seq": 2048, "ckpt": True,
                      "mode": "forge-int8-head", "status": "oom"}]}
    path = tmp_path / "forge-bench.json"
    path.write_text(json.dumps(d))
    rows = {(r["case"], r["variant"], r["metric"]) for r in record.rows_of(str(path), "abc")}
    case = "llama-3.1-8b seq=2048 ckpt limit=29.8GiB"
    assert rows == {(case, "forge-int4-head", "peak_gib"), (case, "forge-int8-head", "oom")}


def test_commands_are_written_repository_relative(tmp_path):
    """No machine path reaches the table: the checkout's root and any checkout's build folder
    give way to relative paths, other absolute paths to "$OUT/..."."""
    record = load_record()
    root = "/home/someone/forge"
    cases = {
        f"{root}/build-sm90/bench/wgrad_bench --out /root/out/ab/default-r1":
            "build-sm90/bench/wgrad_bench --out $OUT/ab/default-r1",
        "(gpu_check.sh ab) FORGE_DEBUG_PERSISTENT=0 /work/other/build-var/bench/wgrad_bench "
        "--out /root/out/pf/EPILOGUEPREFETCH=0,STAGGERNS=8000-r2":
            "(gpu_check.sh ab) FORGE_DEBUG_PERSISTENT=0 build-var/bench/wgrad_bench "
            "--out $OUT/pf/EPILOGUEPREFETCH=0,STAGGERNS=8000-r2",
        f"python3 {root}/bench/torch_unfused.py --out {root}/out":
            "python3 bench/torch_unfused.py --out out",
        "python3 bench/host_overhead.py --baseline /tmp/wt/python --json=/tmp/ho.json":
            "python3 bench/host_overhead.py --baseline $OUT/wt/python --json=$OUT/ho.json",
        "forge-bench --out /root/out --parity-work-dir /scratch/x/pw":
            "forge-bench --out $OUT --parity-work-dir $OUT/pw",
        f"cd {root} && build/bench/wgrad_bench": "cd . && build/bench/wgrad_bench",
        # nothing absolute: kept as it is
        "build-var/bench/wgrad_bench --trace --out $OUT/trace":
            "build-var/bench/wgrad_bench --trace --out $OUT/trace",
        "python3 bench/host_overhead.py --baseline <a copy of 118a25b's python/>":
            "python3 bench/host_overhead.py --baseline <a copy of 118a25b's python/>",
    }
    for command, expected in cases.items():
        assert record.relative_command(command, root) == expected, command
        assert record.relative_command(expected, root) == expected, expected
    # record.py itself: this checkout's absolute build path in, relative out
    path = wgrad_json(tmp_path, f"{record.ROOT}/build-sm90/bench/wgrad_bench --out /tmp/r/wb")
    table = tmp_path / "results.csv"
    assert record.main([path, "--commit", "abc1234", "--table", str(table)]) == 0
    assert {r["command"] for r in record.read(str(table))} == {
        "build-sm90/bench/wgrad_bench --out $OUT/r/wb"}


def test_migrating_the_table_is_idempotent(tmp_path):
    """migrate() rewrites old rows' commands as append() writes new ones and leaves every other
    cell; a second pass changes nothing, byte for byte."""
    record = load_record()
    table = tmp_path / "results.csv"
    header = ",".join(record.COLUMNS)
    table.write_text(
        header + "\n"
        "2026-11-30T04:37Z,NVIDIA H200,b382d51,wgrad,q_proj/o_proj T=512,fused,ms,0.07424,"
        "/work/main/build-sm90/bench/wgrad_bench --out /root/out\n"
        "2026-11-30T04:38Z,NVIDIA H200,b382d51,step,\"llama-3.1-8b seq=512, x\",forge-bf16,"
        "step_ms,91.7,forge-bench --out /tmp/b1\n"
        "2026-11-30T04:39Z,cpu,b382d51,host_overhead,linear,forge,us_per_linear,12.5,"
        "python3 bench/host_overhead.py\n")
    before = record.read(str(table))
    assert record.migrate(str(table), root="/work/main") == 2
    once = table.read_bytes()
    after = record.read(str(table))
    assert [r["command"] for r in after] == ["build-sm90/bench/wgrad_bench --out $OUT",
                                             "forge-bench --out $OUT/b1",
                                             "python3 bench/host_overhead.py"]
    for b, a in zip(before, after):
        assert {k: v for k, v in b.items() if k != "command"} == \
               {k: v for k, v in a.items() if k != "command"}
    assert record.migrate(str(table), root="/work/main") == 0
    assert table.read_bytes() == once


def step_json(tmp_path, name: str, date: str, step_ms: float, command: str) -> str:
    d = {"environment": {"date": date, "gpu": "NVIDIA H200", "command": command},
         "results": [{"model": "llama-3.1-8b", "seq": 512, "ckpt": False, "mode": "forge-bf16",
                      "status": "ok", "peak_gib": 48.95, "first_peak_gib": 49.5,
                      "steady_peak_gib": 48.95, "step_ms": step_ms}]}
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return str(path)


def history_table(tmp_path):
    """A table of plain runs superseded by later ones, A/B repetitions and a current run."""
    record = load_record()
    table = str(tmp_path / "results.csv")
    for i, ms in enumerate([100.0, 98.0]):  # two plain runs, the second supersedes the first
        assert record.main([step_json(tmp_path, f"s{i}.json", f"2026-12-0{i + 1}T10:00:00", ms,
                                      f"forge-bench --out /root/out/s{i}"),
                            "--commit", "abc1234", "--table", table]) == 0
    for setting in ("default", "FORGE_DEBUG_GROUP_M=4"):
        for rep, ms in enumerate([90.0, 94.0, 91.0]):
            assert record.main([step_json(tmp_path, "ab.json", f"2026-12-03T10:0{rep}:00", ms,
                                          f"forge-bench --out /root/out/ab/{setting}-r{rep}"),
                                "--commit", "def5678", "--ab", setting, "--table", table]) == 0
    return record, table


def test_compacting_keeps_every_current_row_and_what_the_pages_show(tmp_path):
    """compact() leaves the current rows as they were, summarises the others (superseded runs,
    A/B repetitions) per commit and setting into history.csv.gz, and the rendered pages are
    the same byte for byte; a second compaction changes nothing."""
    record, table = history_table(tmp_path)
    render = bench_scripts.load("render")
    rows = record.read(table)
    assert len(rows) == 8 * 4  # 8 runs, 4 metrics each
    assert render.main(["--table", table, "--out", str(tmp_path / "before")]) == 0
    current = list(record.current(rows).values())
    # 1 superseded run + 6 A/B runs, 4 metrics each -> per commit and setting: 3 x 4 summaries
    assert record.compact(table) == (28, 12)
    assert record.read(table) == current
    assert render.main(["--table", table, "--out", str(tmp_path / "after")]) == 0
    pages = sorted(p.name for p in (tmp_path / "before").iterdir())
    assert pages == ["steps.md"]
    for page in pages:
        assert (tmp_path / "after" / page).read_bytes() == (tmp_path / "before" / page).read_bytes()
    history = record.read_history(str(tmp_path / "history.csv.gz"))
    step_ms = {(h["commit"], h["command"]): (h["n"], h["median"], h["min"], h["max"],
                                             h["first_date"], h["last_date"])
               for h in history if h["metric"] == "step_ms"}
    assert step_ms == {
        ("abc1234", "forge-bench --out $OUT"):
            ("1", "100", "100", "100", "2026-12-01T10:00Z", "2026-12-01T10:00Z"),
        ("def5678", "(gpu_check.sh ab) forge-bench --out $OUT"):
            ("3", "91", "90", "94", "2026-12-03T10:00Z", "2026-12-03T10:02Z"),
        ("def5678", "(gpu_check.sh ab) FORGE_DEBUG_GROUP_M=4 forge-bench --out $OUT"):
            ("3", "91", "90", "94", "2026-12-03T10:00Z", "2026-12-03T10:02Z")}
    once = ((tmp_path / "results.csv").read_bytes(), (tmp_path / "history.csv.gz").read_bytes())
    assert record.compact(table) == (0, 0)
    assert ((tmp_path / "results.csv").read_bytes(),
            (tmp_path / "history.csv.gz").read_bytes()) == once


def test_appending_after_compaction(tmp_path, monkeypatch):
    """After a compaction record.py appends as before; a later run becomes current. Past
    COMPACT_ABOVE rows that are not current, record.py compacts by itself, keeping the rows it
    has just appended as they are, and adds to the history without changing what is there."""
    record, table = history_table(tmp_path)
    record.compact(table)
    history = tmp_path / "history.csv.gz"
    first = history.read_bytes()
    assert record.main([step_json(tmp_path, "s2.json", "2026-12-04T10:00:00", 97.0,
                                  "forge-bench --out /tmp/s2"),
                        "--commit", "0123abc", "--table", table]) == 0
    rows = record.read(table)
    assert len(rows) == 4 + 4 and rows[-1]["command"] == "forge-bench --out $OUT/s2"
    assert {r["value"] for r in record.current(rows).values() if r["metric"] == "step_ms"} \
        == {"97"}
    monkeypatch.setattr(record, "COMPACT_ABOVE", 3)
    assert record.main([step_json(tmp_path, "ab.json", "2026-12-04T11:00:00", 80.0,
                                  "forge-bench --out /root/out/x"),
                        "--commit", "0123abc", "--ab", "default", "--table", table]) == 0
    rows = record.read(table)
    # the 98 ms run (superseded) went to the history; the A/B call's rows stay this time
    assert [r["value"] for r in rows if r["metric"] == "step_ms"] == ["97", "80"]
    assert history.read_bytes().startswith(first)
    summaries = record.read_history(str(history))
    assert len(summaries) == 12 + 4
    assert [(h["commit"], h["median"]) for h in summaries if h["metric"] == "step_ms"][-1] \
        == ("abc1234", "98")


def test_current_rows_come_in_table_order(tmp_path):
    """Where two current rows have the same date, the pages list them in the order they were
    recorded, not in the order their keys first appeared (which the rows compact() takes out
    would decide)."""
    record = load_record()
    render = bench_scripts.load("render")

    def row(date, metric, value, command):
        return dict(date=date, gpu="cpu", commit="abc1234", benchmark="host_overhead",
                    case="linear", variant="forge", metric=metric, value=value, command=command)
    rows = [row("2026-12-01T10:00Z", "us_per_linear", "12", "run a"),
            row("2026-12-02T10:00Z", "us_per_param", "3", "run b"),
            row("2026-12-02T10:00Z", "us_per_linear", "11", "run c")]
    table = str(tmp_path / "results.csv")
    record.write(rows, table)
    full = render.sources(record.current(record.read(table)).values())
    assert full == ["- 2026-12-02T10:00Z, cpu, commit abc1234: `run b`",
                    "- 2026-12-02T10:00Z, cpu, commit abc1234: `run c`"]
    record.compact(table)
    assert [r["command"] for r in record.read(table)] == ["run b", "run c"]
    assert render.sources(record.current(record.read(table)).values()) == full


def test_simulated_ranks_are_their_own_benchmark_and_page(tmp_path):
    """forge-bench --simulate-ranks: rank 0's rows go to the "ranks" benchmark, under the card's
    own name, each case saying its ranks, with its weights and states beside its peak; ranks.md
    gives, per job and mode, the fewest ranks measured whose rank 0 fits each card."""
    record = load_record()
    render = bench_scripts.load("render")
    table = tmp_path / "results.csv"
    for world, torch_peak, forge_peak in ((4, 141.0, 118.0), (8, 76.0, 70.0)):
        d = {"environment": {"date": f"2026-12-06T0{world}:00:00", "card": "NVIDIA H200",
                             "gpu": f"NVIDIA H200, rank 0 of {world} simulated",
                             "command": f"forge-bench --simulate-ranks {world} --fsdp",
                             "parallel": {"world": world, "tp": 1, "dp": world, "fsdp": True,
                                          "simulated": True}},
             "results": [
                 {"model": "llama-3.1-70b", "seq": 4096, "ckpt": True, "mode": "torch-adamw",
                  "status": "ok", "peak_gib": torch_peak, "step_ms": 900.0,
                  "weights_gib": 131.0 / world, "states_gib": 524.0 / world},
                 {"model": "llama-3.1-70b", "seq": 4096, "ckpt": True, "mode": "forge-int8",
                  "status": "ok", "peak_gib": forge_peak, "step_ms": 950.0,
                  "weights_gib": 131.0 / world, "states_gib": 131.0 / world,
                  "held_gib": 262.0 / world, "saved_gib": 5.0, "forward_extra_gib": 2.5,
                  "backward_extra_gib": 9.0, "step_extra_gib": 0.25}]}
        path = tmp_path / f"forge-bench-{world}.json"
        path.write_text(json.dumps(d))
        assert record.main([str(path), "--commit", "abc1234", "--table", str(table)]) == 0
    rows = record.read(str(table))
    assert {r["benchmark"] for r in rows} == {"ranks"} and {r["gpu"] for r in rows} == {
        "NVIDIA H200"}
    assert {r["case"] for r in rows} == {"llama-3.1-70b seq=4096 ckpt 4 ranks fsdp",
                                         "llama-3.1-70b seq=4096 ckpt 8 ranks fsdp"}
    assert {r["metric"] for r in rows} >= {"peak_gib", "weights_gib", "states_gib"}
    out = tmp_path / "rendered"
    assert render.main(["--table", str(table), "--out", str(out)]) == 0
    page = (out / "ranks.md").read_text()
    assert "| llama-3.1-70b seq=4096 ckpt fsdp | 4 | " in page
    # columns: forge-int8 on H100, on H200, then torch-adamw's. forge int8: 70 GiB at 8 ranks
    # fits an H100, 118 at 4 an H200; torch: 76 GiB at 8 fits an H200 only, 141 at 4 neither
    assert "| llama-3.1-70b seq=4096 ckpt fsdp | 8 | 4 | none measured | 8 |" in page
    # where forge's bytes go, phase by phase (torch's row had no phases: no row)
    assert ("| llama-3.1-70b seq=4096 ckpt fsdp | 8 | forge-int8 | 16.4 | 16.4 | 32.8 | 5.0 | "
            "2.5 | 9.0 | 0.2 | 70.0 |") in page
    assert "| torch-adamw | " not in page
    assert not (out / "steps.md").exists()


def test_parity_over_seeds_compares_each_seed_with_its_own(tmp_path):
    """forge-bench --parity-seeds: a FORGE run at seed K is compared per step with the torch
    runs of seed K only, and its family's mean over seeds is a row of its own."""
    record = load_record()
    flat = lambda v: [9.0, 9.0, v, v]
    runs = {"torch-adamw-amp": flat(2.0), "torch-adamw-amp-seed1": flat(2.4),
            "forge-int4": flat(2.1), "forge-int4-seed1": flat(2.3)}
    d = {"environment": {"date": "2026-12-07 02:00 UTC", "gpu": "NVIDIA H100",
                         "command": "forge-bench --parity --parity-seeds 2"},
         "settings": ["--model", "100m"], "comparisons": {},
         "runs": {n: {"losses": v} for n, v in runs.items()},
         "amp_seed_spread": {"seeds": {"torch-adamw-amp": 2.0, "torch-adamw-amp-seed1": 2.4},
                             "center": 2.2, "radius": 0.2,
                             "runs": {"forge-int4": {"offset": -0.1},
                                      "forge-int4-seed1": {"offset": 0.1}},
                             "families": {"forge-int4": {"seeds": 2, "offset": 0.0}}}}
    path = tmp_path / "forge-parity-x.json"
    path.write_text(json.dumps(d))
    rows = {r["variant"]: float(r["value"]) for r in record.rows_of(str(path), "abc1234")}
    assert "forge-int4-seed1 vs torch-adamw-amp" not in rows
    assert abs(rows["forge-int4-seed1 vs torch-adamw-amp-seed1"] - 0.1) < 1e-12
    assert abs(rows["forge-int4 vs torch-adamw-amp-seed1"] - 0.3) < 1e-12
    assert rows["forge-int4 over 2 seeds"] == 0.0
    assert rows["forge-int4-seed1"] == 0.1


def test_the_seeds_radius_of_each_optimizers_parity_is_its_own_figure(tmp_path):
    """forge-bench --parity and --parity-optimizer muon: each report's seeds' radius is named
    for its reference, so one never takes the other's place in the table."""
    record = load_record()
    radii = {}
    for reference, radius in (("torch-adamw-amp", 0.0246), ("torch-muon-amp", 0.0049)):
        seeds = [reference, f"{reference}-seed1", f"{reference}-seed2"]
        d = {"environment": {"date": "2026-12-07T22:33:00", "gpu": "NVIDIA H100 80GB HBM3",
                             "command": "forge-bench --parity"},
             "settings": ["--model", "100m", "--steps", "4"], "reference": reference,
             "runs": {name: {"losses": [3.0, 2.0, 1.0, 1.0]} for name in seeds},
             "comparisons": {},
             "amp_seed_spread": {"seeds": {name: 1.0 for name in seeds}, "center": 1.0,
                                 "radius": radius, "runs": {}, "families": {}}}
        path = tmp_path / f"{reference}.json"
        path.write_text(json.dumps(d))
        radii.update({r["variant"]: r["value"] for r in record.rows_of(str(path), "abc")
                      if r["metric"] == "last_half_mean_loss_radius"})
    assert radii == {"torch-adamw-amp seeds": "0.0246", "torch-muon-amp seeds": "0.0049"}
