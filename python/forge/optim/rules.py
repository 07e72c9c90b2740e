"""rules.py — the public optimizers: torch.optim's constructors, defaults and checks, one class
per rule. Each says, in classmethods (no instance state: calls.HparamsTable calls them on the
class), which libforge rule runs (_rule), which group keys fill its hyper-parameters (_fill)
and torch.optim's checks of a group (_check_group_rule); everything else is _ForgeOptimizer's
(optimizer.py).
"""
from __future__ import annotations

import math

import torch.nn as nn

from .. import _lib
from .. import muon
from .calls import as_float
from .optimizer import _ForgeOptimizer


def _refuse(**flags) -> None:
    """torch.optim options FORGE does not implement: a clear error instead of ignoring."""
    reasons = {"amsgrad": "amsgrad=True is not supported by FORGE (no max-of-second-moment "
                          "state); use amsgrad=False",
               "differentiable": "differentiable=True is not supported: FORGE updates weights "
                                 "in place outside autograd",
               "capturable": "capturable=True is not supported: capture FORGE steps as CUDA "
                             "graphs with forge.graphs.CUDAGraphStep, which gives every "
                             "replay its step number and lr"}
    for key, value in flags.items():
        if value:
            raise ValueError(reasons[key])


class AdamW(_ForgeOptimizer):
    """torch.optim.AdamW (decoupled weight decay), fused into backward."""

    _torch_name = "AdamW"

    def __init__(self, model: nn.Module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, *, maximize=False, foreach=None,
                 capturable=False, differentiable=False, fused=None, params=None, **forge):
        _refuse(amsgrad=amsgrad, differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, maximize=maximize), **forge)

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_ADAMW

    @classmethod
    def _fill(cls, hp, group):
        hp.beta1, hp.beta2 = (as_float(b, "betas") for b in group["betas"])
        hp.eps = as_float(group["eps"], "eps")
        hp.decoupled_weight_decay = 1


class Adam(AdamW):
    """torch.optim.Adam (L2 weight decay added to the gradient), fused into backward."""

    _torch_name = "Adam"

    def __init__(self, model: nn.Module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, *, maximize=False, foreach=None,
                 capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, params=None, **forge):
        _refuse(amsgrad=amsgrad, differentiable=differentiable, capturable=capturable)
        _ForgeOptimizer.__init__(self, model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay), **forge)

    @classmethod
    def _fill(cls, hp, group):
        super()._fill(hp, group)
        hp.decoupled_weight_decay = int(bool(group["decoupled_weight_decay"]))


class NAdam(_ForgeOptimizer):
    """torch.optim.NAdam (momentum_decay, decoupled_weight_decay), fused into backward."""

    _torch_name = "NAdam"
    _keeps_mu_product = True  # (state['mu_product'], as torch.optim.NAdam keeps it)

    def __init__(self, model: nn.Module, lr=2e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, momentum_decay=4e-3, decoupled_weight_decay=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False,
                 params=None, **forge):
        _refuse(differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize), **forge)

    @classmethod
    def _check_group_rule(cls, group):
        if not 0.0 <= as_float(group["momentum_decay"], "momentum_decay") < math.inf:
            raise ValueError(f"Invalid momentum_decay value: {group['momentum_decay']}")

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_NADAM

    @classmethod
    def _fill(cls, hp, group):
        hp.beta1, hp.beta2 = (as_float(b, "betas") for b in group["betas"])
        hp.eps = as_float(group["eps"], "eps")
        hp.momentum_decay = as_float(group["momentum_decay"], "momentum_decay")
        hp.decoupled_weight_decay = int(bool(group["decoupled_weight_decay"]))


class RAdam(_ForgeOptimizer):
    """torch.optim.RAdam (decoupled_weight_decay), fused into backward."""

    _torch_name = "RAdam"

    def __init__(self, model: nn.Module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, decoupled_weight_decay=False, *, foreach=None,
                 maximize=False, capturable=False, differentiable=False, params=None, **forge):
        _refuse(differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize), **forge)

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_RADAM

    @classmethod
    def _fill(cls, hp, group):
        hp.beta1, hp.beta2 = (as_float(b, "betas") for b in group["betas"])
        hp.eps = as_float(group["eps"], "eps")
        hp.decoupled_weight_decay = int(bool(group["decoupled_weight_decay"]))


