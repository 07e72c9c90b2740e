"""reference.py — what forge.optim is compared against.

- ordered(model): every nn.Linear's weight gradient summed over tokens one at a time
  (acc += outer(dy[t], x[t]), each product rounded, in token order) — the order of
  FORGE's CPU backend — so torch.optim gets the same dW as the fused step consumed and
  the comparison isolates the update itself ("up to GEMM summation order"). transformers'
  Conv1D (W: [in, out], dW = XᵀdY) likewise: acc += outer(x[t], dy[t]).
- LionReference: Lion as written in the paper (Chen et al. 2023, Algorithm 2), since
  torch.optim has none.
- trajectories(): trains copies of one model side by side (forge, torch on ordered dW,
  the same with every gradient perturbed by one ulp, and stock torch) and returns the
  largest normwise weight differences between them over all steps.
"""
from __future__ import annotations

import copy
import types
import warnings
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import forge
from forge._linear import conv1d_class
from forge.optim import FactoredGrad
from tiny_models import lm_loss


class OrderedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw = torch.zeros_like(weight)                  # [out, in]
        for t in range(x2.shape[0]):
            dw += torch.outer(dy2[t], x2[t])           # rounded product, then rounded sum
        db = dy2.sum(0) if ctx.has_bias else None
        return dy.matmul(weight), dw, db


def _ordered_forward(self, x):
    return OrderedLinearFunction.apply(x, self.weight, self.bias)


def _conv1d_forward_backward(x, weight, bias, dy, acc):
    """Conv1D (y = x·W + b, W: [in, out]) as torch.addmm computes it: the forward, and in
    backward (dy given) dX, db, and dW = XᵀdY added into `acc` token by token."""
    x2 = x.reshape(-1, x.shape[-1])
    if dy is None:
        return torch.addmm(bias, x2, weight).view(x.shape[:-1] + (weight.shape[1],))
    dy2 = dy.reshape(-1, dy.shape[-1])
    for t in range(x2.shape[0]):
        acc += torch.outer(x2[t], dy2[t])              # rounded product, then rounded sum
    return dy2.mm(weight.t()).view(x.shape), dy2.sum(0)


class OrderedConv1DFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return _conv1d_forward_backward(x, weight, bias, None, None)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dw = torch.zeros_like(weight)                  # [in, out]
        dx, db = _conv1d_forward_backward(x, weight, None, dy, dw)
        return dx, dw, db


def _ordered_conv1d_forward(self, x):
    return OrderedConv1DFunction.apply(x, self.weight, self.bias)


def is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's linear layers), where transformers is imported."""
    conv1d = conv1d_class()
    return conv1d is not None and isinstance(m, conv1d)


def ordered(model: nn.Module) -> nn.Module:
    """The layers FORGE fuses (nn.Linear keeping its class's forward, Conv1D) sum dW in
    token order; a subclass with its own forward keeps it (FORGE leaves it to autograd)."""
    for m in model.modules():
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
            m.forward = types.MethodType(_ordered_forward, m)
        elif is_conv1d(m):
            m.forward = types.MethodType(_ordered_conv1d_forward, m)
    return model


class LionReference(torch.optim.Optimizer):
    """Lion, the paper's update: c = β1·m + (1−β1)·g; w ← w − lr·(sign(c) + wd·w);
    m ← β2·m + (1−β2)·g (decay applied as w·(1 − lr·wd), which is the same)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay,
                                      maximize=maximize))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                c = m * beta1 + g * (1 - beta1)
                p.add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(beta2).add_(g, alpha=1 - beta2)


def torch_optimizer(name: str, params, **kwargs):
    if name == "Lion":
        return LionReference(params, **kwargs)
    return getattr(torch.optim, name)(params, **kwargs)


def normwise(a: torch.Tensor, b: torch.Tensor, scale: Optional[float] = None) -> float:
    """max|a − b| / max|b| over one tensor (see tolerances.py for why not element-wise), or
    / scale where given."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item() if scale is None else scale
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def max_normwise(model_a: nn.Module, model_b: nn.Module) -> float:
    return max(normwise(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))


