"""lean.py — memory-lean activations: recompute the cheap element-wise parts of a decoder in
backward instead of keeping their intermediates; and a cross entropy that keeps no fp32 copy.

Without activation checkpointing, what a Llama-style layer keeps for backward is mostly
element-wise intermediates and the inputs of its matrix products. Hugging Face's RMSNorm
keeps an fp32 copy of its input and the bf16 normalized tensor (3x the input's bytes in
bf16); the SwiGLU product silu(gate) * up keeps silu's output besides gate and up; the
Linears after a norm keep its output, down_proj keeps the product. On Llama-3.1-8B at seq
512 this file removes 54.5 of the ~103 MB a layer keeps, and 140 MB at the loss (measured
with torch.cuda.max_memory_allocated on one H200, forge-bench's lean modes).

enable_lean_activations(model) wraps
  - every RMSNorm (a module whose class name ends in "RMSNorm", with one direct parameter and
    no children) so that it keeps only its input,
  - every SwiGLU MLP (Hugging Face's Llama, Mistral, Qwen2 and Qwen3 MLPs with a SiLU
    activation, and any class declaring forge_lean_role = "swiglu_mlp") so that the product
    keeps only gate and up,
and recomputes the rest once in backward with the module's own code (_Recomputation). With
forge.optim, the Linears that read a norm's output or the product (q/k/v, gate/up,
down_proj) keep those inputs instead and take what they read from the same recomputation
(_linear.RECOMPUTE_ATTR). So the gradients are bit-identical to the unwrapped model's in bf16:
the same operations in the same order, run twice. The cost is the recomputation (element-wise,
small next to the layer's GEMMs) and its host time, which a host-bound step pays in full. For
the known norm classes (Llama, Mistral, Qwen2, Qwen3, and any class declaring
forge_lean_role = "rms_norm"; they also keep their
fp32 rsqrt per row, so backward does not redo the reduction) and a SiLU product (nn.SiLU, or
an activation that computes F.silu bit for bit, such as transformers 5's SiLUActivation) the
backward is written out with autograd's own operations (checked bit for bit by the tests on
torch 2.4.1 and 2.15); any other wrapped module costs one nested autograd call. On a
host-bound CPU step (16 tiny HF Llama layers, forge.optim) lean costs ~2 ms over plain (3.4
before those two changes) and 47 more aten operations (292 before).

A model class of one's own opts in with a class attribute: forge_lean_role = "rms_norm" for
a norm computing weight * (x32 · rsqrt(mean(x32²) + self.eps)).to(x.dtype) like Llama's, or
"swiglu_mlp" for down_proj(F.silu(gate_proj(x)) * up_proj(x)) (forge.tools.models does).

It composes with activation checkpointing and with forge.optim (no Linear is wrapped: the
fused weight-gradient path is untouched).

cross_entropy(logits, targets) is F.cross_entropy on fp32 logits, computed in chunks of rows
from the logits as given: it keeps the bf16 logits for backward instead of the fp32
log-probabilities.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from forge._linear import RECOMPUTE_ATTR, autocast_dtype, refuse_create_graph


class _Recomputation:
    """fn recomputed once in backward, under autograd, for everyone who needs it there: the
    Linears that read its output (value(): forge.optim's Linears keep fn's inputs instead of
    its output, see _linear.RECOMPUTE_ATTR) and the _RecomputeInBackward that computed it in
    forward (grads()). The graph lives from the first of those calls to grads().
    `params`: the parameters fn reads (as module attributes): the recompute differentiates
    with respect to these very objects."""

    def __init__(self, fn: Callable, params, device_type: str):
        self.fn, self.params, self.device_type = fn, params, device_type
        self.autocast = autocast_dtype(device_type)
        self.needs = None          # per activation and parameter: wants a gradient (forward)
        self.leaves = self.out = None

    def __call__(self, *activations):  # forward, without a graph
        return self.fn(*activations)

    def _build(self, activations) -> None:
        self.leaves = [t.detach().requires_grad_(need) for t, need in zip(activations, self.needs)]
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=self.autocast,
                                                 enabled=self.autocast is not None):
            self.out = self.fn(*self.leaves)

    def value(self, *activations) -> torch.Tensor:
        if self.out is None:
            self._build(activations)
        return self.out.detach()

    def grads(self, activations, grad) -> tuple:
        if self.out is None:
            self._build(activations)
        wanted = [t for t, need in zip(self.leaves + list(self.params), self.needs) if need]
        found = torch.autograd.grad(self.out, wanted, grad, allow_unused=True) if wanted else ()
        self.leaves = self.out = None  # the graph goes; a second backward builds it again
        found = iter(found)
        return tuple(next(found) if need else None for need in self.needs)


class _SiluProduct(_Recomputation):
    """silu(gate) * up, whose backward is written out with autograd's own formulas for it
    (MulBackward0: grad * other; SiluBackward0: aten.silu_backward), so the same bits come out
    without a nested autograd call (~0.1 ms of host time each). Only outside autocast."""

    def __init__(self, device_type: str):
        super().__init__(_silu_product, (), device_type)
        self.act = None

    def _build(self, activations) -> None:
        gate, up = activations
        with torch.no_grad():
            self.act = F.silu(gate)
            self.out = self.act * up

    def grads(self, activations, grad) -> tuple:
        if self.out is None:
            self._build(activations)
        gate, up = activations
        grad_gate = (torch.ops.aten.silu_backward(grad * up, gate) if self.needs[0] else None)
        grad_up = grad * self.act if self.needs[1] else None
        self.act = self.out = None
        return grad_gate, grad_up


class _RMSNormRecomputation(_Recomputation):
    """Llama's / Qwen's / Mistral's / a declared rms_norm's: weight * (x32 · rstd) rounded to x's
    dtype, x32 = x in fp32, rstd = rsqrt(mean(x32²) + eps) (the classes' own operations, in
    their order). Its activations are x and rstd (rstd(), computed before the Function, 4
    bytes per row): backward rebuilds x32 and the normalized x from them in two operations
    instead of redoing the reduction. Its backward is written out with the operations autograd
    runs for that forward (MulBackward0, ToCopyBackward0, RsqrtBackward0, MeanBackward1,
    PowBackward0), so the same bits come out without a nested autograd call
    (tests/python/test_lean.py checks the bits on every torch it runs on). Only outside
    autocast."""

    def __init__(self, dense_forward: Callable, weight: torch.Tensor, eps: float,
                 device_type: str):
        super().__init__(dense_forward, (weight,), device_type)
        self.weight, self.eps = weight, eps
        self.parts = None  # x32, the normalized x in x's dtype (backward)
        self.forward_x32 = None  # x32 from rstd() to __call__, within one forward
        # self.out (the base class's): the norm's output recomputed for the Linears (backward)

    def rstd(self, x: torch.Tensor) -> torch.Tensor:
        """rstd for the forward; the fp32 x it computes waits for __call__ (right after, in
        the Function's forward), which then drops it."""
        with torch.no_grad():
            self.forward_x32 = x.to(torch.float32)
            return torch.rsqrt(self.forward_x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def _parts(self, x: torch.Tensor, rstd: torch.Tensor):
        if self.parts is None:
            with torch.no_grad():
                x32 = x.to(torch.float32)
                self.parts = x32, (x32 * rstd).to(x.dtype)
        return self.parts

    def __call__(self, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        # forward: nothing kept (x32 and the normalized x are what this saves)
        x32 = self.forward_x32 if self.forward_x32 is not None else x.to(torch.float32)
        self.forward_x32 = None
        return self.weight * (x32 * rstd).to(x.dtype)

    def value(self, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        # NOTE: made once for every Linear that reads it (q, k and v read the same norm
        # output): two multiplies fewer per attention norm, one per MLP norm
        if self.out is None:
            normed = self._parts(x, rstd)[1]
            with torch.no_grad():
                self.out = self.weight * normed
        return self.out

    def grads(self, activations, grad) -> tuple:
        x, rstd = activations
        x32, normed = self._parts(x, rstd)
        self.parts = self.out = None
        need_x, _, need_weight = self.needs  # rstd: no gradient (computed without a graph)
        with torch.no_grad():
            grad_weight = (grad * normed).sum_to_size(self.weight.shape) if need_weight else None
            grad_x = None
            if need_x:
                grad_n = (grad * self.weight).to(torch.float32)
                grad_rstd = (grad_n * x32).sum_to_size(rstd.shape)
                grad_mean = (-0.5 * grad_rstd) * rstd.pow(3)
                # NOTE: PowBackward0's grad * (2 * x32.pow(1)) without the pow: x.pow(1) is x,
                # bit for bit, and one kernel launch fewer.
                grad_x = grad_n * rstd + (grad_mean / x32.shape[-1]) * (2 * x32)
                grad_x = grad_x.to(x.dtype)
        return grad_x, None, grad_weight


class _RecomputeInBackward(torch.autograd.Function):
    """apply(recomputation, n, *activations, *params): recomputation(*activations) without a
    graph in forward; in backward the gradients with respect to the n activations and the
    parameters from recomputation.grads(). The parameters' gradients leave through this
    Function to autograd's usual accumulation (and forge.optim's hooks there)."""

    @staticmethod
    def forward(ctx, recomputation: _Recomputation, n: int, *tensors):
        recomputation.needs = ctx.needs_input_grad[2:]
        ctx.recomputation = recomputation
        ctx.save_for_backward(*tensors[:n])
        with torch.no_grad():
            return recomputation(*tensors[:n])

    @staticmethod
    def backward(ctx, grad):
        refuse_create_graph("forge.lean's recomputation",
                            "Run that model without enable_lean_activations for it")
        return (None, None) + ctx.recomputation.grads(ctx.saved_tensors, grad)


def _is_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm")
            and len(list(module.children())) == 0
            and len(list(module.parameters(recurse=False))) == 1)


# Hugging Face MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)): the
# rewrite below replaces that forward, so only classes known to have it are wrapped.
_HF_SWIGLU_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


# RMSNorm classes whose forward is _RMSNormRecomputation's formula, and their eps attribute.
_KNOWN_RMS_NORMS = {"LlamaRMSNorm": "variance_epsilon", "MistralRMSNorm": "variance_epsilon",
                    "Qwen2RMSNorm": "variance_epsilon", "Qwen3RMSNorm": "variance_epsilon"}


def _declared_role(module: nn.Module):
    return getattr(type(module), "forge_lean_role", None)


def _known_rms_norm_eps(module: nn.Module):
    if _declared_role(module) == "rms_norm":
        return module.eps
    attr = _KNOWN_RMS_NORMS.get(type(module).__name__)
    return getattr(module, attr, None) if attr is not None else None


def _is_swiglu_mlp(module: nn.Module) -> bool:
    if _declared_role(module) == "swiglu_mlp":  # declares F.silu, no act_fn
        return True
    if type(module).__name__ not in _HF_SWIGLU_MLPS:
        return False
    if getattr(getattr(module, "config", None), "pretraining_tp", 1) != 1:
        return False  # older LlamaMLPs split the projections then
    linears = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    return (all(isinstance(m, nn.Linear) for m in linears)
            and (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _acts_as_silu(act: nn.Module) -> bool:
    """Whether the activation module computes F.silu, forward and backward, bit for bit: nn.SiLU,
    or a module without parameters or buffers that gives F.silu's bits and gradient bits on a
    probe of 4096 values in fp32 and in bf16 (transformers 5's SiLUActivation calls F.silu; an
    x · sigmoid(x) rounds differently and is left to the generic recomputation)."""
    if type(act) is nn.SiLU:
        return True
    if any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
        return False
    g = torch.Generator().manual_seed(0)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(4096, generator=g) * 6).to(dtype)
            grad = torch.randn(4096, generator=g).to(dtype)
            with torch.enable_grad():
                leaf = x.clone().requires_grad_(True)
                y = act(leaf)
                (dx,) = torch.autograd.grad(y, leaf, grad)
            if (y.dtype != dtype
                    or not torch.equal(_bits(y.detach()), _bits(F.silu(x)))
                    or not torch.equal(_bits(dx), _bits(torch.ops.aten.silu_backward(grad, x)))):
                return False
    except Exception:  # cannot run on a CPU probe: not known to be F.silu
        return False
    return True


def _lean_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return self._forge_dense_forward(x)
    (weight,) = self.parameters(recurse=False)
    if self._forge_norm_eps is not None and autocast_dtype(x.device.type) is None:
        recomputation = _RMSNormRecomputation(self._forge_dense_forward, weight,
                                              self._forge_norm_eps, x.device.type)
        activations = (x, recomputation.rstd(x))
    else:
        recomputation = _Recomputation(self._forge_dense_forward, (weight,), x.device.type)
        activations = (x,)
    y = _RecomputeInBackward.apply(recomputation, len(activations), *activations, weight)
    # NOTE: forge.optim's Linears that read y keep x (and rstd: kept here anyway) instead of y
    # and get y in their backward from the same recomputation as this norm's backward. That
    # is before this norm's weight can have changed: its update waits for this norm's
    # backward, which waits for theirs.
    setattr(y, RECOMPUTE_ATTR, (recomputation.value, activations))
    return y


def _activation_product(act: Callable, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _lean_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled():
        return self.down_proj(self._forge_product_fn(gate, up))
    if self._forge_product_fn is _silu_product and autocast_dtype(gate.device.type) is None:
        recomputation = _SiluProduct(gate.device.type)
    else:
        recomputation = _Recomputation(self._forge_product_fn, (), gate.device.type)
    product = _RecomputeInBackward.apply(recomputation, 2, gate, up)
    setattr(product, RECOMPUTE_ATTR, (recomputation.value, (gate, up)))  # for down_proj
    return self.down_proj(product)


def enable_lean_activations(model: nn.Module) -> Dict[str, int]:
    """Wraps model's RMSNorms and SwiGLU MLPs in place (see the file header); returns how many
    of each. Calling it again changes nothing. A model saved whole (torch.save(model)) loads
    wrapped, where forge can be imported."""
    counts = {"rms_norm": 0, "swiglu_mlp": 0}
    for module in model.modules():
        if "_forge_lean" in module.__dict__:
            counts[module._forge_lean] += 1
        elif _is_rms_norm(module):
            # The class's own forward, bound: the recompute runs the module's own code.
            module._forge_dense_forward = module.forward
            # Known classes get the written-out backward (_RMSNormRecomputation).
            module._forge_norm_eps = _known_rms_norm_eps(module)
            # NOTE: a partial, not a bound method: torch.save of the whole model pickles it
            # by reference to this file, and the loaded model stays wrapped (a bound method
            # pickles as getattr(module, its name), which the module's class does not have).
            module.forward = functools.partial(_lean_norm_forward, module)
            module._forge_lean = "rms_norm"
            counts["rms_norm"] += 1
        elif _is_swiglu_mlp(module):
            act = getattr(module, "act_fn", None)
            # NOTE: an activation that is F.silu gets _SiluProduct's written-out backward
            # (nn.SiLU; transformers 5's SiLUActivation, whose forward calls F.silu); any
            # other takes the generic recomputation and its nested autograd call.
            module._forge_product_fn = (_silu_product if act is None or _acts_as_silu(act)
                                        else functools.partial(_activation_product, act))
            module.forward = functools.partial(_lean_mlp_forward, module)  # (as the norm's)
            module._forge_lean = "swiglu_mlp"
            counts["swiglu_mlp"] += 1
    return counts


# ---- the loss --------------------------------------------------------------------------------

# NOTE: fp32 work per chunk of rows: 32 MiB (65 rows of Llama-3's 128256-entry vocabulary).
_CE_CHUNK_BYTES = 32 << 20


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean next-token cross entropy over the rows whose target is not ignore_index, computed
    in fp32 chunks of rows. Keeps the logits as given (bf16: 2 bytes per entry) and one fp32
    log-sum-exp per row, where F.cross_entropy on fp32 logits keeps the fp32 log-probabilities
    (4 bytes per entry) and its backward holds three fp32 tensors of that size at once."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int):
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
        rows = flat.shape[0]
        chunk = max(1, _CE_CHUNK_BYTES // (4 * vocab))
        valid = flat_targets != ignore_index
        safe_targets = torch.where(valid, flat_targets, torch.zeros_like(flat_targets))
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for i in range(0, rows, chunk):
            part = flat[i:i + chunk].float()
            lse[i:i + chunk] = torch.logsumexp(part, dim=-1)
            picked = part.gather(1, safe_targets[i:i + chunk, None]).squeeze(1)
            total += ((lse[i:i + chunk] - picked) * valid[i:i + chunk]).sum()
        count = valid.sum()
        ctx.save_for_backward(logits, safe_targets, valid, lse, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, grad):
        refuse_create_graph("forge.lean.cross_entropy", "Use F.cross_entropy for that loss")
        logits, safe_targets, valid, lse, count = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        out = torch.empty_like(flat)
        # d loss / d logit = (softmax - onehot(target)) / count on valid rows, 0 on the others.
        row_scale = valid.float() * (grad / count)
        for i in range(0, flat.shape[0], ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            p = (flat[rows].float() - lse[rows, None]).exp_()
            p.scatter_add_(1, safe_targets[rows, None],
                           torch.full_like(lse[rows, None], -1.0))
            out[rows] = (p * row_scale[rows, None]).to(out.dtype)
        return out.view_as(logits), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index) (mean),
    with less memory: the logits are kept as given, the fp32 work is done in chunks of rows.
    Equal to it to fp32 rounding (the summation order differs)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)} do not match")
    return _ChunkedCrossEntropy.apply(logits, targets, ignore_index)
