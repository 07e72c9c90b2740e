"""test_loop.py — the training loop users already have, around forge.optim: gradient
clipping (torch.nn.utils.clip_grad_norm_ and max_grad_norm=), torch.amp.GradScaler (its
unscale, inf check and skipped steps), gradient accumulation over micro-batches, step
pre-hooks, and the three modes (deferred, immediate, auto); and random loops drawn from these
(and from the ways to zero gradients) against torch.optim. Exact against torch.optim doing
the same, or refused before a weight changes. Bounds: tolerances.py.

The reference: the same model under torch.optim, with every nn.Linear weight gradient summed
token by token in the order FORGE's CPU kernel sums them over the concatenated micro-batches
(reference.ordered_concat), then the loop's own clip / unscale / step.
"""
import copy
import logging
import math
import warnings

import pytest
import torch

import forge
import forge.optim
from conftest import DEVICES
from reference import (PerturbedByOneUlp, TrajectoryNormwise, max_normwise,
                       nothing_held_after_step, ordered_concat, torch_optimizer)
from test_contract import CONFIGS, config_id
from tiny_models import TinyTransformer, lm_loss

STEPS = 20
MICRO = 2
MAX_NORM = 0.5   # below the tiny model's gradient norm: every step clips
INF_STEP = 7     # a step whose first micro-batch has an infinite loss: GradScaler skips it


def run_loop(model, opt, device, steps=STEPS, micro=MICRO, scaler=None, max_norm=MAX_NORM,
             before_step=None, inf_step=INF_STEP, clip=torch.nn.utils.clip_grad_norm_):
    """The loop every AMP + clipping + accumulation recipe writes; returns the norms
    clip_grad_norm_ reported and the scale after each step."""
    norms, scales = [], []
    for step in range(steps):
        for m in range(micro):
            loss = lm_loss(model, step * micro + m, device) / micro
            if step == inf_step and m == 0 and scaler is not None:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if before_step is not None:
            before_step()
        if scaler is not None:
            scaler.unscale_(opt)
        if max_norm is not None:
            norms.append(float(clip(model.parameters(), max_norm)))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad()
    return norms, scales


def scaler_for(device):
    # growth_interval 3: the scale grows within the run, and halves at INF_STEP
    return torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=3)