class TrajectoryNormwise:
    """normwise with each tensor's scale the largest max|b| it has had so far (observe() after
    each step). A small tensor whose values pass near zero (a scalar bias changing sign) would
    otherwise divide an update's rounding, an ulp of the values it came from, by almost
    nothing."""

    def __init__(self, model_b: nn.Module):
        self.scales = [0.0 for _ in model_b.parameters()]
        self.observe(model_b)

    def observe(self, model_b: nn.Module) -> None:
        self.scales = [max(s, b.detach().abs().max().item())
                       for s, b in zip(self.scales, model_b.parameters())]

    def max_normwise(self, model_a: nn.Module, model_b: nn.Module) -> float:
        self.observe(model_b)
        return max(normwise(a, b, s)
                   for a, b, s in zip(model_a.parameters(), model_b.parameters(), self.scales))


def trajectories(make_model: Callable[[], nn.Module], name: str, kwargs: Dict, device: str,
                 steps: int = 8, loss_fn=lm_loss, forge_options: Optional[Dict] = None,
                 forge_model_setup: Optional[Callable[[nn.Module], None]] = None,
                 make_schedule: Optional[Callable] = None, params_fn=None,
                 micro_batches: int = 1, schedule_before_step: bool = False
                 ) -> Dict[str, float]:
    """Trains forge / ordered / ordered+1ulp / stock copies of one model in lockstep and
    returns the largest normwise differences over every parameter and step.
    `forge_options` go to the forge optimizer only; `params_fn(model)` gives param groups;
    `micro_batches` > 1 accumulates that many backward passes per step (loss / n each);
    `schedule_before_step`: the schedule steps between backward and opt.step().
    errors["forge_formed_dw"] is 1 where some step of forge's formed a weight's dW with
    torch's GEMM (a deferred store kept it dense), else 0."""
    torch.manual_seed(0)
    base = make_model().to(device)
    models = {"forge": copy.deepcopy(base), "ordered": ordered(copy.deepcopy(base)),
              "ulp": ordered(copy.deepcopy(base)), "stock": copy.deepcopy(base)}
    if forge_model_setup is not None:
        forge_model_setup(models["forge"])
    params = params_fn or (lambda m: m.parameters())
    opts = {"forge": getattr(forge.optim, name)(models["forge"], **kwargs,
                                                **(forge_options or {}),
                                                **({"params": params_fn(models["forge"])}
                                                   if params_fn else {}))}
    for key in ("ordered", "ulp", "stock"):
        opts[key] = torch_optimizer(name, params(models[key]), **kwargs)
    schedules = {k: make_schedule(o) for k, o in opts.items()} if make_schedule else {}
    errors = dict.fromkeys(("forge_vs_ordered", "ulp_vs_ordered", "stock_vs_ordered",
                            "forge_vs_stock"), 0.0)
    formed_dw = False
    for step in range(steps):
        for key, model in models.items():
            for micro in range(micro_batches):
                loss = loss_fn(model, step * micro_batches + micro, device)
                (loss / micro_batches if micro_batches > 1 else loss).backward()
            if key == "ulp":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1 + 2 ** -23)
            if key == "forge" and any(isinstance(p.grad, FactoredGrad) and p.grad.dense is not None
                                      for p in model.parameters()):
                formed_dw = True  # (a deferred store kept dW, formed by torch's GEMM)
            if key in schedules and schedule_before_step:
                with warnings.catch_warnings():  # (torch's: a scheduler stepped first)
                    warnings.simplefilter("ignore")
                    schedules[key].step()
            opts[key].step()
            opts[key].zero_grad()
            if key in schedules and not schedule_before_step:
                schedules[key].step()
        pairs = {"forge_vs_ordered": ("forge", "ordered"), "ulp_vs_ordered": ("ulp", "ordered"),
                 "stock_vs_ordered": ("stock", "ordered"), "forge_vs_stock": ("forge", "stock")}
        for what, (a, b) in pairs.items():
            errors[what] = max(errors[what], max_normwise(models[a], models[b]))
    errors["forge_formed_dw"] = 1.0 if formed_dw else 0.0
    return errors


