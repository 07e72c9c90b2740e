"""test_prehook.py — the C++ part of fused Linears (forge/_prehook.py: the weights' pre-hook and
the Linear's backward node) against the Python hooks and Function.

Where the extension is built, a fused weight's update inside backward is armed by the Linear's
C++ backward (or by the Python one: the step's first Linear, autocast's casts) and made by its
C++ AccumulateGrad pre-hook; everything they do not take goes to the Python routing. These tests
train the same model each way and require the same bits, in the common case, under autocast,
and in the cases that must fall back: a Linear applied twice, a weight also read outside its
Linear, a backward that never reaches a weight's node, a detached optimizer, a refused call.
FORGE_CPP_PREHOOK=0 (the Python path only) skips them; otherwise a missing extension fails
them.
"""
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import forge._prehook as prehook
import forge.optim

from conftest import DEVICES
from tiny_models import TinyTransformer, lm_loss

STEPS = 4


@pytest.fixture(scope="module")
def cpp():
    if os.environ.get("FORGE_CPP_PREHOOK", "").strip().lower() in ("0", "off", "false", "no"):
        pytest.skip("FORGE_CPP_PREHOOK is off: the Python pre-hook only")
    module = prehook.get()
    assert module is not None, f"the C++ pre-hook was not built: {prehook.failure}"
    return module


def python_only(monkeypatch):
    """Optimizers built inside this context hook their weights with the Python pre-hook."""
    monkeypatch.setattr(prehook, "get", lambda: None)


def build(model, cpp_prehook: bool, monkeypatch, **kwargs):
    if cpp_prehook:
        return forge.optim.AdamW(model, lr=1e-2, weight_decay=0.1, **kwargs)
    with monkeypatch.context() as m:
        python_only(m)
        return forge.optim.AdamW(model, lr=1e-2, weight_decay=0.1, **kwargs)