def clip_with_exact_linear_norms(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ (per-tensor norms, their norm, max_norm / (total +
    1e-6) at most 1, in fp32), with each nn.Linear weight's norm computed in fp64 as forge
    computes it without forming dW; every other norm is torch's own fp32 one."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.double()).float() if getattr(g, "_linear", False)
             else torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def loop_errors(name, kwargs, device, forge_options, use_scaler=True):
    """The same 20-step loop on four copies of one model: forge; torch.optim on dW summed in
    forge's order ("ref", clip_grad_norm_ as users call it); the same with each Linear
    weight's norm in fp64 as forge takes it ("ref64"); and ref64 with every consumed gradient
    perturbed by one ulp ("ulp": torch's own sensitivity). Returns the normwise differences,
    what the loops reported, and the forge optimizer."""
    torch.manual_seed(0)
    base = TinyTransformer().to(device)
    models = {"forge": copy.deepcopy(base), "stock": copy.deepcopy(base)}
    models.update({k: ordered_concat(copy.deepcopy(base)) for k in ("ref", "ref64", "ulp")})
    opts = {"forge": getattr(forge.optim, name)(models["forge"], **kwargs, **forge_options),
            "stock": torch_optimizer(name, models["stock"].parameters(), **kwargs),
            "ref": torch_optimizer(name, models["ref"].parameters(), **kwargs),
            "ref64": torch_optimizer(name, models["ref64"].parameters(), **kwargs),
            "ulp": PerturbedByOneUlp(torch_optimizer(name, models["ulp"].parameters(),
                                                     **kwargs))}
    linear = {id(m.weight) for key in ("ref64", "ulp") for m in models[key].modules()
              if isinstance(m, torch.nn.Linear)}

    def mark_linear(model):
        def before_step():
            model.move_ordered_grads()
            for p in model.parameters():
                if id(p) in linear and p.grad is not None:
                    p.grad._linear = True
        return before_step

    results = {}
    for key, model in models.items():
        before = getattr(model, "move_ordered_grads", None)
        clip = torch.nn.utils.clip_grad_norm_
        if key in ("ref64", "ulp"):
            before, clip = mark_linear(model), clip_with_exact_linear_norms
        results[key] = run_loop(model, opts[key], device, before_step=before, clip=clip,
                                scaler=scaler_for(device) if use_scaler else None)
    errors = {"forge_vs_ref64": max_normwise(models["forge"], models["ref64"]),
              "forge_vs_ref": max_normwise(models["forge"], models["ref"]),
              "ref_vs_ref64": max_normwise(models["ref"], models["ref64"]),
              "ulp_vs_ref64": max_normwise(models["ulp"], models["ref64"]),
              "stock_vs_ref": max_normwise(models["stock"], models["ref"])}
    return errors, results, opts["forge"]


def assert_loop_bound(errors, device="cpu", dense=False):
    """forge within LOOP_RTOL of torch doing the same loop, or within what torch itself moves
    under a one-ulp change of the gradient it consumes; against torch's own clip_grad_norm_,
    also within what torch moves when only its fp32 norm's rounding changes. On CUDA the
    fused kernel sums dW in its own order, and a dense deferred store (dense: the factors
    would be larger) is torch's GEMM's: within what torch moves when only its summation
    order changes (stock GEMM against the token-ordered sum)."""
    from tolerances import LOOP_RTOL, SUM_ORDER_FACTOR, ULP_SENSITIVITY_FACTOR
    own = max(LOOP_RTOL, ULP_SENSITIVITY_FACTOR * errors["ulp_vs_ref64"])
    if device != "cpu" or dense:
        own = max(own, SUM_ORDER_FACTOR * errors["stock_vs_ref"])
    assert errors["forge_vs_ref64"] <= own, errors
    assert errors["forge_vs_ref"] <= max(own, SUM_ORDER_FACTOR * errors["ref_vs_ref64"]), errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_clip_scaler_accumulation_match_torch(config, device, record_difference):
    """Every rule, 20 steps of 2 micro-batches, GradScaler (with a skipped step and scale
    growth) and clip_grad_norm_ on every step: deferred mode gives torch.optim's weights."""
    name, kwargs = config
    errors, results, _ = loop_errors(name, kwargs, device,
                                     dict(mode="deferred", deferred_store="factors"))
    record_difference(f"{name} loop vs torch (fp64 norms)", errors["forge_vs_ref64"])
    record_difference(f"{name} loop vs torch clip_grad_norm_", errors["forge_vs_ref"])
    assert results["forge"][1] == results["ref"][1], "GradScaler saw the same infs"
    norms_f, norms_r = results["forge"][0], results["ref64"][0]
    from tolerances import GRAD_NORM_RTOL
    assert all(abs(a - b) <= GRAD_NORM_RTOL * b for a, b in zip(norms_f, norms_r)
               if b == b and b < 1e30), (norms_f, norms_r)
    assert_loop_bound(errors, device)


@pytest.mark.parametrize("store", ["auto", "grad"])
def test_dense_and_auto_stores_match_torch(store, record_difference):
    """deferred_store 'grad' (dense gradients, dW by torch's own GEMM) and 'auto' (dense where
    the factors would be larger, as in this tiny model): the same loop, the same weights
    within the summation-order bound."""
    from reference import stock_loop_error
    error, bound = stock_loop_error(lambda m, **kw: forge.optim.AdamW(
        m, lr=1e-2, weight_decay=0.1, mode="deferred", deferred_store=store, **kw),
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        lambda model, opt, device: run_loop(model, opt, device, scaler=scaler_for(device)))
    record_difference(f"AdamW loop, deferred_store={store}", error)
    assert error <= bound, (error, bound)


def test_auto_mode_sees_micro_batches_on_a_parameter_outside_linears(caplog):
    """mode='auto' and a loop accumulating micro-batches, on a model whose largest parameter
    is a convolution's (updated by its gradient hook, not fused): the first step sees the
    second backward reach it and stays deferred, so the loop matches torch.optim throughout
    (it must not go immediate and refuse the next step's second micro-batch inside backward,
    after the first one's updates ran)."""
    from reference import stock_loop_error
    from tiny_models import Convolutional, conv_loss
    from forge.optim.routing import BATCHED_MAX_ELEMENTS
    assert Convolutional().conv.weight.numel() > BATCHED_MAX_ELEMENTS  # (the hook path)
    made = []

    def make_forge(model, **kw):
        made.append(forge.optim.AdamW(model, lr=1e-2, weight_decay=0.1, **kw))
        return made[-1]

    def accumulating(model, opt, device):
        for step in range(4):
            for m in range(MICRO):
                (conv_loss(model, step * MICRO + m, device) / MICRO).backward()
            opt.step()
            opt.zero_grad()

    with caplog.at_level(logging.INFO, logger="forge"):
        error, bound = stock_loop_error(
            make_forge, lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
            accumulating, make_model=Convolutional)
    assert made[0].mode == "deferred"
    assert "stays deferred: the gradient of conv.weight" in caplog.text
    assert error <= bound, (error, bound)


def test_auto_mode_stays_deferred_for_a_loop_that_clips(caplog):
    """mode='auto' (the default): a loop that clips is exact from its first step on (this
    model's micro-batches outgrow its weights' gradients: dense deferred stores)."""
    name, kwargs = "AdamW", dict(lr=1e-2, weight_decay=0.1)
    with caplog.at_level(logging.INFO, logger="forge"):
        errors, _, opt = loop_errors(name, kwargs, "cpu", {}, use_scaler=False)
    assert opt.mode == "deferred"
    assert "stays deferred" in caplog.text
    assert_loop_bound(errors, dense=True)


def test_auto_mode_goes_immediate_for_a_plain_loop(caplog):
    model = TinyTransformer()
    opt = forge.optim.AdamW(model)
    assert opt.mode == "deferred"
    with caplog.at_level(logging.INFO, logger="forge"):
        for step in range(2):
            lm_loss(model, step).backward()
            if step == 0:
                assert isinstance(model.head.weight.grad, forge.optim.FactoredGrad)
            else:
                assert isinstance(model.head.weight.grad, forge.optim.ConsumedGrad)
            opt.step()
            opt.zero_grad()
    assert opt.mode == "immediate" and "inside backward from the next step" in caplog.text


def test_deferred_and_immediate_give_the_same_bits():
    """A plain loop: deferred mode runs, at opt.step(), the very fused call immediate mode
    runs in backward (one micro-batch: the same tokens in the same order)."""
    torch.manual_seed(0)
    base = TinyTransformer()
    runs = {}
    for mode in ("immediate", "deferred", "auto"):
        model = copy.deepcopy(base)
        opt = forge.optim.AdamW(model, lr=1e-2, weight_decay=0.1, mode=mode,
                                deferred_store="factors")
        for step in range(4):
            lm_loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        runs[mode] = [p.detach().clone() for p in model.parameters()]
    for mode in ("deferred", "auto"):
        assert all(torch.equal(a, b) for a, b in zip(runs[mode], runs["immediate"])), mode


@pytest.mark.parametrize("what", ["clip_grad_norm_", "GradScaler", "second backward",
                                  "step pre-hook"])
def test_immediate_mode_refuses_what_it_cannot_honour(what):
    """Immediate mode applies each gradient inside backward: a loop that needs it before
    opt.step() gets an error naming the parameter and the way out, never a silent no-op."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, mode="immediate")
    if what == "step pre-hook":
        with pytest.raises(RuntimeError, match="pre-hook"):
            opt.register_step_pre_hook(lambda *a: None)
        return
    scaler = torch.amp.GradScaler("cpu") if what == "GradScaler" else None
    loss = lm_loss(model, 0)
    (scaler.scale(loss) if scaler else loss).backward()
    after = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="already applied.*mode='immediate'|second gradient"):
        if what == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif what == "GradScaler":
            scaler.unscale_(opt)
        else:
            lm_loss(model, 1).backward()
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))


@pytest.mark.parametrize("mode", ["immediate", "auto"])
def test_a_hyper_parameter_changed_after_updates_inside_backward_is_refused(mode):
    """Updates that ran inside backward used the lr set then; torch.optim applies the lr of
    opt.step(). A change in between is refused at opt.step(), naming it and the way out;
    auto, immediate after a first step where nothing changed, refuses it likewise."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, mode=mode)
    for step in range(3 if mode == "auto" else 1):
        lm_loss(model, step).backward()
        if step < 2 and mode == "auto":
            opt.param_groups[0]["lr"] = 1e-2  # (set, unchanged: nothing to refuse)
            opt.step()
            opt.zero_grad()
    assert opt.mode == "immediate"
    opt.param_groups[0]["lr"] = 1e-3
    with pytest.raises(RuntimeError, match=r"lr of param group 0 \(0\.01 -> 0\.001\) changed "
                                           r"between backward and opt\.step\(\).*"
                                           r"mode='deferred'"):
        opt.step()


def test_step_pre_hooks_run_before_the_update():
    model = TinyTransformer()
    opt = forge.optim.SGD(model, lr=0.1, mode="deferred")
    seen = []
    start = model.head.weight.detach().clone()
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
        torch.equal(model.head.weight, start)))
    lm_loss(model, 0).backward()
    assert torch.equal(model.head.weight, start), "nothing changes in deferred backward"
    opt.step()
    assert seen == [True] and not torch.equal(model.head.weight, start)


