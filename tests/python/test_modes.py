"""test_modes.py — how a step is delimited.

In immediate mode the update runs inside backward, so a second backward before step() is an
error, raised before it changes a weight; accumulate_grad=True (deferred, dense gradients in
.grad, step() applies them: exact, with torch.optim's memory) accumulates. The training loop
around the step (clipping, GradScaler, deferred factored gradients): test_loop.py. Also:
backwards that do not accumulate into a fused weight (torch.autograd.grad of an input or of
the weights, backward(inputs=...)), tensor hooks on fused weights, the fallback for torch
without the autograd hooks, closures, and giving the model back (detach, or the optimizer
being garbage-collected).
"""
import copy
import gc
import warnings

import pytest
import torch

import forge
import forge._prehook
import forge.optim
from forge import _lib
from conftest import DEVICES, format_devices, requires_cuda
from reference import assert_contract, normwise, nothing_held_after_step, trajectories
from tiny_models import Routed, TinyTransformer, lm_loss, routed_loss


def _initial_weights():
    """One TinyTransformer's weights (seed 0), for runs that must start from the same model."""
    torch.manual_seed(0)
    return TinyTransformer().state_dict()


def _tiny_from(initial, device="cpu"):
    model = TinyTransformer()
    model.load_state_dict(initial)
    return model.to(device)


def test_second_backward_without_step_raises_before_a_weight_changes():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, mode="immediate")
    lm_loss(model, 0).backward()
    after_first = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="second gradient before opt.step"):
        lm_loss(model, 1).backward()
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters()))
    opt.step()
    opt.zero_grad()
    lm_loss(model, 2).backward()  # fine again after step()
    opt.step()


@pytest.mark.parametrize("device", DEVICES)
def test_accumulation_mode_matches_torch(device, record_difference):
    """Two micro-batches per step with accumulate_grad=True: torch.optim's trajectory (the
    gradients are torch's own, so forge sums dW like stock torch here)."""
    errors = trajectories(TinyTransformer, "AdamW", dict(lr=1e-2, weight_decay=0.1), device,
                          steps=4, micro_batches=2, forge_options=dict(accumulate_grad=True))
    record_difference("AdamW accumulate_grad", errors["forge_vs_stock"])
    assert_contract(errors, device, forge_sums_like="stock")


def test_accumulation_materializes_gradients():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, accumulate_grad=True)
    lm_loss(model, 0).backward()
    lm_loss(model, 1).backward()
    assert model.blocks[0].up.weight.grad is not None, "the documented memory cost"
    opt.step()
    assert nothing_held_after_step(model, opt), "step() frees what it applied"


def test_accumulate_grad_switches_between_steps_only():
    model = TinyTransformer()
    opt = forge.optim.SGD(model, lr=0.1)
    lm_loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="between steps"):
        opt.accumulate_grad = True
    opt.step()
    opt.zero_grad()
    opt.accumulate_grad = True
    lm_loss(model, 1).backward()
    lm_loss(model, 2).backward()
    opt.step()


def test_fallback_without_autograd_hooks(monkeypatch, record_difference):
    """torch without post-accumulate-grad hooks / node pre-hooks: every parameter is
    stepped from its .grad in step(); same contract."""
    monkeypatch.setattr(forge.optim.routing, "_FORCE_NO_HOOKS", True)
    errors = trajectories(TinyTransformer, "AdamW", dict(lr=1e-2, weight_decay=0.1), "cpu",
                          steps=5)
    record_difference("AdamW without hooks (fallback)", errors["forge_vs_stock"])
    assert_contract(errors, "cpu", forge_sums_like="stock")


def test_closure():
    model = TinyTransformer()
    opt = forge.optim.SGD(model, lr=0.1)
    before = model.head.weight.detach().clone()

    def closure():
        opt.zero_grad()
        loss = lm_loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss)
    assert not torch.equal(before, model.head.weight)


def test_detach_gives_the_model_back():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model)
    assert "forward" in model.head.__dict__
    opt.detach()
    assert "forward" not in model.head.__dict__
    lm_loss(model, 0).backward()
    assert model.head.weight.grad is not None, "plain autograd again"
    forge.optim.AdamW(model)  # and another optimizer may take it


def test_garbage_collected_optimizer_releases_the_model():
    model = TinyTransformer()
    forge.optim.AdamW(model)
    gc.collect()
    lm_loss(model, 0).backward()
    assert model.head.weight.grad is not None
    model.zero_grad()
    opt = forge.optim.AdamW(model, mode="immediate")
    lm_loss(model, 1).backward()
    assert isinstance(model.head.weight.grad, forge.optim.ConsumedGrad)  # no gradient memory
    opt.step()