def assert_contract(errors: Dict[str, float], device: str,
                    forge_sums_like: str = "ordered") -> None:
    """forge within CONTRACT_RTOL of torch.optim, or within what torch.optim itself moves
    under a 1-ulp gradient perturbation (same summation order) or a change of summation
    order. `forge_sums_like`: which reference sums dW as forge did — "ordered" (the fused
    CPU kernel), "stock" (torch's GEMM: accumulate_grad mode, the no-hook fallback); on
    CUDA the fused kernel has its own order, checked against the order bound, and so is a
    CPU run where some step formed dW with torch's GEMM (errors["forge_formed_dw"]: a
    deferred store kept dW, as the default mode's first step does where X and dY outweigh
    it): that step summed as stock did, the others as ordered."""
    from tolerances import CONTRACT_RTOL, SUM_ORDER_FACTOR, ULP_SENSITIVITY_FACTOR
    ulp_bound = max(CONTRACT_RTOL, ULP_SENSITIVITY_FACTOR * errors["ulp_vs_ordered"])
    order_bound = max(CONTRACT_RTOL, SUM_ORDER_FACTOR * errors["stock_vs_ordered"])
    if forge_sums_like == "stock":
        assert errors["forge_vs_stock"] <= ulp_bound, errors
    elif device == "cpu" and not errors.get("forge_formed_dw"):
        assert errors["forge_vs_ordered"] <= ulp_bound, errors
        assert errors["forge_vs_stock"] <= order_bound, errors
    else:
        assert errors["forge_vs_ordered"] <= order_bound, errors
        assert errors["forge_vs_stock"] <= order_bound, errors


class _ConcatOrderedLinearFunction(OrderedLinearFunction):
    """Like OrderedLinearFunction, but the weight's dW continues one sum across backwards
    (weight._ordered_acc), token by token: the order of FORGE's fused step over the
    concatenated tokens of a step's micro-batches. The weight gets no .grad from autograd;
    move_ordered_grads() puts the sums there before the loop's clip / unscale / step."""

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        acc = getattr(weight, "_ordered_acc", None)
        if acc is None:
            acc = weight._ordered_acc = torch.zeros_like(weight)
        for t in range(x2.shape[0]):
            acc += torch.outer(dy2[t], x2[t])
        db = dy2.sum(0) if ctx.has_bias else None
        return dy.matmul(weight), None, db


def _concat_forward(self, x):
    return _ConcatOrderedLinearFunction.apply(x, self.weight, self.bias)


class _ConcatOrderedConv1DFunction(torch.autograd.Function):
    """_ConcatOrderedLinearFunction for a Conv1D: dW = XᵀdY continues weight._ordered_acc."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return _conv1d_forward_backward(x, weight, bias, None, None)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        acc = getattr(weight, "_ordered_acc", None)
        if acc is None:
            acc = weight._ordered_acc = torch.zeros_like(weight)
        dx, db = _conv1d_forward_backward(x, weight, None, dy, acc)
        return dx, None, db


def _concat_conv1d_forward(self, x):
    return _ConcatOrderedConv1DFunction.apply(x, self.weight, self.bias)


def ordered_concat(model: nn.Module) -> nn.Module:
    """The reference of the training-loop tests (test_loop.py): Linear (and Conv1D) weight
    gradients summed in FORGE's order over all micro-batches; model.move_ordered_grads() hands
    them to .grad."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) or is_conv1d(m)]
    for m in linears:
        forward = _concat_conv1d_forward if is_conv1d(m) else _concat_forward
        m.forward = types.MethodType(forward, m)

    def move_ordered_grads():
        for m in linears:
            acc = getattr(m.weight, "_ordered_acc", None)
            if acc is not None:
                m.weight.grad = acc
                del m.weight._ordered_acc

    model.move_ordered_grads = move_ordered_grads
    return model


