"""test_train.py — forge-train end to end on CPU: a short default-style run with FORGE and
with the torch baseline, bit-exact resume after an interruption (Ctrl-C saves the step it
stopped after), atomic checkpoints, where a resumed run writes, and one clear message with a
non-zero exit for each bad input, found before training where it can be.

Runs are small (tiny model, a few steps of 4×32 tokens) and in-process (main(argv)), so
the file takes seconds; a few tests go through a subprocess to see what a user sees.
"""
import importlib.util
import json
import re
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

from conftest import DEVICES, requires_cuda
from forge.tools import train as forge_train

SMALL = ["--seq-len", "32", "--batch-size", "4", "--no-plot"]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these tiny runs gain nothing from more, and on a busy machine
    spinning OpenMP threads made them 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(argv):
    return forge_train.main([str(a) for a in argv])


def child_env():
    """The environment of a forge-train subprocess: this checkout's package first."""
    package_root = os.path.dirname(os.path.dirname(forge_train.__file__))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("baseline", [[], ["--baseline", "torch"]], ids=["forge", "torch"])
def test_short_run_reports_loss_memory_and_gradient_bytes(tmp_path, capsys, baseline):
    out = tmp_path / "run"
    assert run(["--steps", 6, "--seq-len", 32, "--batch-size", 4, "--out", out] + baseline) == 0
    printed = capsys.readouterr().out
    for text in ("final loss", "peak memory", "weight gradients held", "tokens/s", "loss curve"):
        assert text in printed
    m = metrics(out)
    assert len(m["losses"]) == 6 and all(torch.isfinite(torch.tensor(m["losses"])))
    if baseline:  # torch.optim: the whole Linear gradient pool is alive before step()
        assert m["peak_linear_weight_grad_bytes"] > 0
    else:  # FORGE: no nn.Linear weight ever holds a .grad
        assert m["peak_linear_weight_grad_bytes"] == 0
        assert "nn.Linear weights 0 B" in printed
    png = out / "loss.png"
    if importlib.util.find_spec("matplotlib"):
        assert png.is_file() and png.stat().st_size > 0
    else:
        assert "matplotlib is not installed" in printed


def test_other_optimizers_and_options_run(tmp_path):
    assert run(["--steps", 3, "--optimizer", "sgd", "--momentum", "0.9", "--nesterov",
                "--activation-checkpointing", "--out", tmp_path / "sgd"] + SMALL) == 0
    assert run(["--steps", 3, "--optimizer", "lion", "--state-format", "int8", "--bf16",
                "--out", tmp_path / "lion"] + SMALL) == 0
    assert run(["--steps", 3, "--optimizer", "muon", "--state-format", "bf16",
                "--out", tmp_path / "muon"] + SMALL) == 0


@pytest.mark.parametrize("baseline", [[], ["--baseline", "torch"]], ids=["forge", "torch"])
def test_amp_keeps_fp32_weights_and_computes_in_bf16(tmp_path, monkeypatch, baseline):
    """--amp: fp32 parameters, the loss computed under bf16 autocast (the matmuls' outputs are
    bf16), and a loss curve that differs from the fp32 run's by bf16 rounding only."""
    seen = []
    real_loss = forge_train.lm_loss

    def spy(model, tokens, lean=False):
        seen.append((next(model.parameters()).dtype, torch.is_autocast_enabled("cpu")))
        return real_loss(model, tokens, lean)
    monkeypatch.setattr(forge_train, "lm_loss", spy)
    common = ["--steps", 4, "--lr", "3e-3"] + SMALL + baseline
    assert run(common + ["--amp", "--out", tmp_path / "amp"]) == 0
    assert seen and all(s == (torch.float32, True) for s in seen)
    seen.clear()
    assert run(common + ["--out", tmp_path / "fp32"]) == 0
    assert all(s == (torch.float32, False) for s in seen)
    amp, fp32 = metrics(tmp_path / "amp")["losses"], metrics(tmp_path / "fp32")["losses"]
    assert amp != fp32
    assert max(abs(a - b) for a, b in zip(amp, fp32)) < 0.05


@requires_cuda
def test_cuda_graph_run_is_bit_identical_to_eager_on_cuda(tmp_path, deterministic):
    """--cuda-graph: two eager steps, then replays; with an lr that changes every step
    (warm-up, then cosine) the losses and the final weights equal the eager run's."""
    common = ["--steps", 8, "--warmup", 3, "--bf16", "--state-format", "int8", "--device",
              "cuda", "--save-every", 8] + SMALL
    assert run(common + ["--out", tmp_path / "eager"]) == 0
    assert run(common + ["--cuda-graph", "--out", tmp_path / "graph"]) == 0
    eager, graph = metrics(tmp_path / "eager"), metrics(tmp_path / "graph")
    assert eager["losses"] == graph["losses"]
    a = torch.load(tmp_path / "eager" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "graph" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("formats", [
    [], ["--bf16", "--state-format", "int8"], ["--optimizer", "muon"],
    pytest.param(["--optimizer", "muon", "--baseline", "torch"],
                 marks=pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                          reason="torch.optim.Muon: torch >= 2.9"))],
    ids=["fp32", "bf16-int8-states", "muon", "torch-muon"])
def test_resume_after_interruption_is_bit_exact(tmp_path, monkeypatch, formats):
    common = ["--steps", 12, "--warmup", 3, "--save-every", 4, "--lr", "3e-3"] + SMALL + formats
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run(common + ["--out", whole]) == 0

    # Interrupt the second run during step 7: its last checkpoint is the one of step 4.
    real_loss, calls = forge_train.lm_loss, []

    def interrupting_loss(model, tokens):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real_loss(model, tokens)
    monkeypatch.setattr(forge_train, "lm_loss", interrupting_loss)
    assert run(common + ["--out", parts]) == 130
    monkeypatch.setattr(forge_train, "lm_loss", real_loss)
    state = forge_train.load_checkpoint(str(parts / forge_train.CHECKPOINT_NAME))
    assert state["step"] == 4

    # Resume with no other option: the checkpoint's settings are taken.
    assert run(["--out", parts, "--resume"]) == 0
    assert metrics(parts)["losses"] == metrics(whole)["losses"]  # bit-identical floats
    for name, tensor in torch.load(whole / "checkpoint.pt", weights_only=True)["model"].items():
        assert torch.equal(tensor, torch.load(parts / "checkpoint.pt",
                                              weights_only=True)["model"][name]), name


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert run(["--steps", 2, "--save-every", 2, "--out", out] + SMALL) == 0
    before = (out / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"partial")  # a crash in the middle of writing
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", dying_save)
    assert run(["--steps", 4, "--save-every", 2, "--out", out, "--resume"]) == 130
    monkeypatch.setattr(torch, "save", real_save)
    assert (out / "checkpoint.pt").read_bytes() == before
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]  # no temporary file left
    assert forge_train.load_checkpoint(str(out / "checkpoint.pt"))["step"] == 2


def _a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


def _corrupt_checkpoint(tmp_path):
    out = tmp_path / "corrupt"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"\x00not a checkpoint" * 10)
    return ["--out", out, "--resume"]


def _truncated_checkpoint(tmp_path):
    out = tmp_path / "truncated"
    assert forge_train.main(["--steps", "1", "--save-every", "1", "--out", str(out)] + SMALL) == 0
    data = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    return ["--out", out, "--resume"]