@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
def test_a_model_saved_whole_loads_as_the_plain_model(mode, tmp_path):
    """torch.save(model) while an optimizer fuses its Linears: the file holds no reference to
    forge (a patched forward pickles as the class's own), loads as the plain model, and a new
    forge optimizer on the loaded model fuses its Linears and follows torch.optim."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, mode=mode)
    for step in range(2):
        lm_loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    assert b"forge" not in path.read_bytes()
    loaded = torch.load(path, weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))
    lm_loss(loaded, 2).backward()
    assert loaded.head.weight.grad is not None, "plain autograd"
    errors = trajectories(lambda: torch.load(path, weights_only=False), "AdamW",
                          dict(lr=1e-2), "cpu", steps=3, forge_options=dict(mode=mode))
    assert_contract(errors, "cpu")
    lm_loss(model, 2).backward()  # and the saved model trains on with its optimizer
    opt.step()


def test_no_grad_and_eval_forward_do_not_update():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model(torch.zeros(2, 4, dtype=torch.long))
    model(torch.zeros(2, 4, dtype=torch.long))  # graph built, never backwarded
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
def test_backward_that_skips_a_weight_leaves_it_untouched(mode):
    """torch.autograd.grad(loss, x) runs the Linear backwards but not the weights' gradient
    nodes: like torch.optim (no .grad), step() updates nothing, and nothing is left over."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = forge.optim.SGD(model, lr=0.1, mode=mode)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).sum(), x)
    assert not any(p.waiting or p.made_in_cpp for p in opt.inspect())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


# Backwards that do not accumulate into a fused weight's .grad. torch.autograd.grad of an
# input (an adversarial example, a gradient penalty) runs the Linears' backwards but not the
# weights' gradient nodes; backward(inputs=...) without a weight likewise; torch.autograd.grad
# naming a weight returns its gradient and leaves .grad alone. None of them may leave anything
# for the next backward's update, and the last must return torch's gradient.

def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _inputs(step, device):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step)).to(
        device).requires_grad_()


def _mlp_error(mode, loop, device, make_forge=None):
    """(forge vs torch.optim AdamW on an _mlp on `device` through `loop`, the bound)."""
    from reference import stock_loop_error
    return stock_loop_error(
        make_forge or (lambda m: forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1, mode=mode)),
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), loop,
        steps_device=device, make_model=lambda: _mlp().to(device))


def _adversarial(model, opt, device):
    """FGSM: the input's gradient by torch.autograd.grad, then a step on the perturbed input."""
    for step in range(6):
        x = _inputs(step, device)
        (gx,) = torch.autograd.grad(model(x).square().mean(), x)
        model((x + 0.1 * gx.sign()).detach()).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _penalty(model, opt, device):
    """WGAN-GP style: the input's gradient with create_graph=True, its norm in the loss (the
    penalty reaches the weights through the backward's own products)."""
    for step in range(6):
        x = _inputs(step, device)
        out = model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.square().mean() + 10 * (gx.norm(dim=1) - 1).square().mean()).backward()
        opt.step()
        opt.zero_grad()


def _input_only_backward(model, opt, device):
    """backward(inputs=[x]) first (x.grad only), then the loss's backward."""
    for step in range(6):
        x = _inputs(step, device)
        out = model(x)
        out.abs().mean().backward(inputs=[x], retain_graph=True)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()


def _clean_then_adversarial(model, opt, device):
    """FGSM written with backward(): the clean pass's weight gradients are zeroed before the
    adversarial pass, so the step must not see them."""
    for step in range(6):
        x = _inputs(step, device)
        model(x).square().mean().backward()
        x_adv = (x + 0.1 * x.grad.sign()).detach()
        opt.zero_grad()
        model(x_adv).square().mean().backward()
        opt.step()
        opt.zero_grad()


_NON_ACCUMULATING = {"adversarial": _adversarial, "penalty": _penalty,
                     "input_only_backward": _input_only_backward}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