def nothing_held_after_step(model: nn.Module, opt) -> bool:
    """After opt.step(): no parameter holds gradient memory. A fused weight keeps a
    ConsumedGrad (no storage), where torch.optim's gradient would stay until zero_grad; every
    other .grad is None."""
    info = opt.inspect()
    return all(p.grad is None or (info[p].path == "fused"
                                  and isinstance(p.grad, forge.optim.ConsumedGrad))
               for p in model.parameters())


def stock_loop_error(make_forge, make_torch, loop, steps_device: str = "cpu",
                     make_model: Optional[Callable[[], nn.Module]] = None):
    """(forge vs stock torch, bound): the same loop with forge and with torch.optim, on copies
    of one model (make_model's, by default TinyTransformerForLoops'). The bound is
    CONTRACT-style, whichever is largest: LOOP_RTOL; ULP_SENSITIVITY_FACTOR times the most
    torch moves under one-ulp noise (PerturbedByOneUlp, ULP_PROBES sign draws: a loop near a
    zero gradient carries one ulp chaotically, so one draw is no estimate of its size); or,
    since forge sums dW in its own order (immediate updates are the kernel's, deferred dense
    gradients torch's GEMM), SUM_ORDER_FACTOR times what torch moves when only that order
    changes (torch.optim on ordered(), the CPU kernel's order, against stock)."""
    from tolerances import LOOP_RTOL, SUM_ORDER_FACTOR, ULP_PROBES, ULP_SENSITIVITY_FACTOR
    torch.manual_seed(0)
    base = (make_model or TinyTransformerForLoops)()
    forge_model, stock, token_ordered = (copy.deepcopy(base) for _ in range(3))
    loop(forge_model, make_forge(forge_model), steps_device)
    loop(stock, make_torch(stock.parameters()), steps_device)
    ulp_moves = []
    for seed in range(ULP_PROBES):
        ulp = copy.deepcopy(base)
        loop(ulp, PerturbedByOneUlp(make_torch(ulp.parameters()), seed), steps_device)
        ulp_moves.append(max_normwise(ulp, stock))
    ordered(token_ordered)
    loop(token_ordered, make_torch(token_ordered.parameters()), steps_device)
    return (max_normwise(forge_model, stock),
            max(LOOP_RTOL, ULP_SENSITIVITY_FACTOR * max(ulp_moves),
                SUM_ORDER_FACTOR * max_normwise(token_ordered, stock)))


class PerturbedByOneUlp:
    """A torch.optim optimizer whose step() is perturbed by one ulp on both sides: it first
    scales every gradient by 1 + 2^-23 (a one-ulp change of the gradient torch consumes, after
    the loop's own clip and unscale, which would otherwise cancel a perturbation made before
    them), then moves every element of each parameter it stepped one ulp up or down (a fixed
    random sign per element and step): where forge's update rounds differently from torch's
    kernels (their association and FMA, which vary with the host's vector unit), its weights
    differ by that much. AdamW's direction is nearly invariant to the gradient's scale, so
    the second part is what measures how far such a loop carries a one-ulp difference."""

    def __init__(self, opt, seed: int = 0):
        self.opt = opt
        self.param_groups, self.state = opt.param_groups, opt.state
        self._signs = torch.Generator().manual_seed(seed)

    def step(self, *args, **kwargs):
        stepped = [p for group in self.param_groups for p in group["params"]
                   if p.grad is not None]
        for p in stepped:
            p.grad.mul_(1 + 2 ** -23)
        result = self.opt.step(*args, **kwargs)
        with torch.no_grad():
            for p in stepped:
                up = torch.rand(p.shape, generator=self._signs).to(p.device) < 0.5
                p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf).to(p.dtype)))
        return result

    def zero_grad(self, *args, **kwargs):
        return self.opt.zero_grad(*args, **kwargs)


def TinyTransformerForLoops():
    from tiny_models import TinyTransformer
    return TinyTransformer()
