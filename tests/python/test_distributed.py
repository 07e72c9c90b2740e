"""test_distributed.py — forge.optim on torch.distributed, on the CPU backend with gloo process
groups of 2 and 4 ranks that the tests spawn themselves (dist_worker.py runs in each).

- Tensor + sequence parallel (parallelize_module): forge under TP tracks single-process
  forge within what torch.optim itself moves between the same TP and single-process runs
  (TP's own reductions round differently: bit-identity across TP sizes is not possible for
  any optimizer; the fused step on a shard equals the step on the full parameter bit for
  bit, which the C++ suite checks); grad_norm and the non-finite count are global.
- FSDP2 (fully_shard): the update runs on the shard after the reduce-scatter; forge tracks
  single-process forge on the whole batch within what torch FSDP2 moves.
- The training loops users have, on shards as in one process: gradients zeroed keeping them
  (the optimizer's zero_grad or the model's) step what no backward reached on zeros, as
  torch.optim does; a loop that never zeroes them is refused before anything changes;
  clipping and micro-batches match torch.optim (mode='auto' stays deferred on shards).
- DDP is refused before any weight changes, however the optimizer meets it.
- torch.distributed.checkpoint: int8 and int4 states saved at 4 ranks load bit for bit at 4, 2
  and 1; resumed at 4 the run continues bit-exactly.

test_distributed_cuda.py makes the tensor parallel, FSDP2 and checkpoint comparisons on CUDA.
"""
import json
import os
import socket
import sys

import pytest
import torch

from test_contract import CONFIGS, config_id

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import dist_worker  # noqa: E402

# These runs are CPU process groups (gloo). torch 2.4's DTensor does not run them: its FSDP2
# makes CUDA streams at the first forward, and its row-parallel embedding asserts
# (embedding_ops, mask_buffer) in the tensor-parallel forward: both in torch's own code.
# (test_distributed_cuda.py carries the same mark)
NEEDS_TORCH_2_5 = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5),
    reason="torch 2.4's DTensor does not run these CPU process groups")
pytestmark = NEEDS_TORCH_2_5