@pytest.mark.parametrize("loop", sorted(_NON_ACCUMULATING))
def test_backward_not_reaching_the_weights_leaves_nothing_for_the_next(mode, loop, device):
    """A backward that does not accumulate into the fused weights' .grad hands nothing over
    (a hand-off would wait in the slot and join the next backward's update): the step is
    torch's, in every mode."""
    error, bound = _mlp_error(mode, _NON_ACCUMULATING[loop], device)
    assert error <= bound, (error, bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
def test_a_second_order_loop_matches_torch(mode, device):
    """MAML: the weights' gradients by torch.autograd.grad with create_graph=True, a step of
    them taken functionally, and the outer loss's backward through both, into the weights."""
    from torch.func import functional_call

    def loop(model, opt, device):
        names = [n for n, _ in model.named_parameters()]
        for step in range(4):
            params = list(model.parameters())
            grads = torch.autograd.grad(model(_inputs(step, device)).square().mean(), params,
                                        create_graph=True)
            fast = {n: p - 0.1 * g for n, p, g in zip(names, params, grads)}
            functional_call(model, fast, (_inputs(step + 10, device),)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    error, bound = _mlp_error(mode, loop, device)
    assert error <= bound, (error, bound)


def _penalty_through_grad(model, opt, device):
    """A gradient-norm penalty read from .grad: backward(create_graph=True), then the
    penalty's own backward through the gradients, into the same .grad."""
    for step in range(4):
        model(_inputs(step, device).detach()).square().mean().backward(create_graph=True)
        sum(p.grad.square().sum() for p in model.parameters()).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["deferred", "auto"])
def test_a_penalty_through_grad_after_create_graph_matches_torch(mode, device):
    """backward(create_graph=True) leaves each fused weight's dW in .grad with its graph (made
    as torch makes it), so a penalty differentiated through .grad steps as with torch.optim;
    auto stays deferred."""
    made = []

    def make(m):
        made.append(forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1, mode=mode))
        return made[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own about create_graph, forge's "2 uses")
        error, bound = _mlp_error(mode, _penalty_through_grad, device, make)
    assert error <= bound, (error, bound)
    assert made[0].mode == "deferred"


@pytest.mark.parametrize("cpp_prehook", [True, False], ids=["cpp", "python"])
@pytest.mark.parametrize("after_auto", [False, True], ids=["immediate", "auto"])
def test_create_graph_is_refused_where_updates_run_inside_backward(after_auto, cpp_prehook,
                                                                    monkeypatch):
    """Immediate mode (or auto once it went immediate) would apply the gradient that a
    backward with create_graph=True must leave in .grad: refused by name before any weight
    or state changes; a plain backward then steps as usual."""
    if not cpp_prehook:
        monkeypatch.setattr(forge._prehook, "get", lambda: None)
    torch.manual_seed(0)
    model = _mlp()
    opt = forge.optim.AdamW(model, lr=1e-2, mode="auto" if after_auto else "immediate")
    if after_auto:  # a first step of a loop that reads no gradient: auto goes immediate
        model(_inputs(0, "cpu").detach()).square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert opt.mode == "immediate"
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)}
             for k, v in opt.state.items()}
    with pytest.raises(RuntimeError, match="create_graph=True reached '4.weight'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's own about create_graph)
            model(_inputs(1, "cpu").detach()).square().mean().backward(create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(t, opt.state[k][n]) for k, v in state.items() for n, t in v.items())
    opt.zero_grad()
    model(_inputs(1, "cpu").detach()).square().mean().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("device", DEVICES)
def test_auto_stays_deferred_where_a_gradient_is_zeroed_before_the_step(device):
    """An auto optimizer whose first step saw a weight gradient zeroed between a backward and
    opt.step() stays deferred (immediate mode would have applied it inside that backward), and
    the loop is torch's."""
    made = []

    def make(m):
        made.append(forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1))
        return made[-1]
    error, bound = _mlp_error("auto", _clean_then_adversarial, device, make)
    assert error <= bound, (error, bound)
    assert made[0].mode == "deferred"