class Lion(_ForgeOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
        c = β1·m + (1 − β1)·g;  w ← w·(1 − lr·wd) − lr·sign(c);  m ← β2·m + (1 − β2)·g
    torch.optim has no Lion; the defaults are the paper's (lr 1e-4, betas (0.9, 0.99))."""

    _torch_name = "Lion"

    def __init__(self, model: nn.Module, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, params=None, **forge):
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
            weight_decay=weight_decay, maximize=maximize), **forge)

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_LION

    @classmethod
    def _fill(cls, hp, group):
        hp.beta1, hp.beta2 = (as_float(b, "betas") for b in group["betas"])


class RMSprop(_ForgeOptimizer):
    """torch.optim.RMSprop (alpha, momentum, centered), fused into backward."""

    _torch_name = "RMSprop"

    def __init__(self, model: nn.Module, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0,
                 momentum=0.0, centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False, *, params=None, **forge):
        _refuse(differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
            centered=centered, maximize=maximize), **forge)

    @classmethod
    def _check_group_rule(cls, group):
        if not 0.0 <= as_float(group["momentum"], "momentum") < 1.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']} (must be in [0, 1))")
        if not 0.0 <= as_float(group["alpha"], "alpha") < 1.0:
            raise ValueError(f"Invalid alpha value: {group['alpha']} (must be in [0, 1))")

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_RMSPROP

    @classmethod
    def _layout_key(cls, group):
        return (_lib.RULE_RMSPROP, bool(group["centered"]),
                as_float(group["momentum"], "momentum") > 0)

    @classmethod
    def _fill(cls, hp, group):
        hp.alpha = as_float(group["alpha"], "alpha")
        hp.eps = as_float(group["eps"], "eps")
        hp.momentum = as_float(group["momentum"], "momentum")
        hp.centered = int(bool(group["centered"]))


class Adagrad(_ForgeOptimizer):
    """torch.optim.Adagrad (lr_decay, initial_accumulator_value), fused into backward."""

    _torch_name = "Adagrad"

    def __init__(self, model: nn.Module, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, params=None, **forge):
        _refuse(differentiable=differentiable)
        super().__init__(model, params, dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize),
            **forge)

    @classmethod
    def _check_group_rule(cls, group):
        if not 0.0 <= as_float(group["lr_decay"], "lr_decay") < math.inf:
            raise ValueError(f"Invalid lr_decay value: {group['lr_decay']}")
        if not 0.0 <= as_float(group["initial_accumulator_value"], "initial_accumulator_value") \
                < math.inf:
            raise ValueError(f"Invalid initial_accumulator_value value: "
                             f"{group['initial_accumulator_value']}")

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_ADAGRAD

    @classmethod
    def _fill(cls, hp, group):
        hp.lr_decay = as_float(group["lr_decay"], "lr_decay")
        hp.eps = as_float(group["eps"], "eps")
        hp.initial_accumulator_value = as_float(group["initial_accumulator_value"],
                                                 "initial_accumulator_value")


