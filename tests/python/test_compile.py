"""test_compile.py — torch.compile over a model that forge.optim drives.

A fused Linear's backward goes into the compiled graph (its hand-off through the custom
operator forge::wgrad_hand_off, forge/_ops.py): no graph break per Linear, and over several
steps the weights and optimizer states are bit-identical to the eager FORGE run, in every mode,
under bf16 autocast, with and without biases, for a Linear applied twice (materialized, with
its warning), with a weight also read outside its Linear and with frozen weights. A hand-off
whose X and dY would take more bytes than dW forms dW at once (the compiled backward's
hand-offs all run before any update): the eager reference makes the same choice per weight
(_eager_as_the_graph), so the comparison stays one of bits.
Inductor runs the cases where its buffer reuse could reach what the hand-off keeps, on Linears
alone: every other operation would be one of Inductor's C++ kernels, seconds of compiling each
on the CPU, and may round otherwise than eager (the comparison is of FORGE's part). The
other cases run the same graphs through backend="aot_eager" (AOTAutograd's graphs, op by op).
"""
import gc
import warnings

import pytest
import torch
import torch.nn as nn

import forge
import forge.optim
from forge import _linear
from conftest import DEVICES

# Dynamo traces the fused Linear's forward (its slot lookup) from torch 2.8; before, each
# fused Linear is a graph break and runs eagerly (forge/_ops.py, docs/design.md).
pytestmark = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 8),
    reason=f"torch {torch.__version__}: Dynamo cannot trace the fused Linear's forward "
           "(each fused Linear is a graph break, results unchanged)")

STEPS = 3


class MLP(nn.Module):
    """Four Linears, with and without bias, and ReLUs after the first two (relu=True). Without
    them Inductor's backward is extern calls only, and reuses the storage of dY of `c`
    (dX of `d`) for dX of `b` unless the hand-off's inputs are kept out of reuse. With a
    batch's 15 tokens, `b` and `c` keep their X and dY, `a` and `d` form dW (hand_off_keeps)."""

    def __init__(self, relu=True, frozen=False):
        super().__init__()
        torch.manual_seed(0)
        self.relu = relu
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64, bias=False)
        self.c = nn.Linear(64, 64)
        self.d = nn.Linear(64, 8, bias=False)
        if frozen:
            self.a.weight.requires_grad_(False)
            self.c.weight.requires_grad_(False)

    def forward(self, x):
        h = self.a(x)
        h = self.b(torch.relu(h) if self.relu else h)
        return self.d(self.c(torch.relu(h) if self.relu else h))