STEPS = 3
LOOP_STEPS = 4  # (job_loops: the MLP is left out of steps 1 and 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, jobs, tmp_path):
    """Runs `jobs` on `world` processes (dist_worker.run); returns rank 0's measurements (every
    rank must have succeeded)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException
    out = tmp_path / f"world{world}"
    out.mkdir(exist_ok=True)
    try:
        mp.spawn(dist_worker.run, args=(world, str(out), _free_port(), jobs), nprocs=world)
    except ProcessException as e:  # a rank died (a signal, an exit code): say where
        logs = "".join(f"\n--- rank {r}: the end of {log.name} ---\n{log.read_text()[-4000:]}"
                       for r in range(world) if (log := out / f"rank{r}.log").exists())
        raise AssertionError(f"{world} ranks: {e}{logs}") from e
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r, result in enumerate(results):
        assert result["ok"], f"rank {r}:\n{result['error']}"
    return results[0]["measured"]


def _case(name, kwargs, sp=False, **forge):
    forge.setdefault("mode", "immediate")
    label = config_id((name, kwargs)) + (f"-{forge['state_format']}"
                                         if "state_format" in forge else "") + ("-sp" if sp else "")
    if "max_grad_norm" in forge:
        label += f"-max_grad_norm={forge['max_grad_norm']}"
    if forge["mode"] != "immediate":
        label += f"-{forge['mode']}"
    return {"id": label, "name": name, "kwargs": kwargs, "forge": forge, "sp": sp}


# One configuration of every rule (the last of each in test_contract.CONFIGS), fp32 states:
# the trajectories compare against torch.optim's own divergence, which low-precision states
# would not measure. int8 states under sharding: the checkpoint test below (bit-exact), and
# the shard-against-full kernel test of the C++ suite.
ONE_PER_RULE = list({name: (name, kwargs) for name, kwargs in CONFIGS}.values())
# max_grad_norm in immediate mode: lagged, each step clipped with the last step's global norm
# (summed over the ranks), so every rank scales by the one process's coefficient.
CLIPPED = _case("AdamW", dict(lr=1e-2, weight_decay=0.1), max_grad_norm=0.05)
# Muon: its hidden weights' blocks gathered whole on every rank for Newton-Schulz
# (dist_worker.muon_runs says what it is held to); under FSDP2 also in the default mode, auto,
# which stays deferred on shards (its updates at step()).
MUON = _case("Muon", dict(lr=0.02, adamw_lr=1e-3))
MUON_AUTO = _case("Muon", dict(lr=0.02, adamw_lr=1e-3), mode="auto")
TP2 = ([_case(n, k) for n, k in ONE_PER_RULE] + [CLIPPED, MUON]
       + [_case("AdamW", dict(lr=1e-2, weight_decay=0.1), sp=True),
          _case("SGD", dict(lr=0.1, momentum=0.9), sp=True)])  # (the last: a sequence parallel)
TP4 = [_case("AdamW", dict(lr=1e-2, weight_decay=0.1), sp=True),
       _case("SGD", dict(lr=0.1, momentum=0.9))]
FSDP2 = [_case(n, k) for n, k in ONE_PER_RULE if n in ("AdamW", "SGD", "Lion")] + [
    CLIPPED, MUON, MUON_AUTO]
FSDP4 = [_case("AdamW", dict(lr=1e-2, weight_decay=0.1))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One spawn per group size, every job of this file in it."""
    tmp = tmp_path_factory.mktemp("dist")
    checkpoint = str(tmp / "checkpoint")
    measured = {}
    int4 = {"dir": str(tmp / "checkpoint-int4"), "state_format": "int4"}
    clipped = {"dir": str(tmp / "checkpoint-clipped"), "max_grad_norm": 0.05, "flatten": True}
    measured[4] = spawn(4, [("tp", {"cases": TP4, "steps": STEPS}),
                            ("fsdp", {"cases": FSDP4, "steps": STEPS}),
                            ("dcp_save", {"dir": checkpoint}),
                            ("dcp_load", {"dir": checkpoint}),
                            ("dcp_save:int4", int4), ("dcp_load:int4", int4),
                            ("dcp_save:clipped", clipped), ("dcp_load:clipped", clipped)], tmp)
    measured[2] = spawn(2, [("tp", {"cases": TP2, "steps": STEPS}),
                            ("fsdp", {"cases": FSDP2, "steps": STEPS}),
                            ("loops", {"steps": LOOP_STEPS}),
                            ("ddp", {}),
                            ("head", {}),
                            ("fsdp_head", {"steps": STEPS}),
                            ("dcp_load", {"dir": checkpoint}), ("dcp_load:int4", int4)], tmp)
    measured[1] = spawn(1, [("dcp_load", {"dir": checkpoint}), ("dcp_load:int4", int4)], tmp)
    return measured


def _assert_tracks(forge_error, torch_error, what, record_difference):
    """forge's run against its reference (its single-process run, or torch.optim's on the
    same sharding): within CONTRACT_RTOL, or SUM_ORDER_FACTOR times what torch.optim moves
    between the sharded and the single-process run."""
    from tolerances import CONTRACT_RTOL, SUM_ORDER_FACTOR
    record_difference(what, forge_error)
    assert forge_error <= max(CONTRACT_RTOL, SUM_ORDER_FACTOR * torch_error), \
        (forge_error, torch_error)