@pytest.mark.parametrize("device", DEVICES)
def test_auto_stays_deferred_where_the_loop_replaces_a_gradient(device):
    """A loop that assigns each .grad a new tensor (p.grad = p.grad * mask) before the step
    uses the gradients: auto stays deferred, and the loop is torch's."""
    made = []

    def make(m):
        made.append(forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1))
        return made[-1]

    def loop(model, opt, device):
        masks = torch.Generator().manual_seed(7)
        for step in range(4):
            model(_inputs(step, device).detach()).square().mean().backward()
            for p in model.parameters():
                p.grad = p.grad * (torch.rand(p.shape, generator=masks) > 0.5).to(device)
            opt.step()
            opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (forge's "formed dW" for the mask)
        error, bound = _mlp_error("auto", loop, device, make)
    assert error <= bound, (error, bound)
    assert made[0].mode == "deferred"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_autograd_grad_of_the_weights_returns_torchs_gradient(mode, create_graph, device):
    """torch.autograd.grad naming the parameters returns the fused weights' gradients as torch
    computes them (not the stand-in the fused step hands over), .grad untouched, and the
    training steps between are torch's."""
    seen = []  # per run and step: the gradients autograd.grad returned

    def loop(model, opt, device):
        for step in range(4):
            x = _inputs(step, device).detach()
            params = list(model.parameters())
            grads = torch.autograd.grad(model(x).square().mean(), params,
                                        create_graph=create_graph)
            assert all(p.grad is None for p in params)
            seen.append([(g.detach().clone(), g.requires_grad) for g in grads])
            model(x).abs().mean().backward()
            opt.step()
            opt.zero_grad()
    error, bound = _mlp_error(mode, loop, device)
    assert error <= bound, (error, bound)
    forge_run, stock_run = seen[:4], seen[4:8]
    for (name, _), (g, g_graph), (w, w_graph) in zip(_mlp().named_parameters(), forge_run[0],
                                                     stock_run[0]):
        assert torch.equal(g, w) and g_graph == w_graph, name  # (the same weights: step 0)
    for forge_grads, stock_grads in zip(forge_run, stock_run):
        for (g, _), (w, _) in zip(forge_grads, stock_grads):
            assert normwise(g, w) <= bound, (normwise(g, w), bound)


_HOOKS = {"mask": lambda g: g * _HOOK_MASK.to(g.device), "clamp": lambda g: g.clamp(-1e-3, 1e-3)}
_HOOK_MASK = (torch.rand(16, 16, generator=torch.Generator().manual_seed(0)) > 0.5).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
@pytest.mark.parametrize("hook", sorted(_HOOKS))
def test_a_tensor_hook_on_a_fused_weight_sees_its_gradient(mode, hook, device):
    """W.register_hook (a gradient mask, a clamp) gets W's whole gradient and the update uses
    what it returns, as with torch.optim: such a weight's gradient is materialized (warned
    once), its neighbours stay fused."""

    def loop(model, opt, device):
        model[2].weight.register_hook(_HOOKS[hook])  # (on each run's copy of the model)
        for step in range(4):
            model(_inputs(step, device).detach()).square().mean().backward()
            opt.step()
            opt.zero_grad()
    with pytest.warns(UserWarning, match="'2.weight' has a tensor hook"):
        error, bound = _mlp_error(mode, loop, device)
    assert error <= bound, (error, bound)


def _compiled_autograd():
    """A context running backward under compiled autograd (its entry point's name moved)."""
    from torch._dynamo import compiled_autograd
    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    return enable(torch.compile(backend="eager"))


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
@pytest.mark.parametrize("cpp_prehook", [True, False], ids=["cpp", "python"])
def test_compiled_autograd_is_refused_before_a_weight_changes(mode, cpp_prehook, monkeypatch):
    """Compiled autograd would trace backward, FORGE's hooks included, into a graph (the
    Python hooks' updates then diverged from torch's in deferred mode): the C++ nodes and the
    Python path both refuse it, naming it, before any weight or state changes; an eager
    backward after it steps as usual."""
    if not cpp_prehook:
        monkeypatch.setattr(forge._prehook, "get", lambda: None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = forge.optim.AdamW(model, lr=0.1, mode=mode)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="forge: compiled autograd"):
        with _compiled_autograd():
            model(x).square().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _routed_error(mode, loop):
    """(forge vs torch.optim AdamW on a Routed model through `loop`, the bound)."""
    from reference import stock_loop_error
    return stock_loop_error(
        lambda m: forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1, mode=mode),
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), loop,
        make_model=Routed)


@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
def test_an_expert_given_no_tokens_steps_on_a_zero_gradient(mode):
    """An expert no token was routed to (its nn.Linear applied to 0 rows) has a zero gradient:
    torch.optim steps it on zeros (AdamW's moments and decay still move it), and forge does
    the same in every mode, the other weights exact beside it."""
    def loop(model, opt, device):
        for step in range(6):
            routed_loss(model, step, empty=(step % 2,) if step in (0, 3, 4) else ()).backward()
            opt.step()
            opt.zero_grad()
    error, bound = _routed_error(mode, loop)
    assert error <= bound, (error, bound)