class Twice(nn.Module):
    """`shared` applied twice per forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 24)
        self.shared = nn.Linear(24, 24)
        self.out = nn.Linear(24, 8)

    def forward(self, x):
        h = torch.relu(self.shared(torch.relu(self.inp(x))))
        return self.out(torch.relu(self.shared(h)))


def _batch(step, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    x, target = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 8, generator=g)
    return x.to(device), target.to(device)


def _run(model, opt, steps=STEPS, autocast=False, clip=None, device="cpu"):
    """`steps` training steps; returns the weights and optimizer states after them."""
    for step in range(steps):
        x, target = _batch(step, device)
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            loss = (model(x).float() * target).sum()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for p in model.parameters()])


def _assert_same_bits(eager, compiled):
    (w_e, s_e), (w_c, s_c) = eager, compiled
    for i, (a, b) in enumerate(zip(w_e, w_c)):
        assert torch.equal(a, b), f"parameter {i} differs from the eager run"
    for i, (a, b) in enumerate(zip(s_e, s_c)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"state {k} of parameter {i} differs"


def _eager_as_the_graph(monkeypatch) -> None:
    """Optimizers built and run inside this context take the Python Linear backward (the C++
    one arms its record without asking), whose every use of a fused weight keeps X and dY or
    forms dW as a compiled hand-off decides (_linear.hand_off_keeps): the eager run a compiled
    one must equal bit for bit."""
    original = forge.optim.backward.Backward.linear_backward

    def as_the_graph(backward, slot, x, dy, weight, keep_operands=True):
        keep = _linear.hand_off_keeps(x, dy, slot.local())
        return original(backward, slot, x, dy, weight, keep_operands=keep)
    monkeypatch.setattr(forge.optim.backward.Backward, "linear_backward", as_the_graph)
    monkeypatch.setattr(forge._prehook, "get", lambda: None)


def _eager_and_compiled(make_model, make_opt, backend, fullgraph=False, device="cpu", **run):
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        _eager_as_the_graph(patch)
        model = make_model().to(device)
        eager = _run(model, make_opt(model), device=device, **run)
    model = make_model().to(device)
    opt = make_opt(model)
    compiled = _run(torch.compile(model, backend=backend, fullgraph=fullgraph), opt,
                    device=device, **run)
    return eager, compiled


def test_no_graph_break_per_linear():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    plain = torch._dynamo.explain(model)(torch.randn(8, 64))
    opt = forge.optim.AdamW(model, lr=1e-3, mode="immediate")
    assert sum(p.path == "fused" for p in opt.inspect()) == 4
    torch._dynamo.reset()
    fused = torch._dynamo.explain(model)(torch.randn(8, 64))
    assert (plain.graph_count, plain.graph_break_count) == (1, 0)
    assert (fused.graph_count, fused.graph_break_count) == (1, 0), fused.break_reasons


def test_tiny_llama_has_no_graph_break():
    """A Hugging Face LlamaForCausalLM (one layer; without FORGE it is one graph too)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    opt = forge.optim.AdamW(model, lr=1e-3, mode="immediate")
    assert sum(p.path == "fused" for p in opt.inspect()) == 8  # 7 + the head
    tokens = torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    fused = torch._dynamo.explain(model)(input_ids=tokens, labels=tokens)
    assert (fused.graph_count, fused.graph_break_count) == (1, 0), fused.break_reasons


