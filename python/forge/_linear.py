"""_linear.py — how the weight update of a linear layer moves into its backward.

Each nn.Linear whose weight a forge optimizer owns gets, per instance, a forward that
calls FusedLinearFunction:
    forward:  y = x·Wᵀ + b                              (F.linear, as torch)
    backward: dX = dY·W with the OLD weight, db = Σ dY   (returned to autograd)
              (X, dY) handed to the optimizer's slot      (no dW is formed)
              None for W: the weight never gets a .grad.
The hand-off is made only where the backward accumulates W's gradient (weight_grad_use):
torch.autograd.grad naming W gets dW as torch computes it, one of an input (or
backward(inputs=...) without W) hands nothing over.
transformers' Conv1D (GPT-2 and its relatives: y = x·W + b with W stored [in, out], a
transposed Linear) gets FusedConv1DFunction: the same, with dW = Xᵀ·dY. The fused step
takes, for a parameter [rows, cols], x: [T, cols] and dy: [T, rows] and computes
Σ_t dy[t]ᵀ x[t]; for W [in, out] that is Xᵀ·dY when x := dY and dy := X. So a Conv1D hands
its slot the pair swapped, and everything downstream (the fused step, the fp32 sum of a
weight with several uses, the deferred FactoredGrad) sees a parameter [rows, cols] with
its two operands, whichever layer made them.
The optimizer applies the fused step (forge_wgrad_step) when autograd reaches W's
AccumulateGrad node, i.e. once every consumer of W in this backward is done (see
forge/optim/routing.py and backward.py); that is what makes a Linear applied twice, or a weight
also used outside its Linear, come out right instead of being updated from a partial gradient.

The patched forward finds its slot through a registry keyed by the weight's id, so a
deep copy of the model (a new weight) silently behaves like a plain nn.Linear.

Under torch.compile the same Functions are traced into the graph; their backward then hands
(X, dY) over through the custom operator forge::wgrad_hand_off and sums db through
forge::bias_grad (_ops.py), which find the slot by its key (an int from a counter, never
reused; _ops.slot_of_key). Dynamo never sees the hand-off's side effects, so a compiled model has
no graph break per Linear, and its fused Linears compute what eager ones do.

Where forge.optim built its C++ extension (forge/_prehook.py), an eager Linear forward (with or
without autocast; not a forge.lean recompute) calls the extension's fused_linear instead: the
same forward, and a C++ backward node that computes dX and db with the same operations and arms
W's update without entering Python (docs/design.md §5.3). FusedLinearFunction stays the
reference and takes everything else.
"""
from __future__ import annotations

import math
import sys
import types
import weakref
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _lib, _ops, _prehook

# id(weight) -> weakref to the optimizer's slot of that weight (patch / unpatch)
_SLOTS: Dict[int, "weakref.ReferenceType"] = {}


def slot_of(weight: torch.Tensor):
    """The optimizer slot a live forge optimizer routes `weight` through (its layers
    patched), or None."""
    ref = _SLOTS.get(id(weight))
    slot = ref() if ref is not None else None
    if slot is None or slot.param is not weight or not slot.is_live():
        return None
    return slot

# torch dtype -> the library's dtype code, filled on first use (the codes come from libforge)
FORGE_DTYPE_CODES: Dict[torch.dtype, int] = {}