def _assert_muon_tracks(forge_error, reordered_error, what, record_difference):
    """A sharded Muon run against single-process FORGE: within MUON_SUM_ORDER_FACTOR of the
    distance between single-process runs on reordered batch rows."""
    from tolerances import MUON_SUM_ORDER_FACTOR
    record_difference(what, forge_error)
    record_difference(f"  reordered rows (largest of {dist_worker.MUON_REORDERINGS})",
                      reordered_error)
    assert reordered_error > 0  # (the reordered runs did differ: the bound below is measured)
    assert forge_error <= MUON_SUM_ORDER_FACTOR * reordered_error, (forge_error,
                                                                     reordered_error)


def assert_tensor_parallel(m, what, record_difference):
    """job_tp's measurements of one case (test_distributed_cuda.py's too)."""
    from tolerances import GRAD_NORM_RTOL
    if "reordered_vs_1" in m:
        _assert_muon_tracks(m["forge_tp_vs_1"], m["reordered_vs_1"], what, record_difference)
    else:
        _assert_tracks(m["forge_tp_vs_1"], m["torch_tp_vs_1"], what, record_difference)
    assert m["grad_norm_rel"] <= GRAD_NORM_RTOL, m  # global, each element once
    assert m["nonfinite"] == 0


def assert_fsdp2(m, what, record_difference):
    """job_fsdp's measurements of one case (test_distributed_cuda.py's too)."""
    from tolerances import GRAD_NORM_RTOL
    if "reordered_vs_1" in m:
        _assert_muon_tracks(m["forge_fsdp_vs_1"], m["reordered_vs_1"], what, record_difference)
    else:
        _assert_tracks(m["forge_fsdp_vs_1"], m["torch_fsdp_vs_1"], what, record_difference)
    assert m["grad_norm_rel"] <= GRAD_NORM_RTOL, m


def assert_checkpoint(m, world):
    """job_dcp_load's measurements at `world` ranks (test_distributed_cuda.py's too)."""
    assert m["same_states"], m["differ"]
    if world == 4:
        assert m["continued_vs_saver"] == 0.0, "resumed at the same size: bit-exact"


@pytest.mark.parametrize("world,case", [(2, c) for c in TP2] + [(4, c) for c in TP4],
                         ids=lambda v: v["id"] if isinstance(v, dict) else f"tp{v}")
def test_tensor_parallel_tracks_one_process(results, world, case, record_difference):
    assert_tensor_parallel(results[world]["tp"][case["id"]], f"TP{world} {case['id']}",
                           record_difference)


@pytest.mark.parametrize("world,case", [(2, c) for c in FSDP2] + [(4, c) for c in FSDP4],
                         ids=lambda v: v["id"] if isinstance(v, dict) else f"fsdp{v}")
def test_fsdp2_tracks_one_process_on_the_whole_batch(results, world, case, record_difference):
    assert_fsdp2(results[world]["fsdp"][case["id"]], f"FSDP{world} {case['id']}",
                 record_difference)


@pytest.mark.parametrize("setup,loop,mode", dist_worker.LOOP_CASES,
                         ids=["-".join(c) for c in dist_worker.LOOP_CASES])
def test_training_loops_on_shards_match_torch(results, setup, loop, mode, record_difference):
    m = results[2]["loops"][f"{setup}-{loop}-{mode}"]
    _assert_tracks(m["forge_vs_torch"], m["torch_vs_1"], f"{setup} {loop} loop", record_difference)
    if loop == "missed_zero_grad":
        refusal, unchanged = m["refusal"]
        assert "no zero_grad() since" in refusal, refusal
        assert unchanged  # weights, states and step counts, where it was refused
    if mode == "auto":  # (it cannot see a DTensor gradient's use: never goes immediate)
        assert m["mode_after"] == "deferred"


def test_fused_head_on_fsdp2_tracks_one_process(results, record_difference):
    """FSDP2 with forge.loss's fused head: the loss forms the unsharded head's dW block by
    block for the reduce-scatter; against one process whose fused head updates the weight
    block by block in backward. enable_fused_head takes the FSDP2 model (its head weight a
    DTensor between steps)."""
    m = results[2]["fsdp_head"]
    _assert_tracks(m["forge_fsdp_vs_1"], m["torch_fsdp_vs_1"], "FSDP2 fused head",
                   record_difference)
    assert m["head_is_dtensor"] and m["enable_fused_head"] == "enabled", m