def test_built_in_max_grad_norm_is_exact_and_reports_the_true_norm(record_difference):
    """max_grad_norm= (deferred): the same weights as clip_grad_norm_ by hand, and
    opt.grad_norm is the norm before clipping, as clip_grad_norm_ returns it."""
    torch.manual_seed(0)
    base = TinyTransformer()
    by_hand, built_in = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = forge.optim.AdamW(by_hand, lr=1e-2, mode="deferred", deferred_store="factors")
    opt_b = forge.optim.AdamW(built_in, lr=1e-2, max_grad_norm=MAX_NORM,
                              deferred_store="factors")
    for step in range(6):
        lm_loss(by_hand, step).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(by_hand.parameters(), MAX_NORM))
        opt_a.step()
        opt_a.zero_grad()
        lm_loss(built_in, step).backward()
        opt_b.step()
        opt_b.zero_grad()
        assert opt_b.grad_norm == pytest.approx(norm, rel=1e-6)
    error = max_normwise(built_in, by_hand)
    record_difference("max_grad_norm vs clip_grad_norm_", error)
    from tolerances import LOOP_RTOL
    assert error <= LOOP_RTOL


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_nonfinite_total_norm_skips_the_step_and_counts_it(bad):
    """max_grad_norm= with a gradient element inf or NaN: the total norm is not finite, so is
    torch's clip coefficient; every element of the step is then a non-finite gradient, skipped
    and counted, the weights and states as they were (found by test_state_props.py: the NaN
    coefficient reached the library as grad_scale, refused halfway through the step)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, max_grad_norm=MAX_NORM)
    lm_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    states = copy.deepcopy(opt.state_dict()["state"])
    lm_loss(model, 1).backward()
    model.blocks[0].attn.q.bias.grad[0] = bad  # (a plain gradient: the fused weights' are held)
    opt.step()
    numel = sum(p.numel() for p in model.parameters())
    assert opt.nonfinite_count == numel and not math.isfinite(opt.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    after = opt.state_dict()["state"]
    assert all(torch.equal(states[k][n], after[k][n]) for k in states for n in states[k]
               if torch.is_tensor(states[k][n]) and n != "step")


def _lagged_clip_against_torch(base, lr, steps, edit=None, exact_steps=()):
    """forge.optim.SGD(mode="immediate", max_grad_norm=MAX_NORM) on a copy of base against
    torch doing what lagged clipping means: step t's gradients scaled by the coefficient of the
    last finite norm before it (1 at first), the steps in exact_steps run deferred
    (accumulate_grad) and clipped by clip_grad_norm_ itself. edit(step, model, ref) may set
    gradients by hand after both backwards. Checks each step's reported norm; returns the
    trajectories' normwise distance."""
    model, ref = copy.deepcopy(base), ordered_concat(copy.deepcopy(base))
    opt = forge.optim.SGD(model, lr=lr, mode="immediate", max_grad_norm=MAX_NORM)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    coef = 1.0
    for step in range(steps):
        if exact_steps:
            opt.accumulate_grad = step in exact_steps
        lm_loss(model, step).backward()
        lm_loss(ref, step).backward()
        ref.move_ordered_grads()
        if edit is not None:
            edit(step, model, ref)
        opt.step()
        opt.zero_grad()
        grads = [p.grad for p in ref.parameters() if p.grad is not None]
        if step in exact_steps:
            norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        else:
            # (torch.nn.utils.get_total_norm's definition, in fp32; torch 2.4 lacks it)
            norm = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads])))
            for g in grads:
                g.mul_(coef)
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.nonfinite_count == 0
        assert opt.grad_norm == pytest.approx(norm, rel=1e-5)
        if math.isfinite(norm):
            coef = min(1.0, MAX_NORM / (norm + 1e-6))
    return max_normwise(model, ref)


