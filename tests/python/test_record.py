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
