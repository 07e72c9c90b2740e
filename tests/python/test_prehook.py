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
    """A backward of model(x) whose readied calls of `kind` ("wgrad", "elementwise") carry a
    bad ABI version raises the library's message, and no weight or step count changes."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = {n: opt.state[p]["step"] for n, p in model.named_parameters()}
    ready_wgrad = forge.optim.updater.Updater.ready_wgrad

    def ready_but_wrong_version(updater, slot, *args):
        ready = ready_wgrad(updater, slot, *args)  # the calls as readied, a bad ABI version
        slot.kept_args[kind][0].abi_version = 0
        return ready
    monkeypatch.setattr(forge.optim.updater.Updater, "ready_wgrad", ready_but_wrong_version)
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
Updater = forge.optim.updater.Updater
ready_wgrad = Updater.ready_wgrad
def wrong_version(updater, slot, *args):
    ready = ready_wgrad(updater, slot, *args)
    ready[2].abi_version = 0
    return ready
Updater.ready_wgrad = wrong_version
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