def test_immediate_max_grad_norm_is_lagged():
    """Immediate mode cannot know a step's norm before its updates: max_grad_norm clips step
    t with the coefficient of step t - 1's norm (the first step unclipped), and grad_norm
    reports each step's true norm. Checked against torch doing exactly that."""
    from tolerances import LOOP_RTOL
    torch.manual_seed(0)
    error = _lagged_clip_against_torch(TinyTransformer(), 0.1, 5)
    assert error <= LOOP_RTOL, error


def test_immediate_lagged_clip_after_an_overflowed_norm_keeps_the_last_coefficient():
    """A step whose gradient elements are finite but whose norm is beyond fp32 (inf) runs with
    the coefficient it had; the next step clips with the last finite norm's coefficient.
    torch's formula would give 0 there, a gradient scale the library refuses inside the next
    backward: the run would stop. (A non-finite element is skipped and left out of the norm,
    so only an overflowed sum gets here.)"""
    from tolerances import LOOP_RTOL
    torch.manual_seed(0)
    base = TinyTransformer()
    base.probe = torch.nn.Parameter(torch.zeros(2))  # (not in the loss: its gradient set by hand)

    def overflow(step, model, ref):
        if step == 1:  # each finite; their norm, 4.2e38, is not in fp32
            model.probe.grad, ref.probe.grad = torch.full((2,), 3e38), torch.full((2,), 3e38)
    error = _lagged_clip_against_torch(base, 1e-3, 4, edit=overflow)
    assert error <= LOOP_RTOL, error


def test_immediate_lagged_clip_follows_a_deferred_step():
    """accumulate_grad switched on for one step (deferred: clipped exactly with its own norm)
    and off again: the next immediate step clips with that step's norm, as after an immediate
    one."""
    from tolerances import LOOP_RTOL
    torch.manual_seed(0)
    error = _lagged_clip_against_torch(TinyTransformer(), 0.1, 4, exact_steps=(1,))
    assert error <= LOOP_RTOL, error