BAD_INPUTS = {
    "missing data path": (lambda t: ["--data", t / "no-such-dir"], "does not exist"),
    "unknown optimizer": (lambda t: ["--optimizer", "adamax"], "unknown optimizer"),
    "sequence too long": (lambda t: ["--seq-len", 100000], "longer than model"),
    "corrupt checkpoint": (_corrupt_checkpoint, "corrupt"),
    "truncated checkpoint": (_truncated_checkpoint, "corrupt"),
    "missing checkpoint": (lambda t: ["--out", t / "empty", "--resume"], "no checkpoint"),
    "option of another optimizer": (lambda t: ["--momentum", "0.9"], "does not apply"),
    "torch has no Lion": (lambda t: ["--optimizer", "lion", "--baseline", "torch"],
                          "torch.optim has no Lion"),
    "negative steps": (lambda t: ["--steps", -1], "--steps must be positive"),
    "empty data directory": (lambda t: ["--data", t], "no text files"),
    "--amp with --bf16": (lambda t: ["--amp", "--bf16"], "choose one"),
    "--cuda-graph with torch.optim": (lambda t: ["--cuda-graph", "--baseline", "torch"],
                                      "not with --baseline torch"),
    "--cuda-graph on the CPU": (lambda t: ["--cuda-graph", "--device", "cpu"],
                                "--cuda-graph needs a CUDA device"),
    "negative --lr in exponent notation": (lambda t: ["--lr", "-1e-3"],
                                           "--lr must be a finite number >= 0, got -0.001"),
    "--out is a file": (lambda t: ["--out", _a_file(t)], "is a file, not a directory"),
    "--out below a file": (lambda t: ["--out", _a_file(t) / "run"], "cannot be created, "),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_clear_message(tmp_path, capsys, case):
    make_argv, expected = BAD_INPUTS[case]
    argv = make_argv(tmp_path)
    capsys.readouterr()
    code = run(["--steps", 2, "--out", tmp_path / "out"] + SMALL + argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("forge-train: error: ") and expected in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["--lr", "-1e-3"], ["--out", "FILE"], ["--help"]],
                         ids=["bad-lr", "bad-out", "help"])
def test_help_and_early_errors_answer_before_torch_is_imported(tmp_path, argv):
    """--help and the checks that need no model answer without importing torch (seconds on
    a small machine): the user hears about a bad --out before training, not after it."""
    argv = [str(_a_file(tmp_path)) if a == "FILE" else a for a in argv]
    code = ("import sys\n"
            "from forge.tools import train\n"
            "try:\n"
            f"    status = train.main({argv!r})\n"
            "except SystemExit as e:\n"
            "    status = e.code\n"
            "print('status', status, 'torch imported', 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=child_env())
    assert proc.stdout.strip().splitlines()[-1] == \
        f"status {0 if argv == ['--help'] else 2} torch imported False", proc.stderr
    if argv == ["--help"]:  # the defaults are shown, and none of them as "None"
        words = " ".join(proc.stdout.split())  # as wrapped for any terminal width
        for text in (f"(default: {forge_train.DEFAULT_STEPS})", "(default: tiny)",
                     "adamw 0.001", "(default: 16)", "runs/forge-train"):
            assert text in words, text
        assert "None" not in words
    else:
        assert proc.stderr.count("\n") == 1 and "forge-train: error: " in proc.stderr


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_wait_passively_unless_told_otherwise(given, expected):
    """forge-train sets OMP_WAIT_POLICY=PASSIVE for the OpenMP runtime torch loads after it,
    unless the user set a policy."""
    env = {k: v for k, v in child_env().items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = ("import os\n"
            "from forge.tools import train\n"
            "status = train.main(['--lr', '-1'])\n"
            "print(status, os.environ.get('OMP_WAIT_POLICY'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.stdout.split() == ["2", expected], proc.stderr


def test_model_presets_named_in_help_are_the_models(tmp_path):
    from forge.tools import models as forge_models
    assert forge_train.MODEL_PRESETS == tuple(forge_models.PRESETS)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a directory without write permission")
def test_unwritable_out_is_refused_before_training(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert run(["--steps", 2, "--out", locked] + SMALL) == 2
        assert run(["--steps", 2, "--out", locked / "run"] + SMALL) == 2
    finally:
        locked.chmod(0o700)
    captured = capsys.readouterr()
    assert "cannot write there" in captured.err and "is not writable" in captured.err
    assert "forge-train: model" not in captured.out  # nothing started


def _constant_lr_run(steps, out):
    """A run whose lr does not depend on --steps (no warm-up, a cosine from 1 to 1): a run
    cut short and resumed with other --steps must still match an uninterrupted one."""
    return ["--steps", steps, "--warmup", 0, "--min-lr-ratio", 1.0, "--lr", "3e-3",
            "--out", out] + SMALL


@pytest.fixture
def sigint_handled():
    """SIGINT as an interactive Python process has it (KeyboardInterrupt), whatever the suite
    was started with (a background job starts with it ignored); restored afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_as_python_sets_it():
    """preexec_fn of a child: SIGINT at its default, so the child's Python handles it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_finishes_the_step_and_saves_it(tmp_path, monkeypatch, capsys, sigint_handled):
    """SIGINT during step 3 of a run without --save-every: step 3 completes, its checkpoint
    is written (atomically: no temporary file is left), the message names the step, and the
    resumed run is bit-identical to one never interrupted."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run(_constant_lr_run(6, whole)) == 0
    real_loss, calls = forge_train.lm_loss, []

    def sigint_in_step_3(model, tokens):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # Python runs the handler right here
        return real_loss(model, tokens)
    monkeypatch.setattr(forge_train, "lm_loss", sigint_in_step_3)
    capsys.readouterr()
    assert run(_constant_lr_run(100, parts)) == 130
    monkeypatch.setattr(forge_train, "lm_loss", real_loss)
    assert len(calls) == 3  # stopped after the step in flight
    err = capsys.readouterr().err
    assert f"interrupted after step 3 of 100; {parts / 'checkpoint.pt'} holds step 3" in err, err
    assert forge_train.load_checkpoint(str(parts / "checkpoint.pt"))["step"] == 3
    assert sorted(os.listdir(parts)) == ["checkpoint.pt"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    assert run(["--resume", parts, "--steps", 6]) == 0
    assert metrics(parts)["losses"] == metrics(whole)["losses"]


def test_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch, capsys,
                                                          sigint_handled):
    real_loss, calls = forge_train.lm_loss, []

    def two_sigints_in_step_2(model, tokens):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # the guard raises KeyboardInterrupt here
        return real_loss(model, tokens)
    monkeypatch.setattr(forge_train, "lm_loss", two_sigints_in_step_2)
    out = tmp_path / "run"
    capsys.readouterr()
    assert run(["--steps", 10, "--out", out] + SMALL) == 130
    assert len(calls) == 2
    err = capsys.readouterr().err
    assert "interrupted during step 2; no checkpoint was written" in err, err
    assert not os.path.exists(out / "checkpoint.pt")


def test_ctrl_c_in_a_terminal_leaves_a_resumable_checkpoint(tmp_path):
    """What a user sees: forge-train in a child process gets SIGINT once it has printed step
    3; it exits with 130 and one message naming the step its checkpoint holds."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "forge.tools.train", "--log-every", "1"]
                            + [str(a) for a in _constant_lr_run(100000, out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), preexec_fn=_sigint_as_python_sets_it)
    try:
        for line in proc.stdout:
            if re.match(r"step\s+3/", line):
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    held = re.search(r"holds step (\d+): continue with forge-train --resume", err)
    assert held and "Traceback" not in err, err
    state = forge_train.load_checkpoint(str(out / "checkpoint.pt"))
    assert state["step"] == int(held[1]) >= 3
    assert len(state["losses"]) == state["step"]


def test_ignored_sigint_stays_ignored(tmp_path, monkeypatch):
    """A run started with SIGINT ignored (nohup, a script's background job) keeps ignoring it:
    the run goes on to its last step, and the disposition is left as it was."""
    real_loss, calls = forge_train.lm_loss, []

    def sigint_in_step_2(model, tokens):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return real_loss(model, tokens)
    monkeypatch.setattr(forge_train, "lm_loss", sigint_in_step_2)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert run(["--steps", 4, "--out", tmp_path / "run"] + SMALL) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(calls) == 4


def test_resume_dir_writes_there_unless_out_says_otherwise(tmp_path, monkeypatch, capsys):
    """--resume DIR continues in DIR (not in ./runs/forge-train, where it could overwrite
    another run); --out moves it elsewhere. A temporary file left by a killed save is removed
    at the start, with a note."""
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "first"
    assert run(["--steps", 2, "--save-every", 2, "--out", first] + SMALL) == 0
    (first / ".checkpoint.pt.tmp").write_bytes(b"half a checkpoint")
    capsys.readouterr()
    assert run(["--steps", 4, "--resume", first]) == 0
    assert f"removed {first / '.checkpoint.pt.tmp'}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "runs")
    assert sorted(os.listdir(first)) == ["checkpoint.pt", "metrics.json"]
    assert forge_train.load_checkpoint(str(first / "checkpoint.pt"))["step"] == 4
    assert len(metrics(first)["losses"]) == 4
    other = tmp_path / "other"
    assert run(["--steps", 6, "--resume", first / "checkpoint.pt", "--out", other]) == 0
    assert forge_train.load_checkpoint(str(first / "checkpoint.pt"))["step"] == 4
    assert forge_train.load_checkpoint(str(other / "checkpoint.pt"))["step"] == 6


def test_every_run_ends_with_a_checkpoint_that_a_resumed_run_moves(tmp_path, capsys):
    """Without --save-every a run still ends with its checkpoint; a resumed run's checkpoint
    moves to its own end (it stayed at the resume point while metrics.json said the end, and
    a second --resume silently trained the same steps again), and resuming a finished run
    says so."""
    out = tmp_path / "run"
    assert run(["--steps", 2, "--out", out] + SMALL) == 0
    assert forge_train.load_checkpoint(str(out / "checkpoint.pt"))["step"] == 2
    assert run(["--steps", 4, "--resume", out]) == 0
    assert forge_train.load_checkpoint(str(out / "checkpoint.pt"))["step"] == 4
    assert len(metrics(out)["losses"]) == 4
    capsys.readouterr()
    assert run(["--steps", 4, "--resume", out]) == 2
    assert "the checkpoint is at step 4: nothing to do" in capsys.readouterr().err
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_out_of_another_run_is_refused_unless_resume_or_overwrite(tmp_path, capsys):
    """A fresh run into an --out that holds another run's checkpoint, metrics or plot is
    refused before anything is written (it overwrote the metrics and left the old
    checkpoint); --resume continues that run, --overwrite replaces it (the old files go
    first); other files in the folder are no run's and are left alone."""
    out = tmp_path / "run"
    assert run(["--steps", 2, "--out", out] + SMALL) == 0
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    capsys.readouterr()
    assert run(["--steps", 3, "--out", out] + SMALL) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"forge-train: error: --out {out}: holds another run's") and \
        "--resume" in err and "--overwrite" in err, err
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert run(["--steps", 3, "--out", out, "--overwrite"] + SMALL) == 0
    assert forge_train.load_checkpoint(str(out / "checkpoint.pt"))["step"] == 3
    assert len(metrics(out)["losses"]) == 3
    # a resumed run written into another folder of another run: refused the same way
    other = tmp_path / "other"
    assert run(["--steps", 2, "--out", other] + SMALL) == 0
    assert run(["--steps", 5, "--resume", out, "--out", other]) == 2
    assert "holds another run's" in capsys.readouterr().err
    assert forge_train.load_checkpoint(str(other / "checkpoint.pt"))["step"] == 2
    # unrelated files are no run's
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.txt").write_text("mine")
    assert run(["--steps", 1, "--out", notes] + SMALL) == 0
    assert (notes / "README.txt").read_text() == "mine"


def test_ctrl_c_under_a_pipe_that_closed_still_saves(tmp_path):
    """forge-train ... 2>&1 | tee log, then Ctrl-C: the terminal's SIGINT ends tee too, so
    every later write to stdout or stderr fails (BrokenPipeError, raised in the interrupt
    handler itself, ended the run with no checkpoint). The step in flight finishes, its
    checkpoint is written, and the exit status is 130."""
    out = tmp_path / "run"
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "forge.tools.train", "--log-every", "1"]
                            + [str(a) for a in _constant_lr_run(100000, out)],
                            stdout=write_end, stderr=write_end, env=child_env(),
                            preexec_fn=_sigint_as_python_sets_it)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "r") as pipe:
            for line in pipe:
                if re.match(r"step\s+3/", line):
                    break
        # (the pipe is closed now, as tee's end is when the same Ctrl-C ends it)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    state = forge_train.load_checkpoint(str(out / "checkpoint.pt"))
    assert state["step"] >= 3 and len(state["losses"]) == state["step"]