@pytest.mark.parametrize("mode", ["deferred", "auto"])
def test_clipping_a_step_where_an_expert_got_no_token_matches_torch(mode):
    """clip_grad_norm_ over a step where an expert got no token: its deferred gradient (a
    backward of 0 tokens) has norm 0, as torch's zero gradient."""
    def loop(model, opt, device):
        for step in range(6):
            routed_loss(model, step, empty=(step % 2,) if step in (0, 3, 4) else ()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    error, bound = _routed_error(mode, loop)
    assert error <= bound, (error, bound)


# What a step leaves in .grad. torch.optim keeps each gradient until zero_grad: set_to_none
# removes it, set_to_none=False zeroes it (and a parameter holding zeros steps on them, reached
# by a backward or not), no zero_grad adds the next step's gradients to it. forge keeps no
# weight gradient: the first two are exact, the third is refused before anything changes.

_ZEROERS = {"opt": lambda model, opt: opt.zero_grad(set_to_none=False),
            "model": lambda model, opt: model.zero_grad(set_to_none=False)}


@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
@pytest.mark.parametrize("zeroer", sorted(_ZEROERS))
def test_zero_grad_keeping_zeros_steps_what_no_backward_reached(mode, zeroer):
    """zero_grad(set_to_none=False), the optimizer's or the model's: an expert left out of a
    step's forward keeps a zero gradient, so torch.optim steps it on zeros (moments decay,
    weight decay applies); forge does the same, in every mode."""
    def loop(model, opt, device):
        for step in range(6):
            routed_loss(model, step, skip=(step % 2,) if step in (2, 3, 5) else ()).backward()
            opt.step()
            _ZEROERS[zeroer](model, opt)
    error, bound = _routed_error(mode, loop)
    assert error <= bound, (error, bound)


@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
def test_zeros_kept_only_where_torch_holds_a_gradient(mode):
    """zero_grad(set_to_none=False) after each step, but once zero_grad() (to None): an expert
    left out of every step from then on holds no gradient in torch (zeroing keeps nothing
    where there is nothing), so torch.optim never steps it again; forge neither."""
    def loop(model, opt, device):
        for step in range(6):
            routed_loss(model, step, skip=(1,) if step >= 3 else ()).backward()
            opt.step()
            opt.zero_grad(set_to_none=step == 2)
    error, bound = _routed_error(mode, loop)
    assert error <= bound, (error, bound)


@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
def test_a_loop_without_zero_grad_is_refused_before_anything_changes(mode):
    """No zero_grad between two steps: torch.optim would add the second step's gradients to
    the first's, which forge no longer has. Refused, naming the weights, before any weight or
    state changes; after opt.zero_grad() the loop goes on."""
    torch.manual_seed(0)
    model = Routed()
    opt = forge.optim.AdamW(model, lr=1e-2, weight_decay=0.1, mode=mode)
    routed_loss(model, 0).backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    states = {k: v.clone() for p in model.parameters() for k, v in opt.state[p].items()
              if torch.is_tensor(v)}
    with pytest.raises(RuntimeError, match="no zero_grad"):
        routed_loss(model, 1).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(torch.equal(v, opt.state[p][k]) for p in model.parameters()
               for k, v in opt.state[p].items() if torch.is_tensor(v) and k in states)
    assert all(opt.state[p]["step"] == 1 for p in model.parameters())
    opt.zero_grad()
    routed_loss(model, 1).backward()
    opt.step()
    assert all(opt.state[p]["step"] == 2 for p in model.parameters())


@pytest.mark.parametrize("where", ["before the optimizer", "before add_param_group"])
@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
def test_a_gradient_from_before_the_step_is_added_to_as_torch_does(mode, where,
                                                                   record_difference):
    """A fused weight holding a gradient no step of the optimizer made: from a backward run
    before the optimizer was built, or (outside its zero_grad) before the parameter was added
    to it. torch.optim adds the step's gradient to it; forge runs that step deferred, which
    sums the two (inside backward the held one was dropped)."""
    from reference import max_normwise
    from tolerances import CONTRACT_RTOL
    torch.manual_seed(0)
    models = {"forge": TinyTransformer()}
    models["torch"] = copy.deepcopy(models["forge"])
    opts = {}
    for key, model in models.items():
        body = [p for n, p in model.named_parameters() if not n.startswith("head.")]
        if where == "before the optimizer":
            lm_loss(model, 0).backward()
            body = list(model.parameters())
        # (SGD: linear in the gradient, so the fused kernel's token order moves the weights by
        # rounding only, where AdamW's normalization would amplify it at near-zero gradients)
        opts[key] = (forge.optim.SGD(model, params=body, lr=0.1, momentum=0.9, mode=mode)
                     if key == "forge" else torch.optim.SGD(body, lr=0.1, momentum=0.9))
    for step in range(4):
        for key, model in models.items():
            if step == 2 and where == "before add_param_group":  # (the head's sum of 2 steps)
                opts[key].add_param_group({"params": list(model.head.parameters())})
            lm_loss(model, 1 + step).backward()
            opts[key].step()
            opts[key].zero_grad()
    error = max_normwise(models["forge"], models["torch"])
    record_difference(f"gradient from {where} ({mode})", error)
    assert error <= CONTRACT_RTOL


@pytest.mark.parametrize("mode,detach", [("auto", True), ("auto", False), ("deferred", False),
                                         ("immediate", True)])
def test_a_loss_reaching_another_optimizers_weights_matches_torch(mode, detach,
                                                                  record_difference):
    """A GAN (or actor-critic) loop: the generator's loss reaches the discriminator's weights
    after the discriminator's step, and the loop zeroes that gradient before the next one
    (the discriminator's loss reaches the generator's alike where it does not detach). torch
    adds it to the applied one and discards the sum; forge holds it (that step runs deferred)
    and discards it with the zero_grad: both models as torch.optim trains them. (Explicit
    immediate mode without detach updates the generator inside the discriminator's backward
    at the first step, as it must; it is refused at the second backward.)"""
    from reference import PerturbedByOneUlp, max_normwise
    from tiny_models import Adversarial, adversarial_step
    from tolerances import LOOP_RTOL, ULP_SENSITIVITY_FACTOR
    torch.manual_seed(0)
    base = Adversarial()
    runs = {}
    for key in ("forge", "torch", "torch_ulp"):
        pair = Adversarial()
        pair.load_state_dict(base.state_dict())
        # (SGD with momentum: a wrong gradient shows, and the summation orders of forge's
        # kernel and torch's GEMM stay at rounding, where Adam's normalization amplifies them)
        if key == "forge":
            d_opt, g_opt = (forge.optim.SGD(m, lr=0.05, momentum=0.9, weight_decay=0.1,
                                            mode=mode)
                            for m in (pair.discriminator, pair.generator))
        else:
            d_opt, g_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                            weight_decay=0.1)
                            for m in (pair.discriminator, pair.generator))
            if key == "torch_ulp":
                d_opt, g_opt = PerturbedByOneUlp(d_opt), PerturbedByOneUlp(g_opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the discriminator applied twice in its loss)
            for step in range(5):
                adversarial_step(pair, d_opt, g_opt, step, detach)
        runs[key] = pair
    error = max_normwise(runs["forge"], runs["torch"])
    record_difference(f"adversarial loop, {mode}", error)
    assert error <= max(LOOP_RTOL, ULP_SENSITIVITY_FACTOR * max_normwise(runs["torch_ulp"],
                                                                         runs["torch"]))