def test_factored_gradient_holds_no_dense_dw_until_an_operation_needs_one():
    """deferred_store='auto' keeps X and dY while they are smaller than dW; an operation
    without a factored form (clip_grad_value_) forms dW once, with a warning, and stays exact."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    opt = forge.optim.SGD(model, lr=0.1, mode="deferred")
    x = torch.randn(8, 256)
    model(x).square().sum().backward()
    g = model[0].weight.grad
    assert isinstance(g, forge.optim.FactoredGrad) and g.dense is None
    expected = (2 * model(x).detach()).t().matmul(x)
    assert torch.allclose(torch.linalg.vector_norm(g), expected.norm(), rtol=1e-6)
    with pytest.warns(UserWarning, match="formed dW"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    w = model[0].weight.detach().clone()
    opt.step()
    assert torch.allclose(model[0].weight, w - 0.1 * expected.clamp(-0.01, 0.01), atol=1e-7)


_TENSOR_METHODS = {"norm": lambda g: g.norm(), "norm_1": lambda g: g.norm(1),
                   "add": lambda g: g.add(1.0), "multiply": lambda g: g.multiply(2.0),
                   "mul": lambda g: g.mul(2.0), "view": lambda g: g.view(g.shape),
                   "flatten": lambda g: g.flatten()}


@pytest.mark.parametrize("method", sorted(_TENSOR_METHODS))
def test_tensor_methods_on_a_factored_gradient_are_torchs(method):
    """A loop calling a torch.Tensor method on a fused weight's deferred gradient (logging
    p.grad.norm(), say) gets torch's result on dW, and the step then applies that gradient
    unchanged: none of the FactoredGrad's own helpers shadows a Tensor method."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    opt = forge.optim.SGD(model, lr=0.1, mode="deferred", deferred_store="factors")
    x = torch.randn(8, 256)
    model(x).square().sum().backward()
    g = model[0].weight.grad
    assert isinstance(g, forge.optim.FactoredGrad) and g.dense is None
    expected = (2 * model(x).detach()).t().matmul(x)
    call = _TENSOR_METHODS[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (forming dW for an operation says so)
        got = call(g)
    want = call(expected.double())  # (the reference's reductions in fp64)
    assert type(got) is torch.Tensor and got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    w = model[0].weight.detach().clone()
    opt.step()
    assert torch.allclose(model[0].weight, w - 0.1 * expected, atol=1e-7)


_SCALINGS = {
    "div_": lambda grads: [g.div_(2) for g in grads],
    "itruediv": lambda grads: [g.__itruediv__(torch.tensor(2.0)) for g in grads],
    "foreach_div_": lambda grads: torch._foreach_div_(grads, 2.0),
    "mul_": lambda grads: [g.mul_(0.5) for g in grads],
}


@pytest.mark.parametrize("scaling", sorted(_SCALINGS))
def test_a_loop_scaling_gradients_by_hand_matches_torch(scaling):
    """A hand-written accumulation that scales the summed gradients by one number before the
    step (p.grad /= steps, torch._foreach_div_, mul_): it goes into the factored gradient's
    scale, no dW formed (no warning), within the loop bound of torch.optim doing the same on
    dW summed in forge's order."""
    from tolerances import LOOP_RTOL, ULP_SENSITIVITY_FACTOR
    torch.manual_seed(0)
    base = TinyTransformer()
    models = {"forge": copy.deepcopy(base)}
    models.update({k: ordered_concat(copy.deepcopy(base)) for k in ("ref", "ulp")})
    opts = {"forge": forge.optim.AdamW(models["forge"], lr=1e-2, weight_decay=0.1,
                                       mode="deferred", deferred_store="factors"),
            "ref": torch.optim.AdamW(models["ref"].parameters(), lr=1e-2, weight_decay=0.1),
            "ulp": PerturbedByOneUlp(torch.optim.AdamW(models["ulp"].parameters(), lr=1e-2,
                                                       weight_decay=0.1))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for key, model in models.items():
            for step in range(4):
                for micro in range(MICRO):
                    lm_loss(model, step * MICRO + micro).backward()
                if key != "forge":
                    model.move_ordered_grads()
                _SCALINGS[scaling]([p.grad for p in model.parameters() if p.grad is not None])
                opts[key].step()
                opts[key].zero_grad()
    formed = [str(w.message) for w in caught if "formed dW" in str(w.message)]
    assert not formed, formed
    error = max_normwise(models["forge"], models["ref"])
    bound = max(LOOP_RTOL, ULP_SENSITIVITY_FACTOR * max_normwise(models["ulp"], models["ref"]))
    assert error <= bound, (error, bound)


def test_a_factored_gradient_multiplied_by_a_tensor_forms_dw():
    """mul_ by a tensor of W's shape (a mask) has no factored form: dW is formed once, with a
    warning, and the step applies the masked gradient."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    opt = forge.optim.SGD(model, lr=0.1, mode="deferred", deferred_store="factors")
    x = torch.randn(8, 64)
    model(x).square().sum().backward()
    expected = (2 * model(x).detach()).t().matmul(x)
    mask = (torch.arange(64 * 64).reshape(64, 64) % 3 > 0).float()
    with pytest.warns(UserWarning, match="formed dW"):
        model[0].weight.grad.mul_(mask)
    w = model[0].weight.detach().clone()
    opt.step()
    assert torch.allclose(model[0].weight, w - 0.1 * expected * mask, atol=1e-7)


def test_a_factored_gradients_data_takes_what_is_assigned():
    """`.data = t` on a factored gradient (torch.nn.utils.vector_to_parameters over the
    gradients, as a flat-vector gradient transform writes them back) replaces its value, as on
    torch's dense gradient: the step applies t. Another shape is refused, naming the weight."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    opt = forge.optim.SGD(model, lr=0.1, mode="deferred", deferred_store="factors")
    model(torch.randn(8, 64)).square().sum().backward()
    g = model[0].weight.grad
    assert isinstance(g, forge.optim.FactoredGrad)
    new = torch.randn(64, 64)
    torch.nn.utils.vector_to_parameters(new.reshape(-1), [g])
    assert torch.equal(model[0].weight.grad, new)
    with pytest.raises(RuntimeError, match=r"gradient of 0.weight is \[64, 64\]; .data cannot"):
        g.data = torch.zeros(64, 63)
    w = model[0].weight.detach().clone()
    opt.step()
    assert torch.equal(model[0].weight, w - 0.1 * new)


def test_an_applied_gradients_data_cannot_be_assigned():
    """Immediate mode: the gradient already applied refuses `.data = t` (no dispatched
    operation, so not its other refusals' path), where torch's gradient would take t."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    opt = forge.optim.SGD(model, lr=0.1, mode="immediate")
    model(torch.randn(8, 64)).square().sum().backward()
    with pytest.raises(RuntimeError, match="already applied to the weight inside backward.*"
                       "the assignment of .data"):
        model[0].weight.grad.data = torch.zeros(64, 64)
    opt.step()


def test_accumulation_concatenates_tokens_without_a_gradient():
    model = TinyTransformer(dim=64)
    opt = forge.optim.AdamW(model, mode="deferred", deferred_store="factors")
    for m in range(3):
        lm_loss(model, m).backward()
    g = model.blocks[0].up.weight.grad
    assert isinstance(g, forge.optim.FactoredGrad) and len(g.parts) == 3 and g.dense is None
    opt.step()
    assert nothing_held_after_step(model, opt)


def test_sum_of_squares_in_chunks_is_the_whole_sum(monkeypatch):
    """The fp64 sum of squares of a dense gradient runs in chunks (bounded temporaries): the
    same sum up to fp64 rounding, and non-finite wherever one element is."""
    from forge.optim import deferred
    t = torch.randn(1000, 37)
    whole = t.double().square().sum()
    monkeypatch.setattr(deferred, "_SQ_CHUNK", 4096)
    chunked = deferred.sum_sq_fp64(t)
    assert chunked.dtype == torch.float64
    assert torch.allclose(chunked, whole, rtol=1e-12, atol=0)
    t[999, 36] = float("inf")
    assert torch.isinf(deferred.sum_sq_fp64(t))
    t[0, 0] = float("nan")
    assert torch.isnan(deferred.sum_sq_fp64(t))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [256, 600], ids=["gram_cuda", "dense_rows_cuda"])
def test_norm_of_factors_on_cuda_against_fp64(tokens, dtype):
    """‖dYᵀX‖² of factors on CUDA, by the Gram identity (256 tokens) or dW's row blocks (600),
    against fp64: bf16 factors on the tensor cores with fp32 results where torch has
    mm(out_dtype=fp32), fp32 products otherwise."""
    from forge.optim import deferred
    from tolerances import FACTORED_NORM_RTOL, FACTORED_NORM_TENSOR_CORE_RTOL
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 512, device="cuda", generator=gen).to(dtype)
    dy = torch.randn(tokens, 700, device="cuda", generator=gen).to(dtype)
    want = (dy.double().t() @ x.double()).square().sum().item()
    got = deferred._factored_sum_sq([(x, dy)], (700, 512), device).item()
    tensor_cores = dtype == torch.bfloat16 and deferred._has_fp32_out_mm(device)
    rtol = FACTORED_NORM_TENSOR_CORE_RTOL if tensor_cores else FACTORED_NORM_RTOL
    assert abs(got - want) <= rtol * want, (got, want, tensor_cores)


def _factored_grads(device, dtype, gen):
    """FactoredGrads as a transformer block hands them over: q, k, v sharing one X, o with its
    own, gate and up sharing one (the same shapes as q's), one of another shape alone, and
    one whose tokens exceed a Gram block (taken alone)."""
    from forge.optim.deferred import FactoredGrad, _GRAM_BLOCK

    def grad(x, rows):
        w = torch.zeros(rows, x.size(1), device=device, dtype=dtype)
        g = FactoredGrad(w, f"w{rows}x{x.size(1)}")
        g.add_factors(x, torch.randn(x.size(0), rows, device=device, generator=gen).to(dtype))
        return g

    def tokens(n, cols):
        return torch.randn(n, cols, device=device, generator=gen).to(dtype)

    x_attn, x_o, x_mlp = tokens(40, 96), tokens(40, 96), tokens(40, 96)
    long = tokens(_GRAM_BLOCK + 1, 2048)
    return [grad(x_attn, 96), grad(x_attn, 96), grad(x_attn, 96), grad(x_o, 96),
            grad(x_mlp, 96), grad(x_mlp, 96), grad(tokens(40, 64), 80), grad(long, 2048)]


def _one_at_a_time(grads):
    from forge.optim import deferred
    return [deferred._factored_sum_sq(g.parts, g.shape, g.device).item() for g in grads]


def test_batched_factored_norms_equal_one_at_a_time():
    """fill_sum_sqs (the clipped step's batched Gram products, a shared X multiplied once)
    gives every weight's ‖dW‖² as _factored_sum_sq does alone, in fp64 on the CPU (terms in
    another order only), and leaves the weights it cannot batch to sum_sq()."""
    from forge.optim import deferred
    gen = torch.Generator().manual_seed(3)
    grads = _factored_grads(torch.device("cpu"), torch.float32, gen)
    deferred.fill_sum_sqs(grads)
    assert all(g._sum_sq is not None for g in grads[:6])
    assert grads[6]._sum_sq is None and grads[7]._sum_sq is None  # alone; past a Gram block
    want = _one_at_a_time(grads)
    got = [g.sum_sq().item() for g in grads]
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-12 * w, (got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_factored_norms_on_cuda_against_fp64():
    """The batched norms of bf16 factors on CUDA (tensor cores, fp32 results) against fp64."""
    from forge.optim import deferred
    from tolerances import FACTORED_NORM_RTOL, FACTORED_NORM_TENSOR_CORE_RTOL
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    grads = _factored_grads(device, torch.bfloat16, gen)
    deferred.fill_sum_sqs(grads)
    assert all(g._sum_sq is not None for g in grads[:6])
    rtol = FACTORED_NORM_TENSOR_CORE_RTOL if deferred._has_fp32_out_mm(device) \
        else FACTORED_NORM_RTOL
    for g in grads:
        (x, dy), = g.parts
        want = (dy.double().t() @ x.double()).square().sum().item()
        got = g.sum_sq().item()
        assert abs(got - want) <= rtol * want, (g.param_name, got, want)


def test_a_loops_first_norm_computes_the_steps_factored_norms_together():
    """In a user's clip (torch's clip_grad_norm_ asks each gradient in turn), the first
    FactoredGrad asked computes the norms of the step's same-shaped ones with it; each is the
    norm of its dense dW; the step's list of them holds no gradient alive."""
    import weakref
    from forge.optim.deferred import FactoredGrad
    from tolerances import FP32_ROUNDING_RTOL
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False),
                                torch.nn.Linear(16, 16, bias=False),
                                torch.nn.Linear(16, 8, bias=False))
    opt = forge.optim.AdamW(model, lr=1e-3, mode="deferred", deferred_store="factors")
    x = torch.randn(4, 16)
    model(x).square().sum().backward()
    grads = [m.weight.grad for m in model]
    assert all(isinstance(g, FactoredGrad) for g in grads)
    first = torch.linalg.vector_norm(grads[0]).item()
    assert grads[1]._sum_sq is not None       # batched with the first (same shape)
    assert grads[2]._sum_sq is None           # alone in its shape: when asked
    for g in grads:
        (xk, dyk), = g.parts
        want = (dyk.double().t() @ xk.double()).square().sum().sqrt().item()
        got = first if g is grads[0] else torch.linalg.vector_norm(g).item()
        assert abs(got - want) <= FP32_ROUNDING_RTOL * want, (g.param_name, got, want)
    refs = list(grads[0].cohort)
    assert len(refs) == 3 and all(isinstance(r, weakref.ReferenceType) for r in refs)
    del grads, g
    opt.zero_grad(set_to_none=True)
    assert all(r() is None for r in refs)  # freed by reference counts: no cycle holds them