def test_data_size_is_shown_in_kb_below_a_megabyte(tmp_path, capsys):
    from forge.tools import data as forge_data
    assert [forge_data.text_size(n) for n in (999, 1000, 12_345, 999_999, 2_500_000)] == \
        ["999 bytes", "1.0 KB", "12.3 KB", "1000.0 KB", "2.5 MB"]
    text = tmp_path / "small.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)  # 8,800 bytes
    assert run(["--steps", 1, "--data", text, "--out", tmp_path / "run"] + SMALL) == 0
    assert "data 1 file(s), 8.8 KB;" in capsys.readouterr().out


def test_resume_refuses_a_conflicting_option(tmp_path, capsys):
    """Named by the values in effect: a checkpoint that took adamw's default lr shows 0.001
    (not None), and an explicit --lr 0.001 is no conflict with it."""
    out = tmp_path / "run"
    assert run(["--steps", 2, "--save-every", 2, "--out", out] + SMALL) == 0
    capsys.readouterr()
    assert run(["--steps", 4, "--out", out, "--resume", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--lr 0.5 differs from the checkpoint's 0.001 (" in err, err
    assert run(["--steps", 4, "--out", out, "--resume", "--betas", "0.8", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "--betas 0.8 0.9 differs from the checkpoint's 0.9 0.999 (" in err, err
    assert run(["--steps", 4, "--out", out, "--resume", "--data", tmp_path]) == 2
    assert "differs from the checkpoint's built-in corpus (" in capsys.readouterr().err
    assert run(["--steps", 4, "--out", out, "--resume", "--lr", "0.001", "--betas", "0.9",
                "0.999"]) == 0


def test_command_line_error_has_no_traceback(tmp_path):
    """What a user sees from the console script: one line on stderr, status 2."""
    package_root = os.path.dirname(os.path.dirname(forge_train.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-m", "forge.tools.train", "--data",
                           str(tmp_path / "missing.txt"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"forge-train: error: data path does not exist: {tmp_path / 'missing.txt'}"]


# ----------------------------------------------------------------------------- forge-bench

def test_bench_smoke_on_cpu(tmp_path):
    """forge-bench end to end on a tiny model: every mode measured, every file written."""
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--out", str(tmp_path)]) == 0
    files = sorted(os.listdir(tmp_path))
    assert {f.rsplit(".", 1)[1] for f in files} >= {"md", "json", "csv"}
    with open(tmp_path / next(f for f in files if f.endswith(".json"))) as f:
        saved = json.load(f)
    assert saved["environment"]["torch"] == torch.__version__
    assert "forge-bench --models tiny" in saved["environment"]["command"]
    rows = saved["results"]
    assert [r["mode"] for r in rows] == bench.MODES
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in rows), rows


def test_bench_loop_clip_modes_on_cpu(tmp_path):
    """The modes of a loop that clips before each step (torch's clip_grad_norm_ over the
    model's parameters): measured for torch and FORGE; FORGE's optimizer is the default one
    (mode="auto"), which the clip keeps deferred."""
    from forge.tools import bench
    modes = ["torch-adamw-loopclip", "forge-bf16-loopclip"]
    assert set(modes) <= set(bench.KNOWN_MODES)
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--modes", *modes, "--out", str(tmp_path)]) == 0
    json_file = next(f for f in os.listdir(tmp_path) if f.endswith(".json"))
    with open(tmp_path / json_file) as f:
        rows = json.load(f)["results"]
    assert [r["mode"] for r in rows] == modes
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in rows), rows


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
def test_bench_muon_modes_on_cpu(tmp_path):
    """torch's Muon + AdamW pair and forge.optim.Muon (bf16 and int8 momentum), each step
    measured; the pair takes Muon for the weights forge.optim.Muon's default groups give it."""
    from forge.tools import bench
    modes = ["torch-muon", "forge-muon-bf16", "forge-muon-int8"]
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--modes", *modes, "--timed-steps", "2", "--out", str(tmp_path)]) == 0
    json_file = next(f for f in os.listdir(tmp_path) if f.endswith(".json"))
    with open(tmp_path / json_file) as f:
        rows = json.load(f)["results"]
    assert [r["mode"] for r in rows] == modes
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in rows), rows


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6),
                    reason="--simulate-ranks needs torch >= 2.6")
def test_bench_simulated_ranks_on_cpu(tmp_path):
    """--simulate-ranks: rank 0 of a 4-rank FSDP2 job and of a 2-rank tensor-parallel one, alone
    in this process (torch's fake process group): the model is built on the meta device and only
    this rank's shards are made (its weights a quarter of the whole model's, padding aside), the
    rows say it was simulated, and the process group is gone afterwards."""
    import torch.distributed as dist
    from forge.tools import bench
    common = ["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
              "--modes", "torch-adamw", "forge-bf16", "--timed-steps", "2"]

    def rows_of(out, extra):
        assert bench.main(common + extra + ["--out", str(out)]) == 0
        assert not dist.is_initialized()
        with open(out / next(f for f in os.listdir(out) if f.endswith(".json"))) as f:
            saved = json.load(f)
        assert all(r["status"] == "ok" for r in saved["results"]), saved["results"]
        return saved
    whole = rows_of(tmp_path / "one", [])
    fsdp = rows_of(tmp_path / "fsdp", ["--simulate-ranks", "4", "--fsdp"])
    tp = rows_of(tmp_path / "tp", ["--simulate-ranks", "2", "--tp", "2"])
    assert fsdp["environment"]["parallel"] == dict(world=4, tp=1, dp=4, fsdp=True, simulated=True)
    assert tp["environment"]["parallel"]["simulated"] and "rank 0 of 2 simulated" in \
        tp["environment"]["gpu"]
    full = whole["results"][0]["weights_gib"]
    for r in fsdp["results"]:
        assert 0 < r["weights_gib"] < 0.3 * full
    assert all(r["states_gib"] is not None for r in fsdp["results"])
    # (the default, mode="auto", cannot see a loop's use of a DTensor gradient: deferred)
    assert [r["forge_mode"] for r in fsdp["results"] if r["mode"] == "forge-bf16"] == \
        ["deferred"]
    if importlib.util.find_spec("transformers") is not None:  # (the fused head: HF's models)
        modes = ["forge-int8-head", "forge-int8-head-immediate"]
        head = rows_of(tmp_path / "head", ["--simulate-ranks", "4", "--fsdp", "--modes", *modes])
        assert [r["mode"] for r in head["results"]] == modes
        # -immediate: each sharded gradient applied as it arrives, none held until step()
        assert [r["forge_mode"] for r in head["results"]] == ["deferred", "immediate"]
        assert head["results"][0]["weights_gib"] == head["results"][1]["weights_gib"]
    for extra, message in ((["--simulate-ranks", "1", "--fsdp"], "at least 2"),
                           (["--simulate-ranks", "4"], "add --fsdp")):
        assert bench.main(common + extra + ["--out", str(tmp_path / "bad")]) == 2
        assert not dist.is_initialized()


def test_bench_default_modes_batch_compile_and_the_memory_suite(tmp_path, monkeypatch):
    """FORGE's modes run the default arguments (mode="auto") unless a mode names one; rows say
    the batch and --compile (the model compiled after the optimizer: aot_eager here, to spare
    Inductor's C++ compiles); --suite memory lists the default's memory cases, torch first."""
    from forge.tools import bench
    assert {"forge-bf16-immediate", "forge-bf16-deferred"} <= set(bench.KNOWN_MODES)
    made = {}
    original = bench.make_optimizer

    def recording(mode, *args, **kwargs):
        made[mode] = original(mode, *args, **kwargs)
        return made[mode]
    monkeypatch.setattr(bench, "make_optimizer", recording)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compile_(m, backend="aot_eager", **kw))
    modes = ["forge-bf16", "forge-bf16-immediate", "forge-bf16-deferred"]
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "16", "--ckpt", "off",
                       "--modes", *modes, "--batch", "2", "--compile", "--timed-steps", "2",
                       "--out", str(tmp_path)]) == 0
    assert {m: made[m].inspect().requested_mode for m in modes} == dict(zip(modes, [
        "auto", "immediate", "deferred"]))
    with open(tmp_path / next(f for f in os.listdir(tmp_path) if f.endswith(".json"))) as f:
        rows = json.load(f)["results"]
    for row in rows:
        assert row["status"] == "ok" and row["batch"] == 2 and row["compiled"], row
        assert len(row["step_ms_each"]) == 2
        # (from the step time before its rounding to 0.1 ms)
        assert row["tokens_per_s"] == pytest.approx(2 * 16 / (row["step_ms"] / 1e3), rel=0.01)
    args = bench.build_parser().parse_args(["--suite", "memory"])
    cases = bench.plan(args)
    assert ("llama-3.1-8b", 8192, True, "torch-adamw") in cases
    assert ("qwen3-14b", 2048, True, "forge-bf16") in cases
    assert [c[3] for c in cases[:4]] == bench.MEMORY_MODES
    assert len(cases) == 10 * len(bench.MEMORY_MODES)