@pytest.mark.parametrize("make_model", ["Routed", "FusedHeadLM", "HookLast"])
def test_stepping_on_a_gradient_over_an_applied_one_is_refused(make_model):
    """No zero_grad between two steps, the second one's gradient read (clip_grad_norm_) or
    stepped on: torch.optim would use the sum of the two steps' gradients, which forge no
    longer has. Refused, naming the weights, before any weight or state changes, in every
    mode (the step holds its gradients), whatever callback comes first in backward (a
    Linear's, forge.loss's fused head, a hook parameter's); opt.zero_grad() then discards
    both, as torch's."""
    import tiny_models
    from tiny_models import first_callback_loss
    torch.manual_seed(0)
    model = getattr(tiny_models, make_model)()
    opt = forge.optim.AdamW(model, lr=1e-2, mode="immediate")
    first_callback_loss(model, 0).backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    first_callback_loss(model, 1).backward()
    assert opt.mode == "deferred"  # (held until step() or zero_grad)
    with pytest.raises(RuntimeError, match="no zero_grad"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="no zero_grad"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    opt.zero_grad()
    assert opt.mode == "immediate"
    first_callback_loss(model, 1).backward()
    opt.step()
    assert all(opt.state[p]["step"] == 2 for p in model.parameters())


def test_micro_batches_over_an_applied_gradient_are_refused():
    """No zero_grad after a step, then two backwards before the next: the second adds to the
    first, still on top of the applied gradient (dense gradients: the factors would be
    larger), so step() is refused, nothing changed."""
    torch.manual_seed(0)
    model = Routed()
    opt = forge.optim.AdamW(model, lr=1e-2, mode="deferred", deferred_store="grad")
    routed_loss(model, 0).backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    routed_loss(model, 1).backward()
    routed_loss(model, 2).backward()
    with pytest.raises(RuntimeError, match="no zero_grad"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_zeroing_a_gradient_applied_inside_backward_is_refused():
    """Immediate mode: zero_grad(set_to_none=False) between backward and opt.step() would
    make torch.optim step on zeros, but the update already ran: refused, naming the weight,
    before any gradient is zeroed."""
    torch.manual_seed(0)
    model = Routed()
    opt = forge.optim.AdamW(model, lr=1e-2, mode="immediate")
    routed_loss(model, 0).backward()
    bias_grad = model.out.bias.grad.clone()
    with pytest.raises(RuntimeError, match="zeroed before opt.step"):
        opt.zero_grad(set_to_none=False)
    assert torch.equal(model.out.bias.grad, bias_grad)


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_reading_an_applied_gradient_after_step_says_why(mode):
    """After opt.step() a fused weight's .grad stands for the gradient torch.optim would still
    hold: reading it raises, saying the step applied it and FORGE keeps none; zero_grad
    removes it, detach() too (a plain optimizer could not use it)."""
    torch.manual_seed(0)
    model = Routed()
    opt = forge.optim.AdamW(model, lr=1e-2, mode=mode)
    routed_loss(model, 0).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="applied by opt.step"):
        model.inp.weight.grad.norm()
    assert model.inp.bias.grad is None
    opt.zero_grad()
    assert model.inp.weight.grad is None
    routed_loss(model, 1).backward()
    opt.step()
    opt.detach()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
@pytest.mark.parametrize("cpp_prehook", [True, False], ids=["cpp", "python"])
def test_a_model_cast_and_cast_back_keeps_training_exactly(mode, cpp_prehook, monkeypatch):
    """model.double() then model.float() between steps (after opt.step(), its .grad cast too):
    torch gives each weight a new gradient node, which FORGE's hooks were not on. The step
    after it updates every weight from what that node received, the weights are hooked again,
    and the run stays exact against torch.optim."""
    if not cpp_prehook:
        monkeypatch.setattr(forge._prehook, "get", lambda: None)

    def loop(model, opt, device):
        for step in range(5):
            routed_loss(model, step).backward()
            opt.step()
            if step == 1:
                model.double()
                model.float()
            opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no weight left out of a step)
        error, bound = _routed_error(mode, loop)
    assert error <= bound, (error, bound)


# ---- the per-Linear host fast path: objects made once and reused across steps