class SGD(_ForgeOptimizer):
    """torch.optim.SGD (momentum > 0: SGD with momentum, dampening, nesterov), fused into
    backward."""

    _torch_name = "SGD"
    _torch_keeps_step = False  # (its momentum_buffer alone: made at the first step)

    def __init__(self, model: nn.Module, lr=1e-3, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False, *, maximize=False, foreach=None,
                 differentiable=False, fused=None, params=None, **forge):
        _refuse(differentiable=differentiable)
        super().__init__(model, params, dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize), **forge)

    @classmethod
    def _check_group_rule(cls, group):
        momentum = as_float(group["momentum"], "momentum")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']} "
                             "(FORGE: must be in [0, 1))")
        if not 0.0 <= as_float(group["dampening"], "dampening") <= 1.0:
            raise ValueError(f"Invalid dampening value: {group['dampening']} (must be in [0, 1])")
        if group["nesterov"] and (momentum <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_SGD_MOMENTUM if as_float(group["momentum"], "momentum") > 0 \
            else _lib.RULE_SGD

    @classmethod
    def _fill(cls, hp, group):
        if hp.rule == _lib.RULE_SGD_MOMENTUM:
            hp.momentum = as_float(group["momentum"], "momentum")
            hp.dampening = as_float(group["dampening"], "dampening")
            hp.nesterov = int(bool(group["nesterov"]))


class Muon(_ForgeOptimizer):
    """torch.optim.Muon for the hidden layers' 2-d weights and torch.optim.AdamW for every other
    parameter, in one optimizer (one step(), one state_dict()), fused into backward.

    Muon's momentum is updated from each dW tile inside the weight-gradient GEMM (its only
    per-weight state: no gradient is kept); as soon as a weight's momentum is complete, its
    direction is orthogonalized (Newton–Schulz, bf16 matmuls) and applied as torch.optim.Muon
    applies it (muon.py). The Muon part's keyword names and defaults are torch.optim.Muon's;
    the AdamW part's are torch.optim.AdamW's, prefixed adamw_.

    Which parameters take Muon: with params=None, the weights of the model's nn.Linear (and
    transformers Conv1D) layers except its output head (model.get_output_embeddings(), where
    the model has one); everything else takes AdamW. With params=, each param group says so
    with "use_muon" (default True; Muon groups must hold 2-d parameters only)."""

    _torch_name = "Muon"
    _torch_keeps_step = False  # (torch.optim.Muon's state is its momentum_buffer alone)

    def __init__(self, model: nn.Module, lr=1e-3, weight_decay=0.1, momentum=0.95,
                 nesterov=True, ns_coefficients=muon.NS_COEFFICIENTS, eps=muon.EPS,
                 ns_steps=muon.NS_STEPS, adjust_lr_fn=None, *, adamw_lr=1e-3,
                 adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=1e-2,
                 params=None, **forge):
        if forge.get("master_weights"):
            raise ValueError("Muon: master_weights=True is not supported (the Muon weight update "
                             "is torch.optim.Muon's, in the weight's own dtype)")
        if params is None and isinstance(model, nn.Module):
            params = muon.default_groups(model, dict(
                use_muon=False, lr=adamw_lr, eps=adamw_eps, weight_decay=adamw_weight_decay,
                betas=tuple(adamw_betas) if isinstance(adamw_betas, list) else adamw_betas))
        super().__init__(model, params, dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, list)
            else ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            betas=tuple(adamw_betas) if isinstance(adamw_betas, list) else adamw_betas,
            use_muon=True), **forge)

    @classmethod
    def _check_group_rule(cls, group):
        if not isinstance(group["use_muon"], bool):
            raise ValueError(f"Invalid use_muon value: {group['use_muon']!r} (True or False)")
        if not group["use_muon"]:
            return
        for p in group["params"]:
            if p.dim() != 2:
                raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter "
                                 f"with size: {p.size()} (FORGE: give it a param group with "
                                 "use_muon=False, which takes AdamW)")
        if not 0.0 <= as_float(group["momentum"], "momentum") <= 1.0:
            raise ValueError(f"momentum should be in [0, 1] but is: {group['momentum']}")
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"Invalid nesterov value: {group['nesterov']!r} (True or False)")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
            raise ValueError(f"Invalid ns_steps value: {steps!r} (an int in [1, 100))")
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3 or not all(
                math.isfinite(as_float(c, "ns_coefficients")) for c in coefficients):
            raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (three finite floats)")
        if group["adjust_lr_fn"] not in muon.ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not "
                             "supported")

    @classmethod
    def _rule(cls, group):
        return _lib.RULE_MUON if group["use_muon"] else _lib.RULE_ADAMW

    @classmethod
    def _fill(cls, hp, group):
        if group["use_muon"]:
            hp.momentum = as_float(group["momentum"], "momentum")
            hp.nesterov = int(group["nesterov"])
        else:
            AdamW._fill(hp, group)