def test_bench_rounds_alternate_the_order_and_merge(tmp_path, capsys):
    """--rounds 2: the modes of each (model, seq, ckpt) run in order, then in reverse; each mode
    gets one row, its step time the median of its rounds, both listed."""
    from forge.tools import bench
    cases = [("m", 1, False, "a"), ("m", 1, False, "b"), ("m", 2, False, "a"),
             ("m", 2, False, "b")]
    assert bench.balanced_rounds(cases, 2) == cases + [cases[1], cases[0], cases[3], cases[2]]
    assert bench.balanced_rounds(cases, 1) == cases
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--modes", "torch-adamw", "forge-bf16", "--rounds", "2",
                       "--out", str(tmp_path)]) == 0
    order = re.findall(r"\] tiny seq 32 (\S+):", capsys.readouterr().out)
    assert order == ["torch-adamw", "forge-bf16", "forge-bf16", "torch-adamw"]
    with open(tmp_path / next(f for f in os.listdir(tmp_path) if f.endswith(".json"))) as f:
        rows = json.load(f)["results"]
    assert [r["mode"] for r in rows] == ["torch-adamw", "forge-bf16"]
    for r in rows:
        assert len(r["step_ms_rounds"]) == 2
        assert r["step_ms"] == round(statistics.median(r["step_ms_rounds"]), 1)


def test_bench_merge_rounds_keeps_an_out_of_memory_and_drops_skipped_rounds():
    from forge.tools import bench
    ok = dict(model="m", seq=1, ckpt=False, mode="a", status="ok", step_ms=10.0, peak_gib=1.0)
    oom = dict(ok, status="oom", note="out of memory")
    skipped = dict(ok, status="skipped", note="time budget spent")
    assert bench.merge_rounds([ok, skipped]) == [ok]
    (row,) = bench.merge_rounds([ok, oom])
    assert row["status"] == "oom" and row["note"].startswith("round 2 of 2")
    assert bench.main(["--models", "tiny", "--device", "cpu", "--rounds", "0"]) == 2


def test_bench_out_of_memory_says_where(monkeypatch):
    """A case that runs out of memory is a row saying so, and where: the stage and the step's
    phase (on a GPU also the bytes allocated then, the weights' share, the failing ask)."""
    from forge.tools import bench
    real_backward = torch.Tensor.backward

    def backward_out_of_memory(self, *args, **kwargs):
        if bench._WHERE.get("stage") == "the steps after the first":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real_backward(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "backward", backward_out_of_memory)
    row = bench.measure("tiny", 32, False, "forge-bf16", torch.device("cpu"), torch.float32)
    assert row["status"] == "oom", row
    assert row["note"] == "out of memory in the steps after the first (backward)", row


def test_bench_profile_on_cpu(tmp_path):
    """--profile: each case's row gets per-step times by category and the host profile, and
    forge-profile-*.md is written; on the CPU the categories hold operator self times."""
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--modes", "torch-adamw", "forge-bf16", "--profile", "1",
                       "--out", str(tmp_path)]) == 0
    files = os.listdir(tmp_path)
    with open(tmp_path / next(f for f in files if f.startswith("forge-bench-")
                              and f.endswith(".json"))) as f:
        rows = json.load(f)["results"]
    for row in rows:
        prof = row["profile"]
        assert prof["steps"] == 1 and prof["timing"] == "cpu-self"
        assert prof["kernel_ms"] > 0 and prof["launches"] > 0
        assert sum(prof["categories"].values()) == pytest.approx(prof["kernel_ms"], rel=1e-2)
        assert prof["top"] and prof["host"]["ms"] > 0 and prof["host"]["top"]
        phases = prof["phases"]  # host times per phase; no GPU events on the CPU
        assert list(phases["host_ms"]) == ["forward", "backward", "optimizer"]
        assert phases["host_ms"]["backward"] > 0 and phases["gpu_ms"] is None
        assert phases["peak_gib"] is None  # GPU memory only
        assert phases["gc_per_step"] >= 0 and phases["gc_ms_per_step"] >= 0
        # every timed step kept, the host's issue time, and the steps timed again at the end
        assert len(row["step_ms_each"]) == bench.TIMED_STEPS and row["host_ms"] > 0
        assert row["step_ms"] == pytest.approx(statistics.median(row["step_ms_each"]), abs=0.1)
        assert prof["retimed"]["step_ms"] > 0 and prof["retimed"]["host_ms"] > 0
    markdown = (tmp_path / next(f for f in files if f.startswith("forge-profile-"))).read_text()
    assert "## tiny seq 32 torch-adamw" in markdown and "## tiny seq 32 forge-bf16" in markdown
    assert "timed again after the profile" in markdown