@pytest.mark.parametrize("device", DEVICES)
def test_fused_path_holds_across_steps(device, monkeypatch):
    """The stand-in dW made once per weight still marks the fused path at every step: no
    Linear falls back to the materialized gradient (which would warn and call add_dw)."""
    def no_materialized_gradient(*args):
        raise AssertionError("a Linear took the materialized-gradient path")
    monkeypatch.setattr(forge.optim.slot, "add_dw", no_materialized_gradient)
    model = TinyTransformer().to(device)
    opt = forge.optim.AdamW(model, lr=1e-2, mode="immediate")
    fused = [p.param for p in opt.inspect() if p.path == "fused"]
    assert fused, "the tiny model has fused Linears"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a forge warning here is a failure
        for step in range(3):
            before = [p.detach().clone() for p in fused]
            lm_loss(model, step, device).backward()
            info = opt.inspect()  # (the C++ pre-hook's updates among them)
            assert all(info[p].updated_this_step for p in fused)
            assert all(not torch.equal(b, p) for b, p in zip(before, fused))
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("state_format,device", format_devices(["fp32", "int8", "fp8"]))
def test_replaced_state_tensor_is_the_one_updated(device, state_format):
    """forge_param is cached per parameter while the data pointers stay; a state tensor
    replaced by hand must be the one the next step reads and writes, not the old one."""
    initial = _initial_weights()
    runs = []
    for replace in (False, True):
        model = _tiny_from(initial, device)
        opt = forge.optim.AdamW(model, lr=1e-2, state_format=state_format, seed=3,
                                min_8bit_size=0)  # (int8 / fp8 on every parameter)
        for step in range(2):
            lm_loss(model, step, device).backward()
            opt.step()
            opt.zero_grad()
        old = {}
        if replace:
            for p, st in opt.state.items():
                for key, t in list(st.items()):
                    if torch.is_tensor(t):
                        old[(id(p), key)] = t  # kept alive: its address is not reused
                        st[key] = t.clone()
                        t.fill_(7)  # the old buffer now holds garbage (int8 codes, absmax 7)
        lm_loss(model, 2, device).backward()
        opt.step()
        runs.append((model, opt))
    for (name, a), b in zip(runs[0][0].named_parameters(), runs[1][0].parameters()):
        assert torch.equal(a, b), f"{name}: the step used the replaced state's old buffer"


@requires_cuda
@pytest.mark.parametrize("hooks", ["python", "cpp"])
def test_fused_step_runs_on_the_stream_backward_used(hooks, monkeypatch):
    """X and dY (or the deferred gradient) are ready on the stream backward made them on, so
    the step must be launched there: a step taken inside torch.cuda.stream(side), then one on
    the default stream (the legacy default stream's handle is 0, a real stream). Seen at the C
    ABI: every update call made through forge._lib (the fused step, and the element-wise steps
    a deferred step makes from a gradient it kept), and those the C++ pre-hook made from the
    kept args."""
    seen = []

    def spy_on(method, calls_of):
        real = getattr(forge._lib.Library, method)

        def spy(self, arg):
            # (ctypes gives None for a null void*)
            seen.extend(call.device.stream or 0 for call in calls_of(arg))
            return real(self, arg)
        monkeypatch.setattr(forge._lib.Library, method, spy)
    spy_on("wgrad_step", lambda args: [args])
    spy_on("elementwise_step", lambda args: [args])
    spy_on("elementwise_step_batch", list)
    if hooks == "python":
        monkeypatch.setattr(forge._prehook, "get", lambda: None)
    elif forge._prehook.get() is None:
        pytest.skip(f"the C++ pre-hook is not built: {forge._prehook.failure}")
    model = TinyTransformer().to("cuda")
    opt = forge.optim.AdamW(model, lr=1e-2)

    def made_in_cpp():
        return [p.wgrad_stream for p in opt.inspect() if p.made_in_cpp]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    fused = sum(1 for p in opt.inspect() if p.path == "fused")
    for step, stream in enumerate([side, torch.cuda.current_stream(), side]):
        seen.clear()
        with torch.cuda.stream(stream):
            lm_loss(model, step, "cuda").backward()
            in_cpp = made_in_cpp()
            seen += in_cpp
            opt.step()
            opt.zero_grad()
        torch.cuda.current_stream().wait_stream(side)
        assert seen and set(seen) == {stream.cuda_stream}, step
        # (the first step's updates wait for step(): mode="auto" starts deferred)
        assert len(in_cpp) == (fused if hooks == "cpp" and step else 0), step
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _ChangeOneAtATime:
    """A 'scheduler' that changes one hyper-parameter of every group per step and restores
    it at the next (the restored values are ones forge.optim has cached already):
    base, change 1, base, change 2, base, ..."""

    def __init__(self, opt, changes):
        self.opt, self.i = opt, 0
        base = {key: opt.param_groups[0][key] for key in changes}
        self.values = [base]
        for key, value in changes.items():
            self.values += [{key: value}, base]

    def step(self):
        self.i += 1
        for group in self.opt.param_groups:
            group.update(self.values[self.i % len(self.values)])


