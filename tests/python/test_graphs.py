"""test_graphs.py — whole training steps as CUDA graphs (forge.graphs.CUDAGraphStep).

CPU (CI): the ctypes binding of the ABI-2 additions (forge_hparams.run_scalars as the last
field, forge_run_scalars_fill): a step whose scalars come from a filled buffer gives the
bits of the eager step they were filled for, whatever step, lr and seed the call carries;
bad buffers are refused naming the argument. Also rebind_streams and the argument checks.
CUDA (names hold "cuda"): a tiny model trained eagerly and through CUDAGraphStep from the
same start gives bit-identical parameters, states and losses after every step, an lr
changed between replays included.
"""
import ctypes
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

import forge
import forge.graphs
import forge.optim
from conftest import requires_cuda
from forge import _lib
from tiny_models import TinyTransformer, batch, lm_loss
from tolerances import GRAPH_GRAD_NORM_RTOL

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "include",
                      "forge", "forge.h")
ROWS, COLS = 12, 70  # 70: two int8 blocks, the second one partial


# ----------------------------------------------------------------------------- the ABI

def header_struct_fields(name: str):
    """[(C type, field name)] of `typedef struct { ... } name;` in forge.h, in order."""
    text = open(HEADER).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    body = re.search(r"typedef struct \{([^{}]*)\}\s*" + name + ";", text).group(1)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        ctype, first = re.match(r"(.*?[\s*])(\w+)$", decl.split(",")[0]).groups()
        fields.append((" ".join(ctype.split()), first))
        fields += [(" ".join(ctype.split()), n.strip()) for n in decl.split(",")[1:]]
    return fields


C_SIZES = {"int32_t": 4, "forge_rule": 4, "int64_t": 8, "uint64_t": 8, "double": 8,
           "const void*": ctypes.sizeof(ctypes.c_void_p)}


def test_hparams_layout_matches_the_header():
    fields = header_struct_fields("forge_hparams")
    assert [n for _, n in fields] == [n for n, _ in _lib.Hparams._fields_]
    assert fields[-1] == ("const void*", "run_scalars")
    end = 0
    for ctype, name in fields:
        field = getattr(_lib.Hparams, name)
        assert field.size == C_SIZES[ctype], name
        assert field.offset >= end and field.offset % field.size == 0, name
        end = field.offset + field.size
    assert ctypes.sizeof(_lib.Hparams) == end  # 8-byte fields last: no tail padding
    header = open(HEADER).read()
    assert f"#define FORGE_ABI_VERSION {_lib.ABI_VERSION}\n" in header
    assert f"#define FORGE_RUN_SCALARS_BYTES {_lib.RUN_SCALARS_BYTES}\n" in header
    assert _lib.ABI_VERSION == 6 and forge.library()._lib.forge_abi_version() == 6


class HostParam:
    """A [ROWS, COLS] parameter in libforge's layout on the CPU: weight, states, absmax."""

    def __init__(self, hp, weight_format, state_format, weight):
        lib = forge.library()
        layout = lib.state_layout(hp, state_format, ROWS, COLS)
        self.weight_format, self.state_format = weight_format, state_format
        self.weight = weight.clone()
        self.states = [torch.zeros(layout.state_bytes[i], dtype=torch.uint8)
                       for i in range(layout.num_states)]
        self.absmax = [torch.zeros(max(1, layout.absmax_count[i]), dtype=torch.float32)
                       for i in range(layout.num_states)]
        lib.state_init(self.struct(), hp, cpu_device())

    def struct(self) -> _lib.Param:
        fp = _lib.Param()
        fp.rows, fp.cols = ROWS, COLS
        fp.weight_format, fp.weight = self.weight_format, self.weight.data_ptr()
        fp.state_format = self.state_format
        for i, (s, a) in enumerate(zip(self.states, self.absmax)):
            fp.state[i] = s.data_ptr()
            fp.state_absmax[i] = _lib.float_ptr(a.data_ptr())
        return fp

    def clone(self) -> "HostParam":
        other = object.__new__(HostParam)
        other.__dict__.update(self.__dict__)
        other.weight = self.weight.clone()
        other.states = [s.clone() for s in self.states]
        other.absmax = [a.clone() for a in self.absmax]
        return other

    def bits(self):
        return [self.weight.view(torch.uint8)] + self.states + self.absmax

    def same_bits(self, other) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.bits(), other.bits()))

    def step(self, hp, grad):
        args = _lib.ElementwiseArgs()
        args.abi_version = _lib.ABI_VERSION
        args.device = cpu_device()
        args.grad, args.grad_dtype = grad.data_ptr(), _lib.DTYPE_FP32
        args.param, args.hparams = self.struct(), hp
        forge.library().elementwise_step(args)