def profiled_tiny_rows_on_cuda(tmp_path, *extra: str) -> list:
    """forge-bench --profile 1 of torch-adamw and forge-bf16 on the tiny model on CUDA (with
    `extra` arguments): the JSON's rows."""
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cuda", "--seqs", "32", "--ckpt", "off",
                       "--modes", "torch-adamw", "forge-bf16", "--profile", "1", *extra,
                       "--out", str(tmp_path)]) == 0
    name = next(f for f in os.listdir(tmp_path) if f.startswith("forge-bench-")
                and f.endswith(".json"))
    with open(tmp_path / name) as f:
        return json.load(f)["results"]


@requires_cuda
def test_bench_profile_on_cuda(tmp_path):
    """--profile's GPU side: kernel times, runtime calls, phases timed with events, peaks."""
    rows = profiled_tiny_rows_on_cuda(tmp_path)
    for row in rows:
        prof = row["profile"]
        assert prof["timing"] == "device" and prof["kernel_ms"] > 0 and prof["launches"] > 0
        phases = prof["phases"]
        assert set(phases["gpu_ms"]) == {"forward", "backward", "optimizer"}
        assert phases["host_waited_ms"] >= 0
        assert all(v > 0 for v in phases["peak_gib"].values())
    forge_row = next(r for r in rows if r["mode"] == "forge-bf16")
    assert forge_row["profile"]["categories"]["forge wgrad + update"] > 0


@requires_cuda
def test_bench_profile_of_cuda_graph_replays(tmp_path):
    """--profile with --cuda-graph: the replays' kernels are recorded (FORGE's fused kernels
    among them), and no phases are timed (a replay is one launch)."""
    rows = profiled_tiny_rows_on_cuda(tmp_path, "--cuda-graph")
    for row in rows:
        assert row["status"] == "ok" and row.get("graph"), row
        prof = row["profile"]
        assert prof["kernel_ms"] > 0 and prof["launches"] > 0 and prof["phases"] is None
    forge_row = next(r for r in rows if r["mode"] == "forge-bf16")
    assert forge_row["profile"]["categories"]["forge wgrad + update"] > 0
    torch_row = next(r for r in rows if r["mode"] == "torch-adamw")
    assert torch_row["profile"]["categories"]["torch optimizer"] > 0
    markdown = (tmp_path / next(f for f in os.listdir(tmp_path)
                                if f.startswith("forge-profile-"))).read_text()
    assert "forge-bf16 (CUDA graph)" in markdown