def test_conv1d_no_graph_break_and_bits():
    """transformers' Conv1D (GPT-2's transposed Linear) takes the same compiled path."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = Conv1D(24, 16)  # (out, in)
            self.b = Conv1D(8, 24)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model = Convs()
    opt = forge.optim.AdamW(model, lr=1e-2)
    assert sum(p.layer == "Conv1D" for p in opt.inspect()) == 2
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(_batch(0)[0])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    opt.detach()
    eager, compiled = _eager_and_compiled(
        Convs, lambda m: forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1), "aot_eager")
    _assert_same_bits(eager, compiled)


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_fullgraph_adamw_immediate_bits(device):
    """Inductor, fullgraph=True: the hand-off's X and dY are kept out of Inductor's buffer
    reuse (without that the saved activations are overwritten before the step reads them)."""
    eager, compiled = _eager_and_compiled(
        lambda: MLP(relu=False),
        lambda m: forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1, mode="immediate",
                                    state_format="fp32"),
        "inductor", fullgraph=True, device=device)
    _assert_same_bits(eager, compiled)


def test_a_hand_off_keeps_x_and_dy_only_where_they_are_smaller_than_dw():
    """A compiled backward's hand-offs all run before any update: where a weight's X and dY
    take more bytes than dW, its hand-off forms dW in W's dtype and keeps neither (a and d of
    the MLP), else it keeps them for the fused step (b and c): deferred mode shows which."""
    torch._dynamo.reset()
    model = MLP(relu=False)
    opt = forge.optim.AdamW(model, lr=1e-2, mode="deferred")
    x, target = _batch(0)
    (torch.compile(model, backend="aot_eager")(x) * target).sum().backward()
    for name in ("a", "d"):
        g = getattr(model, name).weight.grad
        assert isinstance(g, forge.optim.FactoredGrad) and not g.parts, name
        assert g.dense is not None and g.dense.dtype == torch.float32, name  # (W's dtype)
    for name in ("b", "c"):
        g = getattr(model, name).weight.grad
        assert isinstance(g, forge.optim.FactoredGrad) and len(g.parts) == 1, name
        assert g.dense is None, name
    opt.step()


def test_inductor_deferred_sgd_with_clipping_bits():
    """Deferred mode: the compiled backward leaves FactoredGrads of the graph's X and dY,
    clip_grad_norm_ takes their exact norm, step() runs the fused update."""
    eager, compiled = _eager_and_compiled(
        lambda: MLP(relu=False), lambda m: forge.optim.SGD(m, lr=1e-2, momentum=0.9,
                                                          mode="deferred"),
        "inductor", clip=0.5)
    _assert_same_bits(eager, compiled)


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_bf16_autocast_bits(device):
    eager, compiled = _eager_and_compiled(
        lambda: MLP(relu=False), lambda m: forge.optim.AdamW(m, lr=1e-2, mode="auto"),
        "inductor", autocast=True, device=device)
    _assert_same_bits(eager, compiled)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["auto", "immediate", "deferred"])
def test_modes_bits(mode, device):
    eager, compiled = _eager_and_compiled(
        MLP, lambda m: forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1, mode=mode), "aot_eager",
        device=device)
    _assert_same_bits(eager, compiled)


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_muon_bits(mode):
    """Muon's direction is made by the same libforge call from a compiled backward's hand-off
    as from the eager one, and orthogonalized alike: the same bits."""
    eager, compiled = _eager_and_compiled(
        MLP, lambda m: forge.optim.Muon(m, lr=2e-2, mode=mode), "aot_eager")
    _assert_same_bits(eager, compiled)


def test_frozen_weights_bits():
    """Frozen weights are not fused (their Linears are torch's own in the graph); their
    biases take the element-wise path."""
    eager, compiled = _eager_and_compiled(
        lambda: MLP(frozen=True), lambda m: forge.optim.AdamW(m, lr=1e-2), "aot_eager")
    _assert_same_bits(eager, compiled)
    model = MLP(frozen=True)
    forge.optim.AdamW(model, lr=1e-2)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(_batch(0)[0]).graph_break_count == 0


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_linear_applied_twice_takes_the_materialized_path(mode):
    """In the graph W's gradient is the sum of its two stand-ins: the pre-hook takes it for no
    outside use, warns as in eager and updates once from the fp32 sum of both uses."""
    def make_opt(m):
        return forge.optim.AdamW(m, lr=1e-2, mode=mode)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager, compiled = _eager_and_compiled(Twice, make_opt, "aot_eager")
    _assert_same_bits(eager, compiled)
    multi = [w for w in caught if "had 2 uses in one backward" in str(w.message)]
    assert len(multi) == 2, "one warning from the eager run, one from the compiled run"


def test_outside_use_in_the_graph_takes_the_materialized_path():
    """A weight also read outside its Linear: its gradient arrives as stand-in + the outside
    gradient, as in eager."""
    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(16, 16)
            self.out = nn.Linear(16, 8)

        def forward(self, x):
            return self.out(torch.relu(self.lin(x)) + x @ self.lin.weight)

    with pytest.warns(UserWarning, match="had 2 uses"):
        eager, compiled = _eager_and_compiled(
            Outside, lambda m: forge.optim.SGD(m, lr=1e-2), "aot_eager")
    _assert_same_bits(eager, compiled)


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_autograd_grad_of_an_input_hands_nothing_over(mode):
    """torch.autograd.grad of the input through the compiled backward (an adversarial
    example) reaches the hand-offs but not the weights' gradient nodes: nothing is handed over,
    and the steps on the perturbed inputs have the eager run's bits."""
    def run(model, opt):
        for step in range(STEPS):
            x, target = _batch(step)
            x.requires_grad_(True)
            (gx,) = torch.autograd.grad((model(x) * target).sum(), x)
            assert not any(p.waiting or p.made_in_cpp for p in opt.inspect())
            ((model((x + 0.1 * gx.sign()).detach()) * target).sum()).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        _eager_as_the_graph(patch)
        model = MLP()
        eager = run(model, forge.optim.AdamW(model, lr=1e-2, mode=mode))
    model = MLP()
    opt = forge.optim.AdamW(model, lr=1e-2, mode=mode)
    compiled = run(torch.compile(model, backend="aot_eager"), opt)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert torch.equal(a, b), f"parameter {i} differs from the eager run"


def test_autograd_grad_of_a_weight_through_the_graph_is_refused():
    """The compiled hand-off returns a stand-in, not a gradient: torch.autograd.grad naming a
    fused weight is refused, naming it, before anything changes; eager returns it."""
    model = MLP()
    opt = forge.optim.AdamW(model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    x, target = _batch(0)
    with pytest.raises(RuntimeError, match="gradient of the fused weight 'd.weight'"):
        torch.autograd.grad((compiled(x) * target).sum(), [model.d.weight])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    (g,) = torch.autograd.grad((model(x) * target).sum(), [model.d.weight])
    assert g.shape == model.d.weight.shape and bool(g.any())


def test_a_tensor_hook_on_a_fused_weight_is_refused_in_the_graph():
    """A hook on W needs W's whole gradient; the compiled hand-off makes none: refused by name,
    nothing updated."""
    model = MLP()
    opt = forge.optim.AdamW(model, lr=1e-2, mode="immediate")
    model.d.weight.register_hook(lambda g: g * 0.5)
    before = [p.detach().clone() for p in model.parameters()]
    torch._dynamo.reset()
    x, target = _batch(0)
    with pytest.raises(RuntimeError, match="'d.weight' has a tensor hook"):
        (torch.compile(model, backend="aot_eager")(x) * target).sum().backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_detach_and_a_new_optimizer_recompile():
    """After detach() the compiled model is a plain one (W gets its .grad); a new optimizer
    fuses again, with the eager run's bits."""
    torch._dynamo.reset()
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    opt = forge.optim.SGD(model, lr=1e-2)
    x, target = _batch(0)
    (compiled(x) * target).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.detach()
    (compiled(x) * target).sum().backward()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    (reference(x) * target).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    del opt
    gc.collect()
    for p in model.parameters():
        p.grad = None
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.MonkeyPatch.context() as patch:
        _eager_as_the_graph(patch)
        eager_model = MLP()
        eager_model.load_state_dict(start)
        eager = _run(eager_model, forge.optim.SGD(eager_model, lr=1e-2))
    again = _run(compiled, forge.optim.SGD(model, lr=1e-2))
    _assert_same_bits(eager, again)


def test_detached_between_forward_and_backward_is_an_error():
    torch._dynamo.reset()
    model = MLP()
    opt = forge.optim.SGD(model, lr=1e-2)
    x, target = _batch(0)
    loss = (torch.compile(model, backend="aot_eager")(x) * target).sum()
    opt.detach()
    with pytest.raises(RuntimeError, match="detached between a compiled forward"):
        loss.backward()


def test_a_compiled_backward_whose_optimizer_is_gone_is_an_error():
    """A compiled graph holds its fused Linears' keys (forge::wgrad_hand_off finds the slot by
    its key): they go with their optimizer, so a backward run after it was dropped updates
    nothing and says why; a new optimizer over the model takes keys of its own (test_slot.py:
    never one given before)."""
    torch._dynamo.reset()
    model = MLP()
    opt = forge.optim.SGD(model, lr=1e-2)
    x, target = _batch(0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = (torch.compile(model, backend="aot_eager")(x) * target).sum()
    del opt
    gc.collect()
    with pytest.raises(RuntimeError, match="optimizer is gone"):
        loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt = forge.optim.SGD(model, lr=1e-2)
    assert sum(p.path == "fused" for p in opt.inspect()) == 4
