"""bench/op_counts.py: one step's operations per phase, one mode against another."""
import json

import pytest

import bench_scripts

pytest.importorskip("transformers")  # the narrow model is a transformers Llama


def load_op_counts():
    return bench_scripts.load("op_counts")


def test_same_mode_twice_differs_nowhere(tmp_path, capsys):
    op_counts = load_op_counts()
    out = tmp_path / "ops.json"
    result = op_counts.main(["--model", "tiny", "--modes", "forge-bf16", "forge-bf16",
                             "--json", str(out)])
    a, b = result["counts"]["A"], result["counts"]["B"]
    assert set(a) == {"forward", "backward", "optimizer"}
    assert a == b and sum(a["backward"].values()) > 0
    assert json.loads(out.read_text())["counts"]["A"] == a
    assert "backward: A" in capsys.readouterr().out


def test_lean_adds_its_recomputation_to_backward_only():
    """forge.lean recomputes the SwiGLU product in backward: one more silu per layer there,
    forward's silu count unchanged, and no optimizer phase in either (updates in backward)."""
    op_counts = load_op_counts()
    result = op_counts.main(["--model", "tiny", "--modes", "forge-bf16", "forge-bf16-lean"])
    a, b = result["counts"]["A"], result["counts"]["B"]
    layers = 2  # MODEL_CONFIGS["tiny"]
    assert b["backward"].get("aten::silu", 0) - a["backward"].get("aten::silu", 0) == layers
    assert a["forward"].get("aten::silu") == b["forward"].get("aten::silu") == layers
    assert a["optimizer"] == b["optimizer"] == {}  # mode="immediate": updates in backward


def test_graph_modes_are_refused():
    op_counts = load_op_counts()
    with pytest.raises(SystemExit, match="one launch"):
        op_counts.main(["--model", "tiny", "--modes", "forge-bf16", "forge-bf16-lean-graph"])