def test_host_overhead_bench_runs():
    """bench/host_overhead.py (a benchmark, not timed here) runs and prints both figures."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                          "host_overhead.py")
    layers = [[], ["--layer", "scale", "--hook-path"], ["--tokens", "64"]]
    if importlib.util.find_spec("transformers") is not None:
        layers.append(["--layer", "conv1d"])
    for extra in layers:
        proc = subprocess.run([sys.executable, script, "--device", "cpu", "--layers", "3",
                               "--steps", "2", *extra], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        line = proc.stdout.strip().splitlines()[-1]
        assert "torch AdamW(foreach)" in line and "forge.optim.AdamW" in line, line
        assert ("hook path" in line) == ("--hook-path" in extra), line
        assert ("Conv1Ds" in line) == ("conv1d" in extra), line
        assert ("64 tokens" in line) == ("--tokens" in extra), line


def test_host_overhead_bench_measures_a_baseline(tmp_path):
    """--baseline DIR times another FORGE package (here this checkout's own, imported a second
    time as forge_baseline) in the same rounds, and its figure joins the JSON."""
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
    python_dir = os.path.join(bench, "..", "python")
    out = tmp_path / "host.json"
    # (timeouts: a hang guard; each process imports torch and may build the C++ part, minutes
    # on a loaded 2-core machine)
    proc = subprocess.run([sys.executable, os.path.join(bench, "host_overhead.py"), "--device",
                           "cpu", "--layers", "3", "--steps", "2", "--rounds", "2",
                           "--baseline", python_dir, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    variants = [r["variant"] for r in results]
    assert variants[:2] == ["torch AdamW(foreach)", "forge.optim.AdamW"], variants
    assert len(variants) == 3 and variants[2].startswith("forge.optim.AdamW at "), variants
    assert all(r["us_per_linear"] > 0 for r in results)
    bad = subprocess.run([sys.executable, os.path.join(bench, "host_overhead.py"), "--device",
                          "cpu", "--layers", "1", "--steps", "1", "--baseline", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--baseline" in bad.stderr, bad.stderr
    compiled = subprocess.run([sys.executable, os.path.join(bench, "host_overhead.py"),
                               "--device", "cpu", "--compile", "--baseline", python_dir],
                              capture_output=True, text=True, timeout=600)
    assert compiled.returncode != 0 and "--baseline with --compile" in compiled.stderr, \
        compiled.stderr


def _cpu_step_script():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                        "cpu_step.py")


def test_cpu_step_bench_runs():
    """bench/cpu_step.py (a benchmark, not timed here) times both ways on every shape it is
    given and prints the table with the totals."""
    proc = subprocess.run([sys.executable, _cpu_step_script(), "--shapes", "17x8,8x40",
                           "--tokens", "40", "--rounds", "2", "--threads", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[2:]] == ["17x8", "8x40", "all (given)"], rows


@pytest.mark.parametrize("argv, named", [(["--shapes", "17"], "--shapes"),
                                         (["--tokens", "0"], "--tokens"),
                                         (["--rounds", "-1"], "--rounds")])
def test_cpu_step_bench_refuses_bad_arguments(argv, named):
    proc = subprocess.run([sys.executable, _cpu_step_script()] + argv, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _fake_wgrad_bench_md(bf16_512, unfused_512, layer_ms):
    """The two tables of a wgrad_bench bench.md that bench/ab_totals.py reads."""
    return "\n".join([
        "| layer (out×in) | T | fused bf16 ms (TF/s, GB/s) | unfused (c) ms | speedup (c)/(a-bf16) |"
        " epilogue-only ms AdamW / SGD |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| q_proj/o_proj 4096×4096 | 512 | {layer_ms} (219, 2674) | 0.096 | **1.23×** | 0.065 / 0.032 |",
        "",
        "## Llama-3.1-8B, all 224 linear layers (sum of the per-layer medians × occurrences)",
        "",
        "| T | fused bf16 ms | unfused (c) ms | speedup (c)/(a-bf16) |",
        "| --- | --- | --- | --- |",
        f"| 512 | {bf16_512} | {unfused_512} | 1.27× |",
        "| 2048 | 59.0 | 66.0 | 1.12× |",
    ])


def test_ab_totals_takes_medians_per_setting(tmp_path):
    """bench/ab_totals.py (what gpu_check.sh ab prints): medians over the repetitions of each
    setting, the Llama totals and the per-layer times, speedups and epilogue-only left out."""
    runs = {"default": [(30.0, 39.0, 0.078), (31.0, 38.0, 0.080), (35.0, 40.0, 0.090)],
            "PREFETCH=0": [(29.0, 39.5, 0.070), (29.4, 39.5, 0.072)]}
    for setting, reps in runs.items():
        for rep, values in enumerate(reps, 1):
            d = tmp_path / f"{setting}-r{rep}"
            d.mkdir()
            (d / "bench.md").write_text(_fake_wgrad_bench_md(*values))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                          "ab_totals.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in proc.stdout.splitlines() if line.startswith("| ")]
    totals = {(r[0], r[1]): r[2:] for r in rows if r[1] in ("512", "2048") and len(r) == 4
              and "(" in r[2]}
    assert totals[("default", "512")] == ["31.0 (3)", "39.0 (3)"]
    assert totals[("PREFETCH=0", "512")] == ["29.2 (2)", "39.5 (2)"]
    assert totals[("default", "2048")] == ["59.0 (3)", "66.0 (3)"]
    spread = {(r[0], r[1]): r[2:] for r in rows if r[1] == "512" and len(r) == 4
              and "–" in r[2]}
    assert spread[("default", "512")] == ["30.0 – 35.0", "38.0 – 40.0"]
    assert spread[("PREFETCH=0", "512")] == ["29.0 – 29.4", "39.5 – 39.5"]
    layer = next(r for r in rows if r[0].startswith("q_proj") and r[1] == "512")
    assert layer[2:] == ["0.071", "0.080"]  # settings by name: PREFETCH=0, default
    assert "1.27" not in proc.stdout and "0.065" not in proc.stdout


def test_trace_sweep_gaps_between_ctas(tmp_path):
    """bench/trace_sweep.py --gaps: how long a CTA slot of an SM stands empty between CTAs."""
    header = "clock_start,clock_main_end,clock_end,ns_start,ns_end,sm,block"
    # SM 0: two CTAs start at 0 and end at 10 and 14 µs; the third starts at 12 (the slot
    # freed at 10: a 2 µs gap), the fourth at 15 (freed at 14: 1 µs). SM 1: one gap of 4 µs.
    ctas = [(0, 10, 0), (0, 14, 0), (12, 30, 0), (15, 31, 0), (0, 8, 1), (0, 9, 1), (13, 20, 1)]
    lines = [header] + [f"0,0,0,{s * 1000},{e * 1000},{sm},{i}" for i, (s, e, sm) in enumerate(ctas)]
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(lines) + "\n")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                          "trace_sweep.py")
    proc = subprocess.run([sys.executable, script, "--gaps", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "median 2.00 µs" in proc.stdout and "n=3" in proc.stdout, proc.stdout
    assert "p90 2.00 µs" in proc.stdout, proc.stdout


def test_step_profile_times_garbage_collections():
    import gc
    from forge.tools.step_profile import phase_times
    callbacks = list(gc.callbacks)
    phases = [("collect", gc.collect), ("nothing", lambda: None)]
    times = phase_times(phases, 2, torch.device("cpu"))
    assert times["gc_per_step"] >= 1 and times["gc_ms_per_step"] > 0
    assert list(times["host_ms"]) == ["collect", "nothing"]
    assert gc.callbacks == callbacks  # the timer removed its callback


def test_step_profile_categories():
    from forge.tools.step_profile import category
    assert category("void forge::cuda::wgrad_wgmma_kernel<false, UpdateSpec<2, 2, 2> >(...)") \
        == "forge wgrad + update"
    assert category("forge::cuda::(anonymous namespace)::elementwise_kernel(void const*, int)") \
        == "forge element-wise step"
    assert category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<"
                    "FusedAdamMathFunctor>") == "torch optimizer"
    assert category("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "GEMM (cuBLAS)"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention"
    assert category("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>") \
        == "other"


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward spends its time in Python, like a fused Linear's hooks."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _busy_python(0.02)
        return g


def _busy_python(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("device", DEVICES)
def test_host_profile_sees_the_backward(device):
    """forge-bench --profile's cProfile step: Python run by backward is in it (on a GPU autograd
    runs backward on a thread of its own, which cProfile before Python 3.12 does not follow)."""
    from forge.tools.step_profile import host_profile
    x = torch.ones(4, device=device, requires_grad=True)

    def step():
        _SlowBackward.apply(x).sum().backward()
    names = [row["name"] for row in host_profile(step, torch.device(device))["top"]]
    assert any("_busy_python" in n for n in names), names


def test_bench_rejects_negative_profile_steps(capsys):
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cpu", "--profile", "-1"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_bench_memory_limit_is_a_cuda_device_limit(capsys):
    """--memory-limit-gib caps the CUDA caching allocator: on the CPU it is refused by name
    before any case runs."""
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cpu", "--memory-limit-gib", "30"]) == 2
    assert "--memory-limit-gib" in capsys.readouterr().err


def test_bench_parity_report_smoke_on_cpu(tmp_path):
    from forge.tools import bench
    assert bench.main(["--parity", "--parity-model", "tiny", "--parity-steps", "4",
                       "--parity-seq-len", "16", "--parity-batch-size", "2", "--device", "cpu",
                       "--parity-noise-runs", "2", "--parity-amp-seeds", "3",
                       "--out", str(tmp_path / "out"),
                       "--parity-work-dir", str(tmp_path / "runs")]) == 0
    report_file = next(f for f in os.listdir(tmp_path / "out") if f.endswith(".json"))
    with open(tmp_path / "out" / report_file) as f:
        report = json.load(f)
    noise = bench.noise_run_names(2)
    assert noise == [bench.NOISE_RUN, bench.NOISE_RUN + "-2"]
    forge_runs = {"forge-bf16-sr", "forge-int8", "forge-fp8", "forge-int4"}
    assert set(report["comparisons"]) == {*forge_runs, *noise}
    assert len(report["spread"]["torch_pairs"]) == 3  # reference and two noise runs
    assert set(report["spread"]["forge"]) == forge_runs
    # run order: a call cut short keeps the bf16 comparison beside a noise floor
    amp = bench.amp_run_names(3)
    assert amp == [bench.PARITY_AMP_REFERENCE, bench.PARITY_AMP_REFERENCE + "-seed1",
                   bench.PARITY_AMP_REFERENCE + "-seed2"]
    assert list(report["runs"]) == [bench.PARITY_REFERENCE, "forge-bf16-sr", amp[0],
                                    noise[0], "forge-int8", "forge-fp8", "forge-int4", noise[1],
                                    amp[1], amp[2]]
    # every other run measured against the mixed-precision (fp32 weights, autocast) run ...
    assert set(report["against_amp"]) == set(report["runs"]) - set(amp)
    # ... and held to that reference's spread over its three seeds (other initial weights and
    # batches: other curves)
    spread = report["amp_seed_spread"]
    assert set(spread["seeds"]) == set(amp)
    assert len({tuple(report["runs"][n]["losses"]) for n in amp}) == 3
    assert set(spread["runs"]) == set(report["runs"]) - set(amp)
    for e in spread["runs"].values():
        assert e["within"] == (abs(e["offset"]) <= spread["radius"])
    assert report["runs"][bench.PARITY_AMP_REFERENCE]["losses"] != \
        report["runs"][bench.PARITY_REFERENCE]["losses"]  # fp32 weights: another run
    for c in report["comparisons"].values():
        assert c["steps"] == 4 and c["mean_abs_diff_last_half"] >= 0
    # two noise seeds: two different perturbed runs, both measured as the floor
    runs = report["runs"]
    assert runs[noise[0]]["losses"] != runs[noise[1]]["losses"]
    floor = [report["comparisons"][n]["mean_abs_diff_last_half"] for n in noise]
    for name in forge_runs:
        c = report["comparisons"][name]
        assert c["noise_floor"] == floor
        assert c["within_noise_floor"] == (c["mean_abs_diff_last_half"] <= max(floor))
    # the same report again into the same work folder, two runs named: its runs replace the
    # last ones'
    assert bench.main(["--parity", "--parity-model", "tiny", "--parity-steps", "2",
                       "--parity-seq-len", "16", "--parity-batch-size", "2", "--device", "cpu",
                       "--parity-runs", "forge-bf16-sr", "forge-int4", "--parity-noise-runs",
                       "0", "--parity-amp-seeds", "1", "--out", str(tmp_path / "out2"),
                       "--parity-work-dir", str(tmp_path / "runs")]) == 0
    again = next(f for f in os.listdir(tmp_path / "out2") if f.endswith(".json"))
    with open(tmp_path / "out2" / again) as f:
        runs = json.load(f)["runs"]
    assert not [n for n, r in runs.items() if "error" in r]
    assert "forge-int4" in runs and "forge-int8" not in runs


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
def test_bench_parity_of_muon_on_cpu(tmp_path):
    """--parity-optimizer muon: forge.optim.Muon against torch.optim.Muon + AdamW, its runs
    named for it, Muon's learning rate by default and no AdamW betas on the command."""
    from forge.tools import bench
    names = bench.PARITY_NAMES["muon"]
    assert bench.main(["--parity", "--parity-optimizer", "muon", "--parity-model", "tiny",
                       "--parity-steps", "2", "--parity-seq-len", "16", "--parity-batch-size",
                       "2", "--device", "cpu", "--parity-noise-runs", "1",
                       "--parity-amp-seeds", "2", "--parity-runs", list(names["forge"])[1],
                       "--out", str(tmp_path / "out"),
                       "--parity-work-dir", str(tmp_path / "runs")]) == 0
    with open(tmp_path / "out" / next(f for f in os.listdir(tmp_path / "out")
                                      if f.endswith(".json"))) as f:
        report = json.load(f)
    amp = bench.amp_run_names(2, names["amp"])
    assert list(report["runs"]) == [names["reference"], amp[0], names["noise"],
                                    list(names["forge"])[1], amp[1]]
    assert not [n for n, r in report["runs"].items() if "error" in r]
    assert report["runs"][list(names["forge"])[1]]["optimizer"].startswith("forge.optim.Muon")
    assert report["runs"][names["reference"]]["optimizer"] == \
        "torch.optim.Muon + torch.optim.AdamW"
    settings = report["settings"]
    assert settings[settings.index("--lr") + 1] == str(names["lr"]) and "--betas" not in settings
    assert set(report["amp_seed_spread"]["runs"]) == {names["reference"], names["noise"],
                                                      list(names["forge"])[1]}