def forge_dtype(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """t in a dtype the C ABI reads (fp32 / bf16 / fp16; anything else goes to fp32)."""
    code = FORGE_DTYPE_CODES.get(t.dtype)
    if code is None:
        if not FORGE_DTYPE_CODES:
            FORGE_DTYPE_CODES.update({torch.float32: _lib.DTYPE_FP32,
                                      torch.bfloat16: _lib.DTYPE_BF16,
                                      torch.float16: _lib.DTYPE_FP16})
            return forge_dtype(t)
        return t.detach().float(), _lib.DTYPE_FP32
    return t, code


def as_rows(t: torch.Tensor, n: int) -> Tuple[torch.Tensor, int]:
    """t as rows of n elements with unit column stride: (tensor, leading dimension).
    A contiguous t comes back as it is, whatever its shape [..., n] (its rows are its
    elements in order: rows_2d views it as [T, n] where a caller needs that); strided
    views are kept as [T, n] (ld = row stride); anything else is made contiguous."""
    if t.is_contiguous():  # NOTE: the common case, on every Linear: no view, no checks
        return t, n
    t2 = t.reshape(-1, n)
    if n > 1 and t2.size(0) > 0 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    ld = t2.stride(0) if t2.size(0) > 1 else n
    if ld < n:  # broadcast (stride 0) or overlapping rows
        t2, ld = t2.contiguous(), n
    return t2, ld


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """as_rows' tensor as [T, n] (a view; as it is when already 2-d)."""
    return t if t.dim() == 2 else t.reshape(-1, t.size(-1))


def row_count(t: torch.Tensor) -> int:
    """The number of rows T of as_rows' tensor (its leading dimensions' product)."""
    if t.dim() == 2:
        return t.size(0)
    n = t.size(-1) if t.dim() else 1
    return t.numel() // n if n else math.prod(t.shape[:-1])


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast compute dtype active for device_type, or None (torch >= 2.4 API with
    the older per-device functions as fallback)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:
        enabled = (torch.is_autocast_enabled() if device_type == "cuda"
                   else torch.is_autocast_cpu_enabled() if device_type == "cpu" else False)
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:
        return (torch.get_autocast_gpu_dtype() if device_type == "cuda"
                else torch.get_autocast_cpu_dtype())


def _current_stream_handle_fallback(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# NOTE: current_stream_handle(device_index) is the cudaStream_t (an int; 0: the legacy
# default stream) of that device's current stream. torch._C._cuda_getCurrentRawStream
# (torch >= 2.4, what torch inductor's generated code calls) gives it without
# torch.cuda.current_stream's device-index parsing and torch.cuda.Stream object, which took
# 4.1 ms of a Llama-3.1-8B step under cProfile on the H200 host (516 calls, ~2.3 per
# Linear). Callers compare and store these ints, never Stream objects.
current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", None) \
    or _current_stream_handle_fallback


def stream_of_handle(handle: int, device_index: int) -> "torch.cuda.Stream":
    """A torch stream that launches on the raw stream `handle` of device `device_index`
    (for torch.cuda.stream(...)). Handle 0 is the legacy default stream, which
    torch.cuda.ExternalStream cannot wrap: given a null pointer it takes a new stream from
    torch's pool instead (torch/csrc/cuda/Stream.cpp, THCPStream_pynew)."""
    if handle == 0:
        return torch.cuda.default_stream(device_index)
    return torch.cuda.ExternalStream(handle, device=device_index)


def refuse_create_graph(what: str, instead: str) -> None:
    """Raises in the backward of `what` under create_graph=True (grad mode is on inside a
    backward's nodes only then): its backward makes its gradients without a graph of their
    own, so a penalty differentiated through them would lose its second-order terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"forge: {what}'s backward is not itself differentiable, and a backward or "
            f"torch.autograd.grad with create_graph=True went through it. Nothing was updated. "
            f"{instead}")


def refuse_compiled_autograd() -> None:
    """Raises inside a backward that compiled autograd (torch._dynamo.compiled_autograd) runs:
    it traces the backward into a graph, hooks included, and the updates made from them are not
    torch's (measured: deferred mode diverged). The backward's first callback calls this, before
    any update; the C++ nodes refuse it alike (csrc/prehook.cpp)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and (ca.compiled_autograd_enabled
                           or getattr(ca, "in_compiled_autograd_region", False)):
        raise RuntimeError(
            "forge: compiled autograd (torch._dynamo.compiled_autograd, or "
            "torch._dynamo.config.compiled_autograd) cannot trace a fused Linear's backward: "
            "FORGE updates the weight at its gradient node, outside any graph it compiles. "
            "Nothing was updated. torch.compile(model) compiles forward and backward with "
            "forge.optim; run backward without compiled autograd.")


# What the running backward does with a fused weight's gradient (csrc/prehook.cpp's GradUse):
# drops it (torch.autograd.grad of an input, backward(inputs=...) without W), accumulates it
# (backward(): the fused step's hand-off), or returns it (torch.autograd.grad naming W).
GRAD_DROPPED, GRAD_ACCUMULATED, GRAD_RETURNED = 0, 1, 2


def weight_grad_use(param: torch.Tensor, node=None) -> int:
    """What the running backward does with the gradient of `param` (input 1 of the Python
    backward node `node`, where there is one). A non-leaf is never fused: for it,
    GRAD_ACCUMULATED means that its gradient flows on into the graph."""
    cpp = _prehook.get()
    if cpp is not None:
        return cpp.weight_grad_use(param)
    if node is not None:
        fn = node.next_functions[1][0]
    elif param.grad_fn is not None:
        fn = param.grad_fn
    else:
        with torch.enable_grad():
            fn = param.view_as(param).grad_fn.next_functions[0][0]  # its AccumulateGrad
    if fn is None:
        return GRAD_DROPPED
    try:
        return GRAD_ACCUMULATED if torch._C._will_engine_execute_node(fn) else GRAD_DROPPED
    except RuntimeError:  # (torch refuses to say it of a leaf whose gradient autograd.grad
        return GRAD_RETURNED  # returns: the only case it refuses during a backward)


# An input X that can be recomputed (set by forge.lean): X._forge_recompute = (fn, inputs),
# with fn(*inputs) equal to X bit for bit, computable again in backward (no grad), and the
# inputs kept for backward anyway. The Linear then keeps the inputs instead of X.
RECOMPUTE_ATTR = "_forge_recompute"


def _in_graph_grads(ctx, x, dy, weight, bias_rows):
    """W's gradient stand-in and db of a fused backward traced by torch.compile: the hand-off
    of the fused step's (x, dy) pair and the sum of bias_rows, through _ops' operators."""
    db = _ops.bias_grad(bias_rows).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
    dw = None
    if ctx.needs_input_grad[1]:
        # (decided as the backward is traced, for every run of its graph: _ops.py)
        keep = hand_off_keeps(x, dy, ctx.slot.local())
        dw = _ops.wgrad_hand_off(x, dy, weight, ctx.slot.key, keep)
    return dw, db


def hand_off_keeps(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a compiled backward's hand-off keeps x and dy for W's update (they take fewer
    bytes than dW in W's dtype) or forms dW at once (_ops.py)."""
    return bool(x.numel() * x.element_size() + dy.numel() * dy.element_size()
                < weight.numel() * weight.element_size())


class FusedLinearFunction(torch.autograd.Function):
    """y = F.linear(x, W, b); backward returns dX, db and no dW (see the file header).
    `compute_dtype` is autocast's dtype captured at forward (None without autocast);
    `in_graph`: traced by torch.compile, the backward calls _ops' operators."""

    @staticmethod
    def forward(ctx, x, weight, bias, slot, compute_dtype, in_graph):
        w = weight if compute_dtype is None else weight.to(compute_dtype)
        b = bias if bias is None or compute_dtype is None else bias.to(compute_dtype)
        recompute = getattr(x, RECOMPUTE_ATTR, None)
        if recompute is None:
            ctx.recompute = None
            ctx.save_for_backward(x, weight)
        else:
            ctx.recompute = recompute[0]
            ctx.save_for_backward(*recompute[1], weight)
        ctx.slot = slot
        ctx.compute_dtype = compute_dtype
        ctx.in_graph = in_graph
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        *x, weight = ctx.saved_tensors
        if ctx.recompute is None:
            x = x[0]
        else:
            with torch.no_grad():
                x = ctx.recompute(*x)
        w = weight if ctx.compute_dtype is None else weight.to(ctx.compute_dtype)
        if ctx.in_graph:
            # NOTE: the hand-off first, as torch's linear backward orders dW before dX: X's
            # last use is then over before dX is allocated. No update runs inside a compiled
            # backward (each runs at W's AccumulateGrad node, after the graph).
            dw, db = _in_graph_grads(ctx, x, dy, weight, dy)
            dx = dy.matmul(w) if ctx.needs_input_grad[0] else None    # [..., in]
            return dx, dw, db, None, None, None
        # NOTE: dX first, with the weight as the forward saw it; the update of W runs
        # later (at W's AccumulateGrad node), after this product on the same stream.
        dx = dy.matmul(w) if ctx.needs_input_grad[0] else None        # [..., in]
        db = None
        if ctx.needs_input_grad[2]:
            db = (dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])).sum(0)  # [out]
            if db.dtype != ctx.bias_dtype:
                db = db.to(ctx.bias_dtype)
        dw = ctx.slot.linear_backward(x, dy, weight, ctx) if ctx.needs_input_grad[1] else None
        return dx, dw, db, None, None, None


# Whether autocast is on for any device type (torch's own check; None where torch lacks it).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _live_slot(weight: torch.Tensor):
    """The optimizer slot that fuses `weight` in this forward, or None: no owner, inference,
    or the recompute-free first pass of a reentrant checkpoint (the layer's own forward runs)."""
    ref = _SLOTS.get(id(weight))
    slot = ref() if ref is not None else None
    if (slot is None or slot.param is not weight or not slot.is_live()
            or not torch.is_grad_enabled() or not weight.requires_grad):
        return None
    return slot


def _apply_fused(function, input: torch.Tensor, weight, bias, slot) -> torch.Tensor:
    """function (FusedLinearFunction or FusedConv1DFunction) applied with autocast's dtype
    captured now and autocast off inside; in its graph form when torch.compile traces it."""
    # NOTE: one C call answers "no autocast anywhere" (the common case) before the per-device
    # query, which costs four times as much on every Linear.
    compute_dtype = None
    if (_any_autocast is None or _any_autocast()) and input.is_floating_point():
        compute_dtype = autocast_dtype(input.device.type)
    compiling = torch.compiler.is_compiling()
    in_graph = compiling and _ops.ready()
    if compute_dtype is None:
        return function.apply(input, weight, bias, slot, None, in_graph)
    input = input.to(compute_dtype)
    cpp_linear = slot.cpp_linear  # (the C++ forward of the slot's layer kind)
    if (cpp_linear is not None and not compiling
            and getattr(input, RECOMPUTE_ATTR, None) is None):
        # (its inputs all of autocast's dtype, the forward's product is the same under autocast)
        return cpp_linear(input, weight, bias, slot.record, compute_dtype)
    with torch.autocast(input.device.type, enabled=False):
        return function.apply(input, weight, bias, slot, compute_dtype, in_graph)


def _fused_forward(function, input: torch.Tensor, weight, bias, slot) -> torch.Tensor:
    """A fused layer's forward: _apply_fused, its common case (no autocast, eager) first."""
    # NOTE: once per fused layer per step; where the C++ extension is built
    # (forge/_prehook.py), its forward of the layer's kind: the same product, a C++ backward
    # node (no Python in backward unless the update takes the Python path)
    if (_any_autocast is not None and not _any_autocast()
            and not torch.compiler.is_compiling()):
        cpp_forward = slot.cpp_linear
        if cpp_forward is not None and getattr(input, RECOMPUTE_ATTR, None) is None:
            return cpp_forward(input, weight, bias, slot.record)
        return function.apply(input, weight, bias, slot, None, False)
    return _apply_fused(function, input, weight, bias, slot)


def _forge_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    weight = self.weight  # NOTE: once: a module attribute lookup is a slow path in Python
    slot = _live_slot(weight)
    if slot is None:
        return F.linear(input, weight, self.bias)
    return _fused_forward(FusedLinearFunction, input, weight, self.bias, slot)


class FusedConv1DFunction(torch.autograd.Function):
    """y = x·W + b with W: [in, out] (transformers' Conv1D: torch.addmm, as its forward);
    backward returns dX = dY·Wᵀ (old W) and db, hands the slot (dY, X) as the fused step's
    (x, dy) pair (see the file header) and returns no dW."""

    @staticmethod
    def forward(ctx, x, weight, bias, slot, compute_dtype, in_graph):
        w = weight if compute_dtype is None else weight.to(compute_dtype)
        b = bias if bias is None or compute_dtype is None else bias.to(compute_dtype)
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        ctx.compute_dtype = compute_dtype
        ctx.in_graph = in_graph
        ctx.bias_dtype = None if bias is None else bias.dtype
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.mm(w) if b is None else torch.addmm(b, x2, w)
        return y.view(x.shape[:-1] + (w.shape[1],))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        w = weight if ctx.compute_dtype is None else weight.to(ctx.compute_dtype)
        dy2 = dy.reshape(-1, dy.shape[-1])                                   # [T, out]
        # NOTE: dX first, with the weight as the forward saw it (see FusedLinearFunction);
        # 2-d products as addmm's own backward makes them, so fp32 results are torch's bits.
        dx = dy2.mm(w.t()).view(x.shape) if ctx.needs_input_grad[0] else None  # [..., in]
        if ctx.in_graph:
            dw, db = _in_graph_grads(ctx, dy, x, weight, dy2)
            return dx, dw, db, None, None, None
        db = None
        if ctx.needs_input_grad[2]:
            db = dy2.sum(0)                                                  # [out]
            if db.dtype != ctx.bias_dtype:
                db = db.to(ctx.bias_dtype)
        dw = ctx.slot.linear_backward(dy, x, weight, ctx) if ctx.needs_input_grad[1] else None
        return dx, dw, db, None, None, None


def conv1d_class() -> Optional[type]:
    """transformers' Conv1D, or None where transformers is not imported (a model that holds
    one has imported it: FORGE never imports transformers itself)."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None) if module is not None else None


def _forge_conv1d_forward(self, input: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    slot = _live_slot(weight)
    if slot is None:
        return type(self).forward(self, input)  # Conv1D's own forward (checked in can_patch)
    return _fused_forward(FusedConv1DFunction, input, weight, self.bias, slot)


_FORGE_FORWARDS = (_forge_linear_forward, _forge_conv1d_forward)
# A patched layer holds one of these, bound, as its instance's `forward` (patch). Pickling the
# layer (torch.save of a whole model) reduces a bound method to getattr(layer, the function's
# __name__); named "forward", that is the layer's class forward when loaded: a saved model
# holds no reference to FORGE, loads without it and trains as a plain model.
for _forward in _FORGE_FORWARDS:
    _forward.__name__ = "forward"


def layer_kind(module: nn.Module) -> Optional[str]:
    """"Linear" for an nn.Linear (or a subclass), "Conv1D" for transformers' Conv1D (or a
    subclass), else None: the layers whose weight FORGE can fuse when can_patch allows."""
    if isinstance(module, nn.Linear):
        return "Linear"
    conv1d = conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "Conv1D"
    return None


def why_not_patchable(module: nn.Module) -> Optional[str]:
    """None where can_patch(module), else why not, in words (for opt.summary())."""
    kind = layer_kind(module)
    if kind is None:
        return f"{type(module).__name__} is not an nn.Linear or transformers Conv1D"
    base = nn.Linear if kind == "Linear" else conv1d_class()
    if type(module).forward is not base.forward:
        return (f"{type(module).__name__} replaces {base.__name__}.forward (its own "
                "computation, e.g. a quantized or adapter layer)")
    fwd = module.__dict__.get("forward")
    if fwd is not None and not _own_or_ours(module, fwd):
        return f"the forward of this {base.__name__} was replaced on the instance"
    weight = registered_weight(module)
    if weight is None:
        return (f"this {base.__name__}'s weight is not a parameter of its own (parametrized: "
                "computed in each forward)")
    if weight.dim() != 2:
        return f"this {base.__name__} has no 2-d weight"
    return None


def _own_or_ours(module: nn.Module, fwd) -> bool:
    """Whether an instance's `forward` is FORGE's (patch) or its class's own, bound to it (what
    a layer pickled while patched holds once loaded)."""
    return (isinstance(fwd, types.MethodType) and fwd.__self__ is module
            and (fwd.__func__ in _FORGE_FORWARDS or fwd.__func__ is type(module).forward))


def registered_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """The module's own parameter named weight, or None. (Not getattr: a parametrized weight
    (torch.nn.utils.parametrize) is computed by each read, and spectral_norm's read runs a
    power iteration that updates the module's buffers.)"""
    return module._parameters.get("weight")


def can_patch(module: nn.Module) -> bool:
    """A plain nn.Linear or transformers Conv1D (or a subclass keeping its forward) whose
    forward nobody else replaced (ours, left by an optimizer that was garbage-collected, is
    fine)."""
    return why_not_patchable(module) is None


def patch(module: nn.Module, slot) -> None:
    _SLOTS[id(registered_weight(module))] = weakref.ref(slot)
    forward = _forge_conv1d_forward if layer_kind(module) == "Conv1D" else _forge_linear_forward
    module.forward = types.MethodType(forward, module)


def unpatch(module: nn.Module, weight: torch.Tensor) -> None:
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, types.MethodType) and fwd.__func__ in _FORGE_FORWARDS:
        del module.forward
    _SLOTS.pop(id(weight), None)