# ------------------------------------------------------------------ random loops

RANDOM_LOOPS = 30   # loops per mode, seeds 0..29
RANDOM_LOOP_STEPS = 8


def _random_loop(seed: int, mode: str):
    """One loop drawn at random, run on three copies of a Routed model: forge, torch.optim,
    and torch.optim with 1-ulp perturbed gradients. The loop zeroes gradients one way
    throughout (the optimizer's or the model's, to None or to zeros; before backward or after
    step()), and each step draws one or two backwards (an expert left out, or given no token),
    a clip_grad_norm_, and a forgotten zero_grad. Immediate mode draws no clip and one
    backward, auto draws them once for the whole loop (what they refuse by name is their
    contract, test_modes.py). Returns (forge vs torch, torch vs its perturbed run) after each
    step, and the refusals: (step, message, whether forge's weights were unchanged by it)."""
    import random
    from tiny_models import Routed, routed_loss
    rng = random.Random(seed)
    torch.manual_seed(seed)
    base = Routed()
    models = {key: copy.deepcopy(base) for key in ("forge", "torch", "ulp")}
    sgd = dict(lr=0.05, momentum=0.9, weight_decay=0.1)
    opts = {"forge": forge.optim.SGD(models["forge"], mode=mode, **sgd),
            "torch": torch.optim.SGD(models["torch"].parameters(), **sgd),
            "ulp": PerturbedByOneUlp(torch.optim.SGD(models["ulp"].parameters(), **sgd))}
    whose = rng.choice(["opt", "model"])
    to_none = rng.random() < 0.5
    before = rng.random() < 0.5
    clip_always = mode == "auto" and rng.random() < 0.4
    micro_always = mode == "auto" and rng.random() < 0.4

    def zero(key):
        (opts[key] if whose == "opt" else models[key]).zero_grad(set_to_none=to_none)

    # whether the next backward lands on a step's gradients no zero_grad removed: torch would
    # step on their sum (so may forge refuse, by name, before anything changes)
    errors, refusals, stepped, forgot = [], [], False, False
    metric = TrajectoryNormwise(models["torch"])  # (Routed's output bias is one number)
    for step in range(RANDOM_LOOP_STEPS):
        forgets = step > 0 and rng.random() < 0.15
        micro = 2 if micro_always or (mode == "deferred" and rng.random() < 0.3) else 1
        clip = clip_always or (mode == "deferred" and rng.random() < 0.3)
        routes = [rng.choice([{}, {}, {"skip": (1,)}, {"empty": (0,)}]) for _ in range(micro)]

        def one_step(key):
            if before and not forgets:
                zero(key)
            for m, route in enumerate(routes):
                (routed_loss(models[key], 10 * step + m, **route) / micro).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(models[key].parameters(), 0.5)
            opts[key].step()
            if not before and not forgets:
                zero(key)

        lands_on_a_step = (before and forgets and stepped) or (not before and forgot)
        weights = [p.detach().clone() for p in models["forge"].parameters()]
        try:
            one_step("forge")
        except RuntimeError as e:
            unchanged = all(torch.equal(a, p) for a, p in zip(weights, models["forge"].parameters()))
            refusals.append((step, str(e), lands_on_a_step, unchanged))
            for key in opts:  # the loop's way out: zero_grad, and on
                opts[key].zero_grad()
            stepped = forgot = False
            continue
        for key in ("torch", "ulp"):
            one_step(key)
        stepped, forgot = True, forgets
        errors.append((metric.max_normwise(models["forge"], models["torch"]),
                       metric.max_normwise(models["ulp"], models["torch"])))
    return errors, refusals