def assert_same(model_a, model_b, opt_a, opt_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sa.keys() == sb.keys(), name
        for key in sa:
            va, vb = sa[key], sb[key]
            assert (torch.equal(va, vb) if torch.is_tensor(va) else va == vb), (name, key)


def finish_step(models, opts):
    """opt.step() and zero_grad() on each side, then the same bits on both."""
    for opt in opts:
        opt.step()
        opt.zero_grad()
    assert_same(*models, *opts)


def three_linears_both_ways(device, monkeypatch):
    """Three Linears (the middle one without bias) built twice, with the C++ part and with the
    Python one, and a 3-d input (with a bias, the Linear's product comes back as a view)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16, bias=False),
                         nn.Tanh(), nn.Linear(16, 4)).to(device)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [build(models[0], True, monkeypatch), build(models[1], False, monkeypatch)]
    return models, opts, torch.randn(2, 3, 8, device=device)


def calls_made_in_cpp(opt):
    """Fused weights whose update of the last backward the C++ pre-hook made."""
    return [p.name for p in opt.inspect() if p.made_in_cpp]


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_prehook_updates_as_the_python_one(cpp, device, monkeypatch):
    torch.manual_seed(0)
    base = TinyTransformer().to(device)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [build(models[0], True, monkeypatch), build(models[1], False, monkeypatch)]
    fused = [p.name for p in opts[0].inspect() if p.path == "fused"]
    assert all(p.cpp_prehook for p in opts[0].inspect() if p.path == "fused")
    assert not any(p.cpp_prehook for p in opts[1].inspect())
    for step in range(STEPS):
        for model, opt in zip(models, opts):
            lm_loss(model, step, device).backward()
        made = calls_made_in_cpp(opts[0])
        # every fused update from the second step (the first makes the states)
        assert len(made) == (len(fused) if step else 0), (made, fused)
        assert all(isinstance(p.param.grad, forge.optim.ConsumedGrad)
                   for p in opts[0].inspect() if p.name in made)
        finish_step(models, opts)


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_linear_backward_enters_python_once_per_step(cpp, device, monkeypatch):
    """Linears applied to a 3-d input, with and without bias: their backward is the C++ node,
    whose updates from the second step arm without Python but for the step's first (which
    checks the step); the same bits as the Python Function and pre-hook."""
    models, opts, x = three_linears_both_ways(device, monkeypatch)
    entered = []  # (the Python Linear backward of opts[0]'s weights)
    python_backward = forge.optim.backward.Backward.linear_backward
    mine = {id(p) for p in models[0].parameters()}
    monkeypatch.setattr(forge.optim.backward.Backward, "linear_backward",
                        lambda backward, slot, *a: (id(slot.param) in mine
                                                    and entered.append(slot.name))
                        or python_backward(backward, slot, *a))
    for step in range(STEPS):
        entered.clear()
        outs = [model(x) for model in models]
        assert outs[0].grad_fn.name() == "FusedLinearBackward"
        assert outs[1].grad_fn.name() != "FusedLinearBackward"
        for out in outs:
            out.square().mean().backward()
        # (backward meets the last Linear first; the first step makes the states in Python)
        assert entered == (["4.weight"] if step else ["4.weight", "2.weight", "0.weight"])
        assert calls_made_in_cpp(opts[0]) == (["0.weight", "2.weight", "4.weight"] if step else [])
        finish_step(models, opts)


class _ProductShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """The (a, b) shapes of every matrix product (aten.mm, aten.addmm) run inside it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            a, b = args[-2:]
            self.shapes.append((tuple(a.shape), tuple(b.shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_linear_recomputed_under_checkpoint_stops_where_torchs_does(cpp, device,
                                                                        monkeypatch):
    """A non-reentrant checkpoint's recomputation stops at the save that completes what
    backward needs. torch's Linear saves its input before its product, so a recomputed block
    never runs its last Linear's product; the C++ Linear makes its node (and saves) first too,
    with the same bits as the Python Function. (The last Linear maps 24 -> 8 features and no
    other product of backward has its shapes: x needs no gradient.)"""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 24, bias=False), nn.Tanh(), nn.Linear(24, 8))
    base = nn.ModuleDict({"block": block, "head": nn.Linear(8, 3)}).to(device)
    models = [copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)]
    opts = [build(models[0], True, monkeypatch), build(models[1], False, monkeypatch),
            torch.optim.AdamW(models[2].parameters(), lr=1e-2, weight_decay=0.1)]
    x = torch.randn(2, 5, 8, device=device)  # (no dX of the first Linear: its shapes collide)
    last_product = ((10, 24), (24, 8))  # (the rows of x, in) @ (in, out): the block's output
    for step in range(STEPS):
        products = []
        for model in models:
            y = torch.utils.checkpoint.checkpoint(model["block"], x, use_reentrant=False)
            loss = model["head"](y).square().mean()
            with _ProductShapes() as seen:
                loss.backward()
            products.append(seen.shapes.count(last_product))
        # torch's Linear and the C++ one: never; the Python Function saves after its product
        assert products == [0, 1, 0], products
        finish_step(models[:2], opts[:2])
        opts[2].step()
        opts[2].zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_linear_under_autocast_matches_the_python_function(cpp, device, monkeypatch):
    """fp32 weights under bf16 autocast (with and without bias): the C++ Linear casts W and b
    and keeps dX, db and the update's operands in autocast's dtypes as the Function does."""
    models, opts, x = three_linears_both_ways(device, monkeypatch)
    for step in range(STEPS):
        outs = []
        for model in models:
            with torch.autocast(device, dtype=torch.bfloat16):
                outs.append(model(x))
        assert outs[0].grad_fn.name() == "FusedLinearBackward"
        assert outs[0].dtype == outs[1].dtype == torch.bfloat16
        for out in outs:
            out.float().square().mean().backward()
        assert calls_made_in_cpp(opts[0]) == (["0.weight", "2.weight", "4.weight"] if step else [])
        finish_step(models, opts)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_cpp_conv1d_matches_the_python_function(cpp, device, autocast, monkeypatch):
    """transformers' Conv1D (GPT-2's transposed Linear, W: [in, out]) on a 3-d input: the C++
    forward and backward node (addmm over the rows, dX = dY·Wᵀ, the update's pair (dY, X)),
    with and without bf16 autocast, and its bias or none; the same bits as the Python
    Function, and every update from the second step armed and made in C++."""
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    no_bias = Conv1D(16, 16)
    no_bias.bias = None  # (transformers' Conv1D always has one; a subclass may not)
    base = nn.Sequential(Conv1D(16, 8), nn.Tanh(), no_bias, nn.Tanh(), Conv1D(4, 16)).to(device)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [build(models[0], True, monkeypatch), build(models[1], False, monkeypatch)]
    assert all(p.layer == "Conv1D" for p in opts[0].inspect() if p.path == "fused")
    x = torch.randn(2, 3, 8, device=device)
    for step in range(STEPS):
        outs = []
        for model in models:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                outs.append(model(x))
        assert outs[0].grad_fn.name() == "FusedConv1DBackward"
        assert outs[1].grad_fn.name() != "FusedConv1DBackward"
        assert outs[0].dtype == outs[1].dtype
        assert torch.equal(outs[0], outs[1])
        for out in outs:
            out.float().square().mean().backward()
        assert calls_made_in_cpp(opts[0]) == (["0.weight", "2.weight", "4.weight"] if step else [])
        finish_step(models, opts)