def test_bench_parity_runs_chooses_forges_runs(tmp_path, capsys):
    """--parity-runs: only the named FORGE runs, beside every reference run; an unknown or
    missing name is refused before anything runs."""
    from forge.tools import bench
    common = ["--parity", "--parity-model", "tiny", "--parity-steps", "2", "--parity-seq-len",
              "16", "--parity-batch-size", "2", "--device", "cpu", "--parity-noise-runs", "0",
              "--parity-amp-seeds", "2", "--out", str(tmp_path / "out"),
              "--parity-work-dir", str(tmp_path / "runs")]
    assert bench.main(common + ["--parity-runs", "forge-fp8"]) == 0
    report_file = next(f for f in os.listdir(tmp_path / "out") if f.endswith(".json"))
    with open(tmp_path / "out" / report_file) as f:
        report = json.load(f)
    amp = bench.amp_run_names(2)
    assert list(report["runs"]) == [bench.PARITY_REFERENCE, amp[0], "forge-fp8", amp[1]]
    assert set(report["amp_seed_spread"]["runs"]) == {bench.PARITY_REFERENCE, "forge-fp8"}
    assert bench.main(common + ["--parity-runs", "forge-fp4"]) == 2
    assert "--parity-runs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # (argparse: none named)
        bench.main(common + ["--parity-runs"])
    assert e.value.code == 2 and "--parity-runs" in capsys.readouterr().err


def test_bench_parity_seeds_runs_forge_over_the_amp_seeds(tmp_path, capsys):
    """--parity-seeds 2: each named FORGE run again at seed 1 (the amp seed-1 run's initial
    weights and batches), after the amp seeds; the criterion holds the mean over its seeds, and
    its seed-1 run is compared per step with amp's seed 1; below 1 is refused."""
    from forge.tools import bench
    common = ["--parity", "--parity-model", "tiny", "--parity-steps", "4", "--parity-seq-len",
              "16", "--parity-batch-size", "2", "--device", "cpu", "--parity-noise-runs", "0",
              "--parity-amp-seeds", "2", "--parity-runs", "forge-int4",
              "--out", str(tmp_path / "out"), "--parity-work-dir", str(tmp_path / "runs")]
    assert bench.main(common + ["--parity-seeds", "0"]) == 2
    assert "--parity-seeds" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    assert bench.main(common + ["--parity-seeds", "2"]) == 0
    with open(tmp_path / "out" / next(f for f in os.listdir(tmp_path / "out")
                                      if f.endswith(".json"))) as f:
        report = json.load(f)
    amp = bench.amp_run_names(2)
    assert list(report["runs"]) == [bench.PARITY_REFERENCE, amp[0], "forge-int4", amp[1],
                                    "forge-int4-seed1"]
    losses = {n: r["losses"] for n, r in report["runs"].items()}
    assert losses["forge-int4"] != losses["forge-int4-seed1"]
    # (forge-train keeps the last --seed: the settings' seed 0, then the run's own)
    assert report["runs"]["forge-int4-seed1"]["arguments"][-2:] == ["--seed", "1"]
    assert report["runs"][amp[1]]["arguments"][-2:] == ["--seed", "1"]
    assert "int4" in report["runs"]["forge-int4-seed1"]["arguments"]
    spread = report["amp_seed_spread"]
    family = spread["families"]["forge-int4"]
    means = [spread["runs"][n]["last_half_mean"] for n in ("forge-int4", "forge-int4-seed1")]
    assert family["seeds"] == 2 and abs(family["last_half_mean"] - sum(means) / 2) < 1e-12
    assert family["within"] == (abs(family["offset"]) <= spread["radius"])
    assert "forge-int4-seed1" not in report["spread"]["forge"]
    assert "forge-int4 over 2 seeds" in capsys.readouterr().out
    # a seed the amp reference did not run: compared per step with no other seed's run
    one_amp = [a if a != "2" or common[i - 1] != "--parity-amp-seeds" else "1"
               for i, a in enumerate(common)]
    out = str(tmp_path / "out-one-amp")
    one_amp[one_amp.index("--out") + 1] = out
    assert bench.main(one_amp + ["--parity-seeds", "2"]) == 0
    with open(os.path.join(out, next(f for f in os.listdir(out) if f.endswith(".json")))) as f:
        report = json.load(f)
    assert "forge-int4-seed1" in report["runs"]
    assert set(report["against_amp"]) == {bench.PARITY_REFERENCE, "forge-int4"}


def test_bench_parity_jobs_runs_at_once_with_the_same_losses(tmp_path, capsys):
    """--parity-jobs 3: the same runs, each in its own process, give the same losses as one
    after another, and the report lists them in the plan's order; below 1 is refused before
    anything runs."""
    from forge.tools import bench
    common = ["--parity", "--parity-model", "tiny", "--parity-steps", "3", "--parity-seq-len",
              "16", "--parity-batch-size", "2", "--device", "cpu", "--parity-noise-runs", "1",
              "--parity-amp-seeds", "2", "--parity-runs", "forge-int8"]
    reports = {}
    for jobs in ("1", "3"):
        out = str(tmp_path / f"out-{jobs}")
        assert bench.main(common + ["--parity-jobs", jobs, "--out", out, "--parity-work-dir",
                                    str(tmp_path / f"runs-{jobs}")]) == 0
        with open(os.path.join(out, next(f for f in os.listdir(out)
                                         if f.endswith(".json")))) as f:
            reports[jobs] = json.load(f)
    one, three = reports["1"], reports["3"]
    assert three["jobs"] == 3 and one["jobs"] == 1
    assert list(three["runs"]) == list(one["runs"]) and len(one["runs"]) == 5
    for name, run in one["runs"].items():
        assert "error" not in run
        assert three["runs"][name]["losses"] == run["losses"], name
    assert three["amp_seed_spread"] == one["amp_seed_spread"]
    assert bench.main(common + ["--parity-jobs", "0", "--out", str(tmp_path / "none")]) == 2
    assert "--parity-jobs" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "none")