# (optimizer, its hyper-parameters, a new value for each key that changes). Left out:
# what torch.optim folds into its state step by step (NAdam's mu_product: betas[0] and
# momentum_decay), and what torch 2.4's Adam has no key for (decoupled_weight_decay).
_CHANGES = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1),
     dict(lr=5e-3, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.0, maximize=True)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1), dict(decoupled_weight_decay=True, eps=1e-3)),
    ("Lion", dict(lr=1e-3, weight_decay=0.1), dict(betas=(0.5, 0.9))),
    ("RMSprop", dict(lr=1e-3, momentum=0.9), dict(alpha=0.5, eps=1e-3, momentum=0.5)),
    ("Adagrad", dict(lr=1e-2), dict(lr_decay=0.5, eps=1e-3)),
    ("SGD", dict(lr=0.1, momentum=0.9),
     dict(momentum=0.5, dampening=0.3, nesterov=True, weight_decay=0.1, maximize=True)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,kwargs,changes", _CHANGES, ids=[c[0] for c in _CHANGES])
def test_changed_hyper_parameters_apply_at_the_next_update(device, name, kwargs, changes,
                                                           record_difference):
    """Every hyper-parameter is read from the group at each step (forge_hparams are
    cached on their values): changing any one of them between steps, and back, gives
    torch.optim's trajectory under the same changes. (The first step's deferred store keeps
    X and dY, so every step sums dW in the fused kernel's order, that of the reference.)"""
    errors = trajectories(TinyTransformer, name, kwargs, device, steps=2 * len(changes) + 1,
                          make_schedule=lambda opt: _ChangeOneAtATime(opt, changes),
                          forge_options=dict(deferred_store="factors"))
    record_difference(f"{name} hyper-parameters changed", errors["forge_vs_ordered"])
    assert_contract(errors, device)


def test_in_place_changes_of_tensor_and_list_values_apply():
    """A tensor lr or a list of betas can change in place, the group's entry staying the
    same object: the update must see the new value, as if the entry had been replaced."""
    initial = _initial_weights()
    runs = []
    for in_place in (True, False):
        model = _tiny_from(initial)
        params = [{"params": list(model.parameters()), "lr": torch.tensor(0.5),
                   "betas": [0.5, 0.75]}]
        opt = forge.optim.AdamW(model, params=params)
        group = opt.param_groups[0]
        for step in range(3):
            lm_loss(model, step).backward()
            opt.step()
            opt.zero_grad()
            new_lr, new_beta1 = 0.25 / 2 ** step, 0.25 * step  # exact in fp32
            if in_place:
                group["lr"].fill_(new_lr)
                group["betas"][0] = new_beta1
            else:
                group["lr"], group["betas"] = new_lr, (new_beta1, 0.75)
        runs.append(model)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
        assert torch.equal(a, b), f"{name}: an in-place hyper-parameter change was missed"


def test_small_elementwise_parameters_take_one_library_call_per_step(monkeypatch):
    """The batched path: no hook; step() hands every small gradient to
    forge_elementwise_step_batch at once, and nothing to forge_elementwise_step."""
    calls = []
    real = _lib.Library.elementwise_step_batch

    def counted(self, args):
        calls.append(len(args))
        real(self, args)
    monkeypatch.setattr(_lib.Library, "elementwise_step_batch", counted)
    monkeypatch.setattr(_lib.Library, "elementwise_step",
                        lambda self, args: pytest.fail("an element-wise update of its own"))
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, mode="immediate")
    small = [p for p in opt.inspect() if p.path == "batched"]
    assert small and all(p.path in ("fused", "batched") for p in opt.inspect())
    for step in range(2):
        lm_loss(model, step).backward()
        assert all(s.param.grad is not None for s in small)  # waiting for step()
        before = [s.param.detach().clone() for s in small]
        opt.step()
        assert calls == [len(small)] * (step + 1)
        assert all(not torch.equal(b, s.param) for b, s in zip(before, small))
        assert all(s.param.grad is None for s in small)
        assert all(opt.state[s.param]["step"] == step + 1 for s in small)
        opt.zero_grad()


def test_refused_batched_step_keeps_every_small_gradient():
    """A deferred step refused at its check (a state tensor replaced by one of the wrong dtype)
    changes no small parameter and leaves their gradients in .grad, for a corrected retry."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, mode="deferred")
    lm_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    small = [p for p in opt.inspect() if p.path == "batched"]
    victim = small[-1]
    good = opt.state[victim.param]["exp_avg"]
    opt.state[victim.param]["exp_avg"] = good.double()
    lm_loss(model, 1).backward()
    before = [s.param.detach().clone() for s in small]
    grads = [s.param.grad for s in small]
    with pytest.raises(RuntimeError, match=f"'{victim.name}': state 'exp_avg'"):
        opt.step()
    assert all(torch.equal(b, s.param) for b, s in zip(before, small))
    assert all(s.param.grad is g for s, g in zip(small, grads))
    opt.state[victim.param]["exp_avg"] = good
    opt.step()
    assert all(not torch.equal(b, s.param) for b, s in zip(before, small))