@pytest.mark.parametrize("what", ["head_cross_entropy", "enable_fused_head"])
def test_fused_head_refuses_a_tensor_parallel_head(results, what):
    refusal = results[2]["head"][what]
    assert refusal.startswith(what) and "DTensor (tensor parallel)" in refusal, refusal


@pytest.mark.parametrize("how", ["wrapper", "inner", "later"])
def test_ddp_is_refused_before_any_weight_changes(results, how):
    m = results[2]["ddp"]
    assert "DistributedDataParallel" in m[how] and "FSDP2" in m[how], m[how]
    assert m["unchanged"]
    assert m["later_at"] == "forward", "refused before backward starts DDP's all-reduces"


@pytest.mark.parametrize("world", [4, 2, 1])
def test_checkpoint_reshards_int8_states_bit_for_bit(results, world):
    assert_checkpoint(results[world]["dcp_load"], world)


@pytest.mark.parametrize("world", [4, 2, 1])
def test_checkpoint_reshards_int4_states_bit_for_bit(results, world):
    """int4 codes, two to a byte: a column shard of whole blocks is a column shard of the
    packed bytes, so DCP reshards them as it does int8's."""
    assert_checkpoint(results[world]["dcp_load:int4"], world)


def test_checkpoint_resumes_lagged_clipping_bit_exact(results):
    """Immediate mode with max_grad_norm clips each step with the last step's norm: a
    torch.distributed.checkpoint dict keeps only 'state' and 'param_groups', and the groups
    carry that norm, so the run resumed at the same size goes on bit for bit (its first step
    clipped as the saver's was, not unclipped). The dict is flattened, as torchtitan saves it:
    a group's values come back only under the keys the live groups have."""
    assert_checkpoint(results[4]["dcp_load:clipped"], 4)


def _forge_train(tmp_path, name, nproc, *options):
    """forge-train under torchrun (nproc ranks) or alone; returns metrics.json."""
    import subprocess
    out = tmp_path / name
    common = ["-m", "forge.tools.train", "--steps", "4", "--batch-size", "4", "--seq-len", "32",
              "--no-plot", "--out", str(out), *options]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(_free_port())] if nproc > 1 else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..",
                                                        "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(launcher + common, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("nproc,options", [(4, ("--tp", "2", "--fsdp"))], ids=["tp2-fsdp2"])
def test_forge_train_under_torchrun(tmp_path, nproc, options):
    """`torchrun -m forge.tools.train --tp N [--fsdp]` trains the built-in model as one process
    does: the same losses within tensor parallel's rounding, and the same global grad norm."""
    from tolerances import PARALLEL_RUN_RTOL
    alone = _forge_train(tmp_path, "alone", 1)
    spread = _forge_train(tmp_path, "spread", nproc, *options)
    assert len(spread["losses"]) == len(alone["losses"]) == 4
    for key in ("losses", "grad_norms"):
        for a, b in zip(spread[key], alone[key]):
            assert abs(a - b) <= PARALLEL_RUN_RTOL * abs(b), (key, spread[key], alone[key])


def test_forge_bench_under_torchrun(tmp_path):
    """`torchrun -m forge.tools.bench --tp 2` measures every case; rank 0 writes the rows."""
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..",
                                                        "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "forge.tools.bench", "--models", "tiny",
           "--device", "cpu", "--seqs", "32", "--ckpt", "off", "--modes", "torch-adamw",
           "forge-bf16", "--tp", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["environment"]["parallel"] == {"world": 2, "tp": 2, "dp": 1, "fsdp": False,
                                                "simulated": False}
    assert [r["status"] for r in saved["results"]] == ["ok", "ok"], saved["results"]