def test_bench_parity_continue_takes_the_earlier_calls_runs_and_runs_the_rest(tmp_path,
                                                                               capsys):
    """--parity-continue: a report made in two calls equals the one made in one: the first
    call's finished runs come from its JSON (not run again: their seconds are the first call's),
    a run it lost is run; a report of other settings, or no report, is refused by name before
    anything runs."""
    from forge.tools import bench
    common = ["--parity", "--parity-model", "tiny", "--parity-steps", "3", "--parity-seq-len",
              "16", "--parity-batch-size", "2", "--device", "cpu", "--parity-noise-runs", "0",
              "--parity-amp-seeds", "2"]

    def report_in(out):
        with open(os.path.join(out, next(f for f in os.listdir(out)
                                         if f.endswith(".json")))) as f:
            return json.load(f)

    whole = str(tmp_path / "whole")
    assert bench.main(common + ["--parity-runs", "forge-int8", "forge-fp8", "--out", whole,
                                "--parity-work-dir", str(tmp_path / "runs-whole")]) == 0
    first = str(tmp_path / "first")
    assert bench.main(common + ["--parity-runs", "forge-int8", "--out", first,
                                "--parity-work-dir", str(tmp_path / "runs-first")]) == 0
    # the first call lost one of its runs
    earlier = report_in(first)
    amp = bench.amp_run_names(2)
    earlier["runs"][amp[1]] = {"error": "AcceleratorError: unspecified launch failure"}
    earlier_path = str(tmp_path / "first.json")
    with open(earlier_path, "w") as f:
        json.dump(earlier, f)
    second = str(tmp_path / "second")
    assert bench.main(common + ["--parity-runs", "forge-int8", "forge-fp8", "--out", second,
                                "--parity-work-dir", str(tmp_path / "runs-second"),
                                "--parity-continue", earlier_path]) == 0
    one, two = report_in(whole), report_in(second)
    assert list(two["runs"]) == list(one["runs"])
    for name, run in one["runs"].items():
        assert two["runs"][name]["losses"] == run["losses"], name
        assert two["runs"][name]["arguments"] == run["arguments"], name
    assert two["amp_seed_spread"] == one["amp_seed_spread"]
    taken = [bench.PARITY_REFERENCE, amp[0], "forge-int8"]
    assert two["continued"] == {"from": "first.json", "runs": taken}
    for name in taken:
        assert two["runs"][name]["seconds"] == earlier["runs"][name]["seconds"]
    assert f"taken from {earlier_path} (not run again): {', '.join(taken)}" in \
        capsys.readouterr().out
    # refused before anything runs: other settings, another card, no report
    for bad, names in ((common[:4] + ["5"] + common[5:], "other settings"),
                       (common, "no parity report")):
        out = str(tmp_path / "refused")
        path = earlier_path if names == "other settings" else str(tmp_path / "missing.json")
        assert bench.main(bad + ["--out", out, "--parity-continue", path]) == 2
        err = capsys.readouterr().err
        assert "--parity-continue" in err and names in err
        assert not os.path.exists(out)
    other_card = dict(earlier, environment=dict(earlier["environment"], gpu="NVIDIA H200"))
    with open(tmp_path / "h200.json", "w") as f:
        json.dump(other_card, f)
    assert bench.main(common + ["--out", str(tmp_path / "refused"), "--parity-continue",
                                str(tmp_path / "h200.json")]) == 2
    assert "ran on NVIDIA H200" in capsys.readouterr().err


def test_bench_amp_seed_spread_holds_runs_to_the_seeds_envelope():
    """amp_seed_spread: the seeds' last-half mean losses 2.0, 2.2, 2.6 (center 2.2667,
    radius 0.3333); a run at 2.5 is within, one at 1.9 is not; one seed alone defines no
    spread."""
    from forge.tools import bench
    amp = bench.amp_run_names(3)
    flat = lambda v: [9.0, 9.0, v, v]  # (the first half does not count)
    curves = {amp[0]: flat(2.0), amp[1]: flat(2.2), amp[2]: flat(2.6),
              "near": flat(2.5), "far": flat(1.9)}
    spread = bench.amp_seed_spread(curves, amp)
    assert abs(spread["center"] - 6.8 / 3) < 1e-12
    assert abs(spread["radius"] - (2.6 - 6.8 / 3)) < 1e-12
    assert spread["runs"]["near"]["within"] and not spread["runs"]["far"]["within"]
    alone = bench.amp_seed_spread({amp[0]: flat(2.0), "near": flat(2.5)}, amp)
    assert "radius" not in alone and alone["runs"] == {}


def test_bench_parity_spread_compares_with_every_torch_run():
    from forge.tools import bench
    torch_runs = [bench.PARITY_REFERENCE, bench.NOISE_RUN]
    curves = {bench.PARITY_REFERENCE: [1.0] * 10, bench.NOISE_RUN: [1.1] * 10,
              "near": [1.05] * 10, "far": [1.3] * 10}
    spread = bench.parity_spread(curves, torch_runs)
    assert spread["torch_pairs"] == {f"{bench.PARITY_REFERENCE} vs {bench.NOISE_RUN}":
                                     pytest.approx(0.1)}
    near, far = spread["forge"]["near"], spread["forge"]["far"]
    assert near["to_torch_runs"] == {bench.PARITY_REFERENCE: pytest.approx(0.05),
                                     bench.NOISE_RUN: pytest.approx(0.05)}
    assert near["within_torch_spread"] is True
    assert far["mean_to_torch_runs"] == pytest.approx(0.25)
    assert far["within_torch_spread"] is False
    # one torch run: distances, but no spread to be within
    alone = bench.parity_spread({bench.PARITY_REFERENCE: [1.0] * 4, "x": [1.2] * 4}, torch_runs)
    assert alone["torch_pairs"] == {} and "within_torch_spread" not in alone["forge"]["x"]


def test_bench_parity_rejects_negative_noise_runs(tmp_path, capsys):
    from forge.tools import bench
    assert bench.main(["--parity", "--parity-model", "tiny", "--device", "cpu",
                       "--parity-noise-runs", "-1", "--out", str(tmp_path)]) == 2
    assert "--parity-noise-runs" in capsys.readouterr().err
    assert bench.main(["--parity", "--parity-model", "tiny", "--device", "cpu",
                       "--parity-amp-seeds", "0", "--out", str(tmp_path)]) == 2
    assert "--parity-amp-seeds" in capsys.readouterr().err


def test_bench_rejects_unknown_model(capsys):
    from forge.tools import bench
    assert bench.main(["--models", "gpt-5", "--device", "cpu"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err


def _torch_unfused_module():
    """bench/torch_unfused.py imported as a module (its report helpers run without a GPU)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                        "torch_unfused.py")
    spec = importlib.util.spec_from_file_location("torch_unfused", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_torch_unfused_totals_and_report():
    """bench/torch_unfused.py's Llama totals weigh each layer by its occurrences (2 q/o, 2 k/v,
    2 gate/up, 1 down per decoder layer, 32 layers) and its report gives per-layer and total
    speedups as torch (c) / FORGE."""
    mod, _ = _torch_unfused_module()
    ms = {"q_proj/o_proj": 1.0, "k_proj/v_proj": 10.0, "gate_proj/up_proj": 100.0,
          "down_proj": 1000.0}
    rows = []
    for name, out, inp, _ in mod.SHAPES:
        for t, scale in ((512, 1.0), (2048, 3.0)):
            rows.append(dict(layer=name, out=out, inp=inp, tokens=t, forge_fused=ms[name] * scale,
                             torch_dw=0.5 * ms[name] * scale, torch_adamw=ms[name] * scale,
                             torch_unfused=2.0 * ms[name] * scale))
    totals = mod.llama_totals(rows, [512, 2048])
    assert totals[512]["forge_fused"] == pytest.approx(32 * (2 * 1 + 2 * 10 + 2 * 100 + 1000))
    assert totals[2048]["torch_unfused"] == pytest.approx(3 * 2 * totals[512]["forge_fused"])
    text = mod.report_md(dict(date="d", gpu="g", torch="t", command="c", iters=7), rows,
                         [512, 2048])
    assert "| down_proj 4096x14336 | 512 | 1000.0000 | 500.0000 | 1000.0000 | 2000.0000 | 2.00x |" \
        in text
    assert f"| 512 | {totals[512]['forge_fused']:.2f} |" in text
    assert "median of 7 interleaved rounds" in text


@pytest.mark.parametrize("argv, named", [(["--iters", "0"], "--iters"),
                                         (["--tokens", "512,x"], "--tokens"),
                                         (["--tokens", "0"], "--tokens")])
def test_torch_unfused_refuses_bad_arguments(argv, named):
    """Bad arguments end the benchmark before it touches a device, naming the argument."""
    _, path = _torch_unfused_module()
    proc = subprocess.run([sys.executable, path] + argv, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr, proc.stderr


def test_torch_unfused_needs_a_gpu():
    """Without CUDA the benchmark says so and fails, rather than timing nothing."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run")
    _, path = _torch_unfused_module()
    proc = subprocess.run([sys.executable, path, "--tokens", "512"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "needs a CUDA device" in proc.stderr, proc.stderr


def test_bench_loop_and_head_modes_on_cpu(tmp_path):
    """forge-bench's deferred, clipping, accumulate_grad and fused-head modes run and report
    (the fused head's modes need transformers' model: forge.loss.enable_fused_head)."""
    from forge.tools import bench
    has_transformers = importlib.util.find_spec("transformers") is not None
    modes = bench.LOOP_MODES + (bench.HEAD_MODES if has_transformers else [])
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--modes", *modes, "--out", str(tmp_path)]) == 0
    with open(tmp_path / next(f for f in sorted(os.listdir(tmp_path))
                              if f.endswith(".json"))) as f:
        rows = json.load(f)["results"]
    assert [r["mode"] for r in rows] == modes
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in rows), rows