class TwiceAndOutside(nn.Module):
    """One Linear applied twice, another whose weight is also read outside it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16, bias=False)
        self.c = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.a(x))))
        h = self.b(h) + 0.1 * F.linear(h, self.b.weight)
        return self.c(h)


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_prehook_falls_back_for_second_and_outside_uses(cpp, device, monkeypatch):
    torch.manual_seed(0)
    base = TwiceAndOutside().to(device)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = [build(models[0], True, monkeypatch), build(models[1], False, monkeypatch)]
        for step in range(STEPS):
            x = torch.randn(5, 16, generator=torch.Generator().manual_seed(step)).to(device)
            for model, opt in zip(models, opts):
                model(x).square().mean().backward()
            made = calls_made_in_cpp(opts[0])  # (a and b fall back to the Python path)
            assert made == (["c.weight"] if step else []), made
            finish_step(models, opts)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 8),
                    reason="Dynamo traces the fused Linear's forward from torch 2.8 "
                           "(test_compile.py)")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("tokens", [3, 200], ids=["keeps", "forms"])
def test_cpp_prehook_makes_a_compiled_backwards_updates(cpp, relu, tokens, device,
                                                        monkeypatch):
    """A compiled backward hands X and dY over in its graph (forge::wgrad_hand_off): its C++
    kernel arms the weight's record but for the step's first hand-off (Python's, which
    checks the step) and a second use, and the C++ pre-hook makes each update but that of a
    Linear applied twice (the graph sums its stand-ins); the same bits as the Python hooks.
    Inductor, the backward with (relu) and without element-wise kernels. With 3 tokens a
    row every hand-off keeps X and dY (the fused call is armed); with 200 each forms dW
    (_linear.hand_off_keeps: X and dY take more bytes), and the element-wise call on it is
    armed, in C++ from the second step (the first forms it in Python, and the next check
    readies the call)."""
    torch.manual_seed(0)
    base = nn.ModuleDict({"a": nn.Linear(32, 64), "b": nn.Linear(64, 64, bias=False),
                          "c": nn.Linear(64, 16)}).to(device)

    def forward(layers, x):
        act = torch.relu if relu else (lambda t: t)
        h = layers["b"](act(layers["a"](x)))
        return layers["c"](act(layers["b"](act(h))))  # (b applied twice)

    models = [copy.deepcopy(base), copy.deepcopy(base)]
    entered = []  # the C++ optimizer's hand-offs that entered Python
    python_hand_off = forge.optim.slot.Slot.hand_off_in_graph
    mine = {id(p) for p in models[0].parameters()}

    def counted(slot, *args):
        if id(slot.param) in mine:
            entered.append(slot.name)
        return python_hand_off(slot, *args)

    monkeypatch.setattr(forge.optim.slot.Slot, "hand_off_in_graph", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (b's materialized path warns)
        opts = [build(models[0], True, monkeypatch), build(models[1], False, monkeypatch)]
        torch._dynamo.reset()
        steps = [torch.compile(lambda x, m=m: forward(m, x)) for m in models]
        for step in range(STEPS):
            entered.clear()
            x = torch.randn(2, tokens, 32,
                            generator=torch.Generator().manual_seed(step)).to(device)
            for run in steps:
                run(x).square().mean().backward()
            # (from the second step: the step's first hand-off, in the graph's order, and b's
            # second; the first step makes the states in Python)
            if step:
                assert len(entered) == 2 and entered.count("b.weight") == 1, entered
            else:
                assert sorted(entered) == ["a.weight", "b.weight", "b.weight", "c.weight"]
            made = calls_made_in_cpp(opts[0])
            assert made == (["a.weight", "c.weight"] if step else []), made
            finish_step(models, opts)


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_prehook_a_backward_that_misses_a_weight_changes_nothing_of_it(cpp, device,
                                                                           monkeypatch):
    """backward(inputs=...) naming one weight: its update runs at its node; the other
    Linears' backwards run (for dX) but arm nothing, so step() finds nothing left over."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 4)).to(device)
    opt = build(model, True, monkeypatch)
    x = torch.randn(3, 8, device=device)
    for _ in range(2):  # (the second step arms: the first makes the states)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = {n: opt.state[p]["step"] for n, p in model.named_parameters()}
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward(inputs=[xg, model[4].weight])
    assert calls_made_in_cpp(opt) == ["4.weight"]
    assert not any(p.waiting for p in opt.inspect())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    opt.zero_grad()
    for n, p in model.named_parameters():
        if n != "4.weight":
            assert torch.equal(p, before[n]), n
            assert opt.state[p]["step"] == steps[n], n
        else:
            assert not torch.equal(p, before[n]), n
            assert opt.state[p]["step"] == steps[n] + 1, n