@pytest.mark.parametrize("mode", ["deferred", "auto", "immediate"])
def test_random_loops_match_torch_or_are_refused_before_a_change(mode):
    """Random training loops (_random_loop) against torch.optim: after every step forge's
    weights are torch's within CONTRACT_RTOL or SUM_ORDER_FACTOR times torch's own move under
    1-ulp gradients (forge's kernel sums tokens in its own order; each tensor measured against
    the largest magnitude it has had, TrajectoryNormwise), and a step is refused only
    where the loop forgot a zero_grad (torch would step on the sum of two steps' gradients),
    by name, before any weight changed."""
    from tolerances import CONTRACT_RTOL, SUM_ORDER_FACTOR
    refused = 0
    for seed in range(RANDOM_LOOPS):
        errors, refusals = _random_loop(seed, mode)
        for step, (error, ulp) in enumerate(errors):
            assert error <= max(CONTRACT_RTOL, SUM_ORDER_FACTOR * ulp), (seed, step, error, ulp)
        for step, message, lands_on_a_step, unchanged in refusals:
            assert lands_on_a_step and "no zero_grad() since" in message, (seed, step, message)
            assert unchanged, (seed, step, message)
        refused += len(refusals)
    assert refused > 0  # (the draws include forgotten zero_grads: the refusal is exercised)