def cpu_device() -> _lib.Device:
    d = _lib.Device()
    d.kind, d.num_threads = _lib.DEVICE_CPU, 1
    return d


def hparams(rule, step, lr, seed=5):
    hp = forge.library().hparams_default(rule)
    hp.step, hp.lr, hp.seed, hp.weight_decay = step, lr, seed, 0.1
    return hp


def aligned_address(buf: torch.Tensor, offset: int = 0) -> int:
    """An address in buf that is 16-byte aligned, plus offset."""
    return buf.data_ptr() + (-buf.data_ptr()) % 16 + offset


RULE_CASES = [  # (id, rule, weight dtype, weight format, state format)
    ("adamw", _lib.RULE_ADAMW, torch.float32, _lib.WEIGHT_FP32, _lib.STATE_FP32),
    ("nadam", _lib.RULE_NADAM, torch.float32, _lib.WEIGHT_FP32, _lib.STATE_FP32),
    ("radam", _lib.RULE_RADAM, torch.float32, _lib.WEIGHT_FP32, _lib.STATE_FP32),  # rectified >= 6
    ("adamw-bf16-sr", _lib.RULE_ADAMW, torch.bfloat16, _lib.WEIGHT_BF16_STOCHASTIC,
     _lib.STATE_BF16_STOCHASTIC),
    ("adamw-int8", _lib.RULE_ADAMW, torch.float32, _lib.WEIGHT_FP32, _lib.STATE_INT8_BLOCK64),
    ("adamw-fp8", _lib.RULE_ADAMW, torch.float32, _lib.WEIGHT_FP32, _lib.STATE_FP8_BLOCK64),
]