def two_layers_after_two_steps(monkeypatch):
    """Two Linears with the C++ pre-hook, two steps taken (the second's updates armed), and
    their input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = build(model, True, monkeypatch)
    x = torch.randn(3, 8)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, x


def test_cpp_prehook_detached_optimizer_leaves_plain_gradients(cpp, monkeypatch):
    model, opt, x = two_layers_after_two_steps(monkeypatch)
    opt.detach()
    before = [p.detach().clone() for p in model.parameters()]
    model(x).sum().backward()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)  # nothing updated
        assert p.grad is not None and not isinstance(p.grad, forge.optim.deferred.ConsumedGrad)


def test_cpp_prehook_a_refused_call_raises_and_changes_nothing(cpp, monkeypatch):
    """A call the library refuses inside the C++ pre-hook raises its message out of backward,
    and neither the weights nor their step counts change."""
    model, opt, x = two_layers_after_two_steps(monkeypatch)
    assert_refused_changes_nothing(model, opt, x, "wgrad", monkeypatch)


def assert_refused_changes_nothing(model, opt, x, kind: str, monkeypatch):
    """A backward of model(x) whose kept calls of `kind` ("wgrad", "elementwise") carry a
    bad ABI version raises the library's message, and no weight or step count changes. (The
    version is set once, when the args are made: the step's check, in Python or repeated by
    the C++ part, writes everything else of them.)"""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = {n: opt.state[p]["step"] for n, p in model.named_parameters()}
    for slot in opt._shared.slots.values():
        if kind in slot.kept_args:
            slot.kept_args[kind][0].abi_version = 0
    with pytest.raises(Exception, match=f"forge_{kind}_step: args.abi_version: 0"):
        model(x).sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert opt.state[p]["step"] == steps[n], n


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 8),
                    reason="Dynamo traces the fused Linear's forward from torch 2.8 "
                           "(test_compile.py)")
def test_cpp_prehook_a_refused_element_wise_call_raises_and_changes_nothing(cpp, monkeypatch):
    """The same for the element-wise call a compiled backward's hand-off armed on the dW it
    formed (200 tokens: X and dY take more bytes than dW)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = build(model, True, monkeypatch)
    x = torch.randn(200, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for step in range(3):
        compiled(x).sum().backward()
        # (from the second step both element-wise calls are made in C++)
        assert sorted(calls_made_in_cpp(opt)) == (["0.weight", "2.weight"] if step else [])
        opt.step()
        opt.zero_grad()
    assert_refused_changes_nothing(compiled, opt, x, "elementwise", monkeypatch)


_REFUSED_THEN_EXIT = """
import torch, torch.nn as nn
import forge.optim
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
opt = forge.optim.AdamW(model, lr=1e-2, mode="immediate")
x = torch.randn(3, 8)
for _ in range(2):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
for slot in opt._shared.slots.values():
    if "wgrad" in slot.kept_args:
        slot.kept_args["wgrad"][0].abi_version = 0
try:
    model(x).sum().backward()
except Exception as e:
    assert "abi_version" in str(e), e
    print("refused")
"""


def test_cpp_prehook_a_process_exits_after_a_refused_call(cpp):
    """After a call refused inside the C++ pre-hook, the process still exits: torch 2.4 keeps
    the failed backward's nodes queued until the thread's exit, after the interpreter's, and
    their records then must not wait for the GIL."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _REFUSED_THEN_EXIT], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, FORGE_CPP_PREHOOK="1"))
    assert done.returncode == 0 and "refused" in done.stdout, done.stderr[-2000:]


# ---------------------------------------------------------------------- the check, repeated

def count_rechecks(monkeypatch) -> list:
    """[runs that readied the weights in C++, runs that found something changed] of every
    optimizer's repetition of the step's check (forge/optim/recheck.py), from now on."""
    counts = [0, 0]
    run = forge.optim.recheck.Recheck.run

    def counted(recheck, *args):
        passed = run(recheck, *args)
        counts[0 if passed else 1] += 1
        return passed
    monkeypatch.setattr(forge.optim.recheck.Recheck, "run", counted)
    return counts


@pytest.mark.parametrize("device", DEVICES)
def test_the_check_repeated_in_cpp_readies_the_calls_the_loop_would(cpp, device, monkeypatch):
    """From the third step (the first makes the states, the second's check registers the
    fused weights), the C++ part repeats the step's check of the fused weights; with a new
    lr every step (a scheduler), clipping's lagged gradient scale, stochastic rounding's
    seeds and the statistics, the same bits as the Python hooks and loop."""
    counts = count_rechecks(monkeypatch)
    torch.manual_seed(0)
    base = TinyTransformer().to(device, torch.bfloat16)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [build(m, cpp_prehook, monkeypatch, mode="immediate", max_grad_norm=0.5,
                  state_format="bf16", seed=3)
            for m, cpp_prehook in zip(models, (True, False))]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
                  for opt in opts]
    for step in range(6):
        for model, opt in zip(models, opts):
            lm_loss(model, step, device).backward()
        finish_step(models, opts)
        for scheduler in schedulers:
            scheduler.step()
        assert opts[0].grad_norm == opts[1].grad_norm
        assert opts[0].nonfinite_count == opts[1].nonfinite_count
    assert counts == [4, 0], counts


def steps_both_ways(device, monkeypatch, steps: int = 3):
    """TinyTransformer with the C++ part and with the Python one after `steps` steps (the
    C++ part's repetition of the check registered)."""
    torch.manual_seed(0)
    base = TinyTransformer().to(device)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [build(m, cpp_prehook, monkeypatch, mode="immediate")
            for m, cpp_prehook in zip(models, (True, False))]
    for step in range(steps):
        for model, opt in zip(models, opts):
            lm_loss(model, step, device).backward()
        finish_step(models, opts)
    return models, opts


def _step_set_to(value):
    def edit(model, opt):
        opt.state[model.blocks[1].up.weight]["step"] = value
    return edit


def _weight_made_strided(model, opt):
    w = model.blocks[0].attn.k.weight
    w.data = w.data.t().contiguous().t()  # (the same values, column-major)


def _negative_lr(model, opt):
    opt.param_groups[0]["lr"] = -1.0


def _other_state_format(model, opt):
    opt.param_groups[0]["state_format"] = "int8"


@pytest.mark.parametrize("edit, error", [
    (_step_set_to(-1), "state 'step' must be an int >= 0"),
    (_step_set_to(2.0), "state 'step' must be an int >= 0"),
    (_step_set_to(True), "state 'step' must be an int >= 0"),
    (_weight_made_strided, "changed dtype, device or layout"),
    (_negative_lr, "lr"),
    (_other_state_format, "state_format='int8'"),
], ids=["negative-step", "float-step", "bool-step", "weight-layout", "negative-lr",
        "state-format"])
def test_the_check_repeated_in_cpp_refuses_what_the_loop_refuses(cpp, edit, error,
                                                                 monkeypatch):
    """A change between steps that the step's check refuses is refused with the C++ part's
    repetition of it registered, with the Python loop's message, and nothing is updated."""
    models, opts = steps_both_ways("cpu", monkeypatch)
    messages = []
    for model, opt in zip(models, opts):
        edit(model, opt)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(Exception, match=error) as refused:
            lm_loss(model, 3).backward()
        messages.append(str(refused.value))
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
    assert messages[0] == messages[1]


def _replace_a_state(model, opt):
    st = opt.state[model.blocks[0].up.weight]
    st["exp_avg"] = st["exp_avg"].clone()


def _swap_a_states_data(model, opt):
    st = opt.state[model.blocks[0].up.weight]
    st["exp_avg_sq"].data = st["exp_avg_sq"].data.clone()


def _swap_a_weights_data(model, opt):
    w = model.blocks[1].attn.v.weight
    w.data = w.data.clone()


def _hook_a_weight(model, opt):
    model.blocks[0].down.weight.register_hook(lambda g: g * 0.5)


def _load_the_state(model, opt):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _add_a_group(model, opt):
    extra = nn.Linear(4, 4, bias=False)
    model.extra = extra  # (in the model: the optimizer routes a group's new Linear)
    opt.add_param_group({"params": [extra.weight], "lr": 0.5})


@pytest.mark.parametrize("edit, found", [
    (_replace_a_state, True), (_swap_a_states_data, True), (_swap_a_weights_data, True),
    (_hook_a_weight, True), (_load_the_state, True), (_step_set_to(7), False)],
    ids=["replaced-state", "state-data", "weight-data", "tensor-hook", "load-state-dict",
         "step-count"])
def test_the_check_repeated_in_cpp_follows_what_changed(cpp, edit, found, monkeypatch):
    """Between steps, a state tensor replaced, a tensor's data swapped, a tensor hook or a
    loaded state dict: the C++ part's repetition finds it changed, the loop checks the step,
    and training goes on with the Python path's bits (the C++ part then repeats the new
    check). A step count set by hand is read anew at every step: nothing to find."""
    models, opts = steps_both_ways("cpu", monkeypatch)
    counts = count_rechecks(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a hooked weight's materialized path warns)
        for model, opt in zip(models, opts):
            edit(model, opt)
        for step in range(3, 6):
            for model, opt in zip(models, opts):
                lm_loss(model, step).backward()
            finish_step(models, opts)
    assert counts == ([2, 1] if found else [3, 0]), counts


def count_python_settles(monkeypatch) -> list:
    """[weights Python's settle_armed met] of every optimizer, from now on."""
    counts = [0]
    settle_armed = forge.optim.backward.Backward.settle_armed

    def counted(backward, slot):
        counts[0] += 1
        return settle_armed(backward, slot)
    monkeypatch.setattr(forge.optim.backward.Backward, "settle_armed", counted)
    return counts


def test_the_calls_made_in_cpp_are_committed_there(cpp, monkeypatch):
    """Once the C++ part repeats the step's check, it also commits the calls its pre-hook
    made (Python's settle_armed meets none of them), with the Python path's step counts and
    bits; a weight whose state dict was replaced after the backward is left to Python."""
    models, opts = steps_both_ways("cpu", monkeypatch)
    settles = count_python_settles(monkeypatch)
    for step in range(3, 6):
        settles[0] = 0
        for model, opt in zip(models, opts):
            lm_loss(model, step).backward()
        made = calls_made_in_cpp(opts[0])
        finish_step(models, opts)
        assert settles[0] == 0 and made
    settles[0] = 0
    for model, opt in zip(models, opts):
        lm_loss(model, 6).backward()
        weight = model.blocks[1].up.weight
        opt.state[weight] = dict(opt.state[weight])  # (the same values in another dict)
    finish_step(models, opts)
    assert settles[0] == 1
    assert opts[0].state[models[0].blocks[1].up.weight]["step"] == 7


def test_the_check_repeated_in_cpp_is_not_made_for_nadam(cpp, monkeypatch):
    """NAdam's calls carry its running product, which Python computes per call: its step is
    checked by the loop every time."""
    counts = count_rechecks(monkeypatch)
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = forge.optim.NAdam(model, lr=1e-2, mode="immediate")
    for step in range(4):
        lm_loss(model, step).backward()
        made = calls_made_in_cpp(opt)
        opt.step()
        opt.zero_grad()
    assert counts == [0, 0] and made, counts