@pytest.mark.parametrize("case", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_run_scalars_give_the_filled_steps_bits(case):
    """Filled for step 7, lr 0.01: a call carrying step 1, lr 999 (valid, wrong) and another
    seed gives the eager step-7 bits, and not the bits of its own scalars."""
    _, rule, dtype, weight_format, state_format = case
    lib = forge.library()
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(ROWS, COLS, generator=g).to(dtype)
    start = HostParam(hparams(rule, 1, 0.01), weight_format, state_format, weight)
    start.step(hparams(rule, 1, 0.01), torch.randn(ROWS, COLS, generator=g))  # non-zero states
    grad = torch.randn(ROWS, COLS, generator=g)

    buf = torch.zeros(_lib.RUN_SCALARS_BYTES + 32, dtype=torch.uint8)
    lib.run_scalars_fill(hparams(rule, 7, 0.01), aligned_address(buf), _lib.RUN_SCALARS_BYTES)
    call = hparams(rule, 1, 999.0, seed=123)
    call.run_scalars = aligned_address(buf)
    eager, filled, own = start.clone(), start.clone(), start.clone()
    eager.step(hparams(rule, 7, 0.01), grad)
    filled.step(call, grad)
    own.step(hparams(rule, 1, 999.0, seed=123), grad)
    assert filled.same_bits(eager)
    assert not own.same_bits(eager)
    if weight_format == _lib.WEIGHT_BF16_STOCHASTIC:
        # the rounding key too comes from the buffer: same step and lr, another seed differs
        other_seed = start.clone()
        other_seed.step(hparams(rule, 7, 0.01, seed=123), grad)
        assert not other_seed.same_bits(eager)


def test_run_scalars_fill_needs_256_bytes():
    hp = hparams(_lib.RULE_ADAMW, 1, 0.01)
    buf = torch.full((_lib.RUN_SCALARS_BYTES + 32,), 0x5A, dtype=torch.uint8)
    with pytest.raises(_lib.ForgeInvalidArgument, match="bytes"):
        forge.library().run_scalars_fill(hp, aligned_address(buf), _lib.RUN_SCALARS_BYTES - 1)
    assert bool((buf == 0x5A).all()), "a refused fill wrote its buffer"


def test_misaligned_run_scalars_is_refused_and_nothing_written():
    hp = hparams(_lib.RULE_ADAMW, 3, 0.01)
    buf = torch.zeros(_lib.RUN_SCALARS_BYTES + 32, dtype=torch.uint8)
    forge.library().run_scalars_fill(hp, aligned_address(buf, 8), _lib.RUN_SCALARS_BYTES)
    p = HostParam(hp, _lib.WEIGHT_FP32, _lib.STATE_FP32, torch.randn(ROWS, COLS))
    before = p.clone()
    hp.run_scalars = aligned_address(buf, 8)
    with pytest.raises(_lib.ForgeInvalidArgument, match="run_scalars"):
        p.step(hp, torch.randn(ROWS, COLS))
    assert p.same_bits(before)


# ----------------------------------------------------------------------------- the optimizer

def test_rebind_streams_keeps_the_training_bit_exact():
    """rebind_streams() between steps re-hooks the fused weights once (two Python hooks each,
    or the C++ pair of a live record; no double update): the run equals one without it."""
    def run(rebind):
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = forge.optim.AdamW(model, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            if rebind:
                opt.rebind_streams()
            lm_loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        fused = [p for p in opt.inspect() if p.path == "fused"]
        assert fused and all(p.python_hooks == 2 if not p.cpp_prehook
                             else p.python_hooks == 0 for p in fused)
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


class HostRunScalars:
    """forge.optim.capture._RunScalars on the CPU (no pinned memory, no events): lets the capture
    bookkeeping run in CI."""

    def __init__(self, count, device):
        self.count = count
        self.device = torch.zeros(count * _lib.RUN_SCALARS_BYTES, dtype=torch.uint8)
        self.device_address = self.device.data_ptr()
        self.staging = [torch.zeros_like(self.device) for _ in range(2)]
        self.current, self.host_address = 1, 0

    def next_staging(self):
        self.current ^= 1
        self.host_address = self.staging[self.current].data_ptr()

    def upload(self):
        self.device.copy_(self.staging[self.current])


def _fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.parametrize("rule", ["AdamW", "NAdam"])
def test_capture_bookkeeping(rule, monkeypatch):
    """What CUDAGraphStep drives, on the CPU with the kernels left out: a captured update
    points at its parameter's region and counts no step; each prepare_graph_replay counts one and
    fills every region with that step's scalars (lr of the moment, seed + index; NAdam's
    product of momentum factors through that step, which moves on with it)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = getattr(forge.optim, rule)(model, lr=1e-2, seed=11,
                                     params=forge.optim.param_groups_no_decay(model, 0.1))
    for step in range(2):
        lm_loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    launched = []

    def record(self, args):
        launched.append((args.hparams.run_scalars, args.hparams.step))
    monkeypatch.setattr(_lib.Library, "wgrad_step", record)
    monkeypatch.setattr(_lib.Library, "elementwise_step", record)
    monkeypatch.setattr(_lib.Library, "elementwise_step_batch",
                        lambda self, calls: [record(self, args) for args in calls])
    monkeypatch.setattr(forge.optim.capture, "_RunScalars", HostRunScalars)
    norm_before = opt.grad_norm
    opt.begin_graph_capture()
    lm_loss(model, 2).backward()
    opt.step()
    opt.zero_grad()
    cap = opt.end_graph_capture()

    slots = opt.inspect().params
    rs = cap.run_scalars[None]
    assert cap.steps == 1 and len(cap.slots) == len(slots) == len(launched)
    assert sorted(a for a, _ in launched) == \
        [rs.device_address + s.index * _lib.RUN_SCALARS_BYTES for s in sorted(
            slots, key=lambda s: s.index)]
    assert all(step == 3 for _, step in launched)
    assert all(opt.state[s.param]["step"] == 2 for s in slots), "a capture runs no step"
    assert opt.inspect().step == 2 and opt.grad_norm == norm_before
    products = {s.index: opt.state[s.param].get("mu_product") for s in slots}
    # (forge_hparams as the optimizer's updates make them from a group: calls.py's table)
    table = forge.optim.calls.HparamsTable(forge.library(), type(opt), tuple(opt.defaults))
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for i, lr in enumerate([5e-3, 0.0, 2e-2]):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.prepare_graph_replay(cap)
        assert opt.inspect().step == 3 + i
        assert opt.grad_norm == math.sqrt(sum(float(sq) for sq, _ in cap.stats.values()))
        for s in slots:
            assert opt.state[s.param]["step"] == 3 + i
            expected = torch.zeros(_lib.RUN_SCALARS_BYTES, dtype=torch.uint8)
            hp = table.for_call(group_of[id(s.param)], 3 + i, 11 + s.index)
            assert hp.lr == lr
            if rule == "NAdam":
                hp.mu_product = products[s.index] = _fp32(products[s.index] * _fp32(
                    hp.beta1 * (1.0 - 0.5 * (0.96 ** ((3 + i) * hp.momentum_decay)))))
                assert opt.state[s.param]["mu_product"] == hp.mu_product
            forge.library().run_scalars_fill(hp, expected.data_ptr(), _lib.RUN_SCALARS_BYTES)
            region = rs.device[s.index * _lib.RUN_SCALARS_BYTES:][:_lib.RUN_SCALARS_BYTES]
            assert torch.equal(region, expected), f"{s.name}, replay {i}"
    opt.param_groups[1]["betas"] = (0.8, 0.999)
    with pytest.raises(RuntimeError, match="only lr may change"):
        opt.prepare_graph_replay(cap)
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError, match="load_state_dict"):
        opt.prepare_graph_replay(cap)


def test_capturable_points_to_cuda_graph_step():
    with pytest.raises(ValueError, match="CUDAGraphStep"):
        forge.optim.AdamW(TinyTransformer(), capturable=True)


def test_cuda_graph_step_checks_its_arguments():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model)
    with pytest.raises(TypeError, match="fn"):
        forge.graphs.CUDAGraphStep(None, optimizers=[opt])
    with pytest.raises(TypeError, match=r"optimizers\[0\]"):
        forge.graphs.CUDAGraphStep(lambda: None, optimizers=[model])
    with pytest.raises(ValueError, match="warmup"):
        forge.graphs.CUDAGraphStep(lambda: None, optimizers=[opt], warmup=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_cuda_graph_step_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        forge.graphs.CUDAGraphStep(lambda: None)


def test_bench_cuda_graph_flag_checks(capsys):
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cpu", "--cuda-graph"]) == 2
    assert "--cuda-graph" in capsys.readouterr().err
    assert bench.main(["--models", "tiny", "--cuda-graph", "--parity"]) == 2
    assert "--parity" in capsys.readouterr().err
    rows = [dict(model="tiny", seq=32, ckpt=False, mode="torch-hooks", status="unsupported",
                 note="not captured", graph=True),
            dict(model="tiny", seq=32, ckpt=False, mode="forge-bf16", status="ok", step_ms=1.0,
                 peak_gib=0.1, note="", graph=True)]
    text = bench.markdown(dict(date="2026-01-01T00:00:00", gpu="x", torch="t",
                               transformers=None, forge="f", command="c"), rows)
    assert "CUDA graph replay" in text and "| unsupported |" in text


def test_bench_graph_modes_on_cpu_are_unsupported_rows(tmp_path, capsys):
    """The -graph modes (what --suite anchors runs at seq 512) on the CPU: a row saying
    unsupported, not a crash; the eager mode beside them is measured as usual."""
    from forge.tools import bench
    assert set(bench.GRAPH_MODES) <= set(bench.KNOWN_MODES)
    assert all(m.endswith(bench.GRAPH_SUFFIX) for m in bench.GRAPH_MODES)
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--modes", "forge-bf16-lean", "forge-bf16-lean-graph",
                       "--out", str(tmp_path)]) == 0
    json_file = next(f for f in os.listdir(tmp_path) if f.endswith(".json"))
    with open(tmp_path / json_file) as f:
        rows = {r["mode"]: r for r in json.load(f)["results"]}
    assert rows["forge-bf16-lean"]["status"] == "ok" and not rows["forge-bf16-lean"].get("graph")
    graph = rows["forge-bf16-lean-graph"]
    assert graph["status"] == "unsupported" and graph["graph"] is True
    assert "CUDA" in graph["note"]
    md = open(tmp_path / json_file.replace(".json", ".md")).read()
    assert "The -graph modes' timed steps were CUDA graph replays" in md
    assert "Every timed step" not in md
    assert bench.display_mode(graph) == "forge-bf16-lean-graph"
    assert bench.display_mode(dict(mode="forge-bf16", graph=True)) == "forge-bf16+graph"


@requires_cuda
def test_bench_graph_mode_on_cuda(tmp_path):
    """A -graph mode end to end on the GPU: measured, marked, forge.lean included."""
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cuda", "--seqs", "32", "--ckpt", "off",
                       "--modes", "forge-int8-lean-graph", "torch-adamw-graph",
                       "--out", str(tmp_path)]) == 0
    with open(tmp_path / next(f for f in os.listdir(tmp_path) if f.endswith(".json"))) as f:
        rows = json.load(f)["results"]
    assert [r["mode"] for r in rows] == ["forge-int8-lean-graph", "torch-adamw-graph"]
    assert all(r["status"] == "ok" and r["graph"] and r["step_ms"] > 0 for r in rows), rows


# ----------------------------------------------------------------------------- on the GPU

LRS = [1e-2, 1e-2, 5e-3, 2e-2, 0.0, 1e-2]  # per step; a replay must use its own


def loss_fn(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_train_step(model, opt):
    """One training step of `model` with `opt` on a batch (x, y); returns the loss."""
    def train_step(x, y):
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def train_cuda(state_format, graphed, lrs, dtype=torch.bfloat16, rule="AdamW"):
    """(losses, [snapshot after each step]) of len(lrs) steps of a bf16 TinyTransformer."""
    torch.manual_seed(0)
    model = TinyTransformer().to("cuda", dtype)
    opt = getattr(forge.optim, rule)(model, lr=lrs[0], weight_decay=0.1,
                                     state_format=state_format, seed=11,
                                     min_8bit_size=0)  # (int8 on every parameter)

    train_step = make_train_step(model, opt)
    step = forge.graphs.CUDAGraphStep(train_step, optimizers=[opt], warmup=2) if graphed \
        else train_step
    losses, snapshots = [], []
    for i, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(i, "cuda")
        losses.append(step(x, y).detach().clone())
        snapshots.append(snapshot(model, opt))
    return losses, snapshots, opt


def snapshot(model, opt):
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        for key, value in opt.state[p].items():
            out[f"{name}.{key}"] = value.clone() if torch.is_tensor(value) else value
    out["grad_norm"], out["nonfinite_count"] = opt.grad_norm, opt.nonfinite_count
    return out


def assert_same(a, b, step):
    assert a.keys() == b.keys()
    for key in a:
        if key == "grad_norm":  # Σ g² summed by the kernels (atomics): the order may vary
            assert a[key] == pytest.approx(b[key], rel=GRAPH_GRAD_NORM_RTOL), \
                f"step {step}: {key}"
        elif torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), f"step {step}: {key} differs"
        else:
            assert a[key] == b[key], f"step {step}: {key}: {a[key]} != {b[key]}"


@requires_cuda
@pytest.mark.parametrize("rule,state_format", [("AdamW", "bf16"), ("AdamW", "int8"),
                                               ("NAdam", "bf16")])
def test_cuda_graph_step_is_bit_identical_to_eager(rule, state_format, deterministic):
    """6 steps, warmup 2: two eager, the capture (and its replay), three replays; the lr
    changes between steps (a scheduler's job): every replay uses its own step and lr (and
    NAdam's product of momentum factors, which goes on with each replay)."""
    eager_losses, eager, _ = train_cuda(state_format, False, LRS, rule=rule)
    graph_losses, graphed, opt = train_cuda(state_format, True, LRS, rule=rule)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(eager_losses[i], graph_losses[i]), f"step {i}: loss"
        assert_same(a, b, i)
    assert all(opt.state[p]["step"] == len(LRS) for p in opt.state)
    assert opt.inspect().step == len(LRS)


@requires_cuda
def test_cuda_graph_step_refuses_cpu_tensors_and_other_shapes():
    model = TinyTransformer().to("cuda")
    opt = forge.optim.AdamW(model, lr=1e-2)

    train_step = make_train_step(model, opt)
    step = forge.graphs.CUDAGraphStep(train_step, optimizers=[opt], warmup=1)
    x, y = batch(0, "cuda")
    with pytest.raises(ValueError, match="input 0.*cpu"):
        step(x.cpu(), y)
    for i in range(3):  # warm-up, capture, replay
        step(*batch(i, "cuda"))
    with pytest.raises(ValueError, match="input 1"):
        step(x, y[:, :-1])
    with pytest.raises(ValueError, match="3 inputs given"):
        step(x, y, y)
    cpu_model = TinyTransformer()
    with pytest.raises(ValueError, match=r"optimizers\[0\]"):
        forge.graphs.CUDAGraphStep(train_step, optimizers=[forge.optim.AdamW(cpu_model)])


@requires_cuda
def test_cuda_graph_step_needs_capturable_torch_optimizers():
    model = torch.nn.Linear(8, 8).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = forge.graphs.CUDAGraphStep(train_step, optimizers=[opt], warmup=1)
    x = torch.randn(4, 8, device="cuda")
    step(x)
    with pytest.raises(RuntimeError, match="could not be captured") as caught:
        step(x)
    assert "capturable" in str(caught.value.__cause__)


@requires_cuda
def test_cuda_graph_step_refuses_replays_after_load_state_dict():
    model = TinyTransformer().to("cuda")
    opt = forge.optim.AdamW(model, lr=1e-2)

    train_step = make_train_step(model, opt)
    step = forge.graphs.CUDAGraphStep(train_step, optimizers=[opt], warmup=1)
    for i in range(2):
        step(*batch(i, "cuda"))
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError, match="load_state_dict"):
        step(*batch(2, "cuda"))


@requires_cuda
def test_cuda_capture_outside_cuda_graph_step_warns():
    model = TinyTransformer().to("cuda")
    opt = forge.optim.AdamW(model, lr=1e-2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.rebind_streams()
        lm_loss(model, 0, "cuda").backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.current_stream().wait_stream(side)
    x, y = batch(1, "cuda")  # (made outside: a copy from pageable memory cannot be captured)
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="CUDAGraphStep"):
        with torch.cuda.graph(graph, stream=side):
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
