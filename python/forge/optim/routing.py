"""routing.py — which path each parameter takes, and the backward callbacks that run its update.

Each optimized parameter gets a slot (_Slot) and one of three paths:

  fused     the weight of an nn.Linear (or of transformers' Conv1D, a transposed Linear):
            its forward is rerouted to FusedLinearFunction (FusedConv1DFunction; both in
            forge/_linear.py), whose backward computes dX and hands (X, dY) to the slot. When
            autograd reaches the weight's AccumulateGrad node (all consumers of W in this
            backward are done), a pre-hook runs forge_wgrad_step: dW = dYᵀX tile by tile
            with the update applied in place; no dW tensor exists. If W had more than one
            use (a Linear applied twice, or W also read outside its Linear) the hook sums
            the full gradient in fp32 instead and applies forge_elementwise_step once.
            In a backward compiled by torch.compile the hand-off is the custom operator
            forge::wgrad_hand_off (forge/_ops.py, _Slot.hand_off_in_graph); the hooks run
            after the compiled backward, and a weight with several uses in it gets the sum
            of their stand-ins, which _outside_grad tells from an outside gradient.
  hook      any other parameter (bias, norm, embedding, a weight that F.linear or a matmul
            reads in a custom forward, the weight of a layer that replaces nn.Linear's
            forward): autograd forms its gradient, a post-accumulate-grad hook (torch >= 2.1)
            applies forge_elementwise_step and frees .grad at once.
  batched   such a parameter of at most BATCHED_MAX_ELEMENTS elements (biases, norm scales):
            no hook; its gradient waits in .grad and step() applies it with every other
            plain gradient of the step in one forge_elementwise_step_batch call.
  deferred  a parameter registered in more than one place (tied embeddings), a frozen one
            (requires_grad=False: never stepped unless it gets a .grad), or every
            parameter when torch lacks the hooks: autograd accumulates its full .grad and
            step() applies the update, then frees the .grad.
Each slot records why it took its path (slot.reason, slot.kind); opt.summary() reports them.

_RoutingMixin attaches the slots to the model and detaches them; the callbacks call
_update (call.py) when a parameter's gradient is complete.
"""
from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .. import _linear, _ops, _prehook
from . import distributed
from .deferred import ConsumedGrad, FactoredGrad, add_product, consumed_of, product

if TYPE_CHECKING:
    from .base import _ForgeOptimizer

# Tests set this to exercise the fallback for torch without the autograd hooks.
_FORCE_NO_HOOKS = False

# Element-wise parameters of at most this many elements (biases, norm scales) take the
# "batched" path: no hook; step() applies all their gradients in one library call.
# NOTE: a hook per parameter costs the host a Python call and an update of its own inside
# backward (tens of µs each, 113 of them on Qwen3-0.6B), where freeing a gradient this small
# early saves nothing: up to 256 KiB each in fp32.
BATCHED_MAX_ELEMENTS = 1 << 16


def _has_post_accumulate_hook() -> bool:
    return (not _FORCE_NO_HOOKS
            and hasattr(torch.Tensor, "register_post_accumulate_grad_hook"))


def _has_node_prehook() -> bool:
    return not _FORCE_NO_HOOKS and hasattr(torch.autograd.graph.Node, "register_prehook")


class _Slot:
    """One optimized parameter: its path, names, and what backward left for it."""

    def __init__(self, opt: "_ForgeOptimizer", param: torch.Tensor, index: int,
                 names: List[str], mode: str):
        self.opt_ref = weakref.ref(opt)
        self.param = param
        self.index = index          # position in param_groups order (state_dict index)
        self.names = names
        self.name = names[0]
        self.mode = mode            # "fused" | "hook" | "batched" | "deferred"
        self.kind = None            # fused: the layer, "Linear" or "Conv1D"
        self.reason = ""            # why this path, in words (opt.summary())
        self.state_format = None    # states.STATE_FORMATS, fixed when its states are made
        self.storage_asked = None   # its group's (state_format, min_8bit_size) then
        self.dtype = param.dtype
        self.device = param.device
        # [rows, cols] of what this rank updates, and where it lies in the full parameter
        # (a DTensor's local shard: distributed.py)
        self.geometry = distributed.geometry(param, names[0])
        self.rows, self.cols = self.geometry.rows, self.geometry.cols
        self.dtensor = distributed.is_dtensor(param)
        self.counts = distributed.counts_once(param)  # counted in the step's statistics here
        self.layouts = None  # a tensor-parallel Linear weight: the X and dY layouts it needs
        # (x [T, cols], ldx, dy [T, rows], lddy, raw handle of the CUDA stream they were made
        # on, its device index); the last two are None on the CPU
        self.pending: List[Tuple[torch.Tensor, int, torch.Tensor, int,
                                 Optional[int], Optional[int]]] = []
        # dW formed in this backward: the fp32 sum of several uses, or one use's dW in W's
        # dtype where a compiled backward's hand-off formed it (_linear_backward)
        self.partial: Optional[torch.Tensor] = None
        self.uses = 0               # Linear backward calls seen since the last update
        self.updated_at = -1        # opt._step_id when last updated
        self.signature = None       # (rule, names of states) the states were made for
        self.handles: List[Any] = []
        self.acc_node = None        # W's AccumulateGrad node, held so its hook lives
        self.marker: Optional[torch.Tensor] = None  # stand-in dW of this backward (see below)
        self.stand_in: Optional[torch.Tensor] = None  # the marker, made once (a zero, expanded)
        # A compiled backward's hand-offs (forge::wgrad_hand_off, forge/_ops.py) find the slot
        # by this key. in_graph_uses counts those since the last update: from the second on,
        # W's gradient arrives as a sum of stand-ins that the graph computed.
        self.key = _ops.new_key(self)
        self.in_graph_uses = 0
        # (formats and data pointers, forge_param) of the last update; rebuilt on any change
        self.param_cache: Optional[Tuple[tuple, Any]] = None
        self.modules: List[nn.Linear] = []
        self.warned_multi_use = False
        self.warned_hooked = False
        # Deferred mode: the gradient of earlier backwards while another runs (see
        # _linear_backward), a hook parameter's .grad version when backward last left it, the
        # .grad backward last left (a weak reference), and how many backwards left a hook or
        # fused parameter a gradient (an auto optimizer's first step reads the last three).
        self.held: Optional[torch.Tensor] = None
        self.grad_version: Optional[int] = None
        self.grad_left: Optional[weakref.ReferenceType] = None
        self.grad_arrivals = 0
        # Whether torch.optim would hold a gradient tensor for it now: one since a step updated
        # it, until a zero_grad set it to None (base.py, _step_on_zeros reads it)
        self.grad_kept = False
        self._consumed: Optional[torch.Tensor] = None  # consumed_grad()
        self.fsdp_shard = False  # FSDP2 manages it (set by _attach)
        # The host's fast path (call.py): the forge_param checked this step (and the step),
        # the (state dict, param group) checked with it, and the forge_wgrad_args kept for
        # this parameter with what its struct fields hold.
        self.struct = None
        self.struct_step = -1
        self.checked: Optional[Tuple[Dict[str, Any], Dict[str, Any]]] = None
        self.ready: Optional[tuple] = None  # a fused weight's args for this step (call.py)
        # "wgrad" / "elementwise" -> (the forge_*_args kept for its calls, what its struct
        # fields hold, a view of its hparams): call.py, _kept_args
        self.kept_args: Dict[str, Any] = {}
        # The C++ part (forge/_prehook.py), where built: its record of this weight (the kept
        # call, armed by a Linear's backward and made by W's node pre-hook), what was last
        # given to it (args, stand-in, ConsumedGrad), and the extension's forward of this
        # layer's kind, fused_linear or fused_conv1d (with the C++ backward node; None:
        # FusedLinearFunction or FusedConv1DFunction).
        self.record = None
        self.record_call: Optional[tuple] = None
        self.cpp_linear = None

    @property
    def armed(self) -> bool:
        """The C++ record holds an update, armed or made, that Python has not settled yet
        (_settle_armed)."""
        record = self.record
        return record is not None and record.busy

    def consumed_grad(self) -> torch.Tensor:
        """The .grad left on this parameter once its update ran (made once): a ConsumedGrad,
        or for a DTensor parameter a DTensor of its layout holding one as its local tensor."""
        consumed = self._consumed
        if consumed is None or consumed.dtype != self.param.dtype \
                or consumed.device != self.param.device:
            if self.dtensor:
                local = ConsumedGrad(distributed.local(self.param), self)
                consumed = distributed.as_state(local, self.param, tuple(self.param.shape))
            else:
                consumed = ConsumedGrad(self.param, self)
            self._consumed = consumed
        return consumed

    @property
    def keeps_consumed(self) -> bool:
        """Whether the ConsumedGrad stays in .grad after opt.step(), where torch.optim's
        gradient would stay until zero_grad (base.py, _begin_step reads it): a fused weight's
        (the update comes before any other gradient could accumulate into it), and an FSDP2
        shard's (FSDP2 accumulates into it, after the step's first callback: _BackwardStart).
        Any other parameter's AccumulateGrad may run before a step's first callback, so its
        .grad is None after opt.step()."""
        return self.mode == "fused" or self.fsdp_shard

    def clear_backward(self) -> None:
        """Forgets what backward handed over since the last update (pending pairs, the fp32
        partial sum, the use counts)."""
        self.pending.clear()
        self.partial = None
        self.uses = 0
        self.in_graph_uses = 0

    def local(self) -> torch.Tensor:
        """The parameter's tensor on this rank (a DTensor's local shard)."""
        return distributed.local(self.param)

    def is_live(self) -> bool:
        opt = self.opt_ref()
        return opt is not None and opt._attached

    def linear_backward(self, x, dy, weight, node=None):
        """x: [..., cols], dy: [..., rows], the fused step's operands for this [rows, cols]
        parameter (dW = dyᵀ·x): a Linear's input and output gradient, a Conv1D's output
        gradient and input. `node`: the Linear's backward node, where it is a Python one."""
        _linear.refuse_compiled_autograd()
        use = _linear.weight_grad_use(self.param, node)
        if use == _linear.GRAD_DROPPED:
            return None
        opt = self.opt_ref()
        if use == _linear.GRAD_RETURNED or opt is None or not opt._attached:
            return _materialize_dw(x, dy, weight)  # what torch returns; plain nn.Linear's
        return opt._linear_backward(self, x, dy, weight)

    def hand_off_in_graph(self, x, dy, weight, keep: bool) -> torch.Tensor:
        """linear_backward for forge::wgrad_hand_off, a compiled backward's hand-off: the op
        returns a tensor of one layout (the stand-in's), so a second use of W in this backward
        gets the stand-in too; the pre-hook then sees their sum (_on_weight_grad_ready)."""
        _linear.refuse_compiled_autograd()
        use = _linear.weight_grad_use(self.param)
        if use == _linear.GRAD_DROPPED:
            return weight.new_zeros(()).expand(weight.shape)  # (the engine drops it)
        if use == _linear.GRAD_RETURNED:
            raise RuntimeError(
                f"forge: torch.autograd.grad asked for the gradient of the fused weight "
                f"'{self.name}' through a compiled model's backward, whose hand-off returns no "
                "gradient. Nothing was updated. Run that model uncompiled, or take the "
                "gradient with backward() and read it from .grad (mode='deferred')")
        if self.param._backward_hooks:
            raise RuntimeError(
                f"forge: the fused weight '{self.name}' has a tensor hook (register_hook), "
                "which needs its whole gradient, and a compiled backward's hand-off makes none. "
                "Run that model uncompiled, or take the hook off")
        opt = self.opt_ref()
        if opt is None or not opt._attached:
            raise RuntimeError(
                f"forge: the optimizer of '{self.name}' was detached between a compiled forward "
                "and its backward: its gradient has no place to go; detach between steps")
        if x.is_cuda and not opt._capturing and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "forge: a compiled backward with fused Linears is being captured into a CUDA "
                "graph (torch.compile mode='reduce-overhead'?): a replay would run its kernels "
                "but not hand X and dY to the optimizer. Compile without CUDA graphs; "
                "forge.graphs.CUDAGraphStep graphs a whole training step")
        self.in_graph_uses += 1
        dw = opt._linear_backward(self, x, dy, weight, keep_operands=keep)
        return self.stand_in if dw is None else dw


def _materialize_dw(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ·X in the compute dtype, as torch's linear backward, cast to W's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    return dy2.t().matmul(x2).to(weight.dtype)


def _weight_grad_done(ref) -> None:
    slot = ref()
    opt = slot.opt_ref() if slot is not None else None
    if opt is not None and opt._attached:
        opt._on_weight_grad_done(slot)


def _weight_grad_ready(ref, grads):
    slot = ref()
    opt = slot.opt_ref() if slot is not None else None
    if opt is None or not opt._attached:
        return None
    return opt._on_weight_grad_ready(slot, grads)


def _armed_call_failed(ref, status: int) -> None:
    """The C++ pre-hook's call failed (nothing was committed): backward's hand-offs are
    dropped and the library's error raised."""
    slot = ref()
    opt = slot.opt_ref() if slot is not None else None
    if opt is None:
        raise RuntimeError(f"forge: forge_wgrad_step failed (status {status})")
    slot.marker = None
    slot.clear_backward()
    opt._lib.check(status, "forge_wgrad_step")


def _linear_fallback(ref, x, dy, weight):
    """The C++ Linear backward's dW where its record could not arm: the Python routing's."""
    slot = ref()
    if slot is None:
        return _materialize_dw(x, dy, weight)
    return slot.linear_backward(x, dy, weight)


def _param_grad_ready(ref) -> None:
    slot = ref()
    opt = slot.opt_ref() if slot is not None else None
    if opt is not None and opt._attached:
        opt._on_param_grad_ready(slot)


class _BackwardStart:
    """A model with FSDP2 shards: its forward hook. FSDP2 adds a shard's reduced gradient into
    its .grad before any of FORGE's callbacks of the step runs, so the step's first callback
    (_begin_step: what the last step left in .grad, zeroed or stale) is the start of the
    backward: a hook on the forward's outputs, run as the first of them gets its gradient."""

    def __init__(self, opt_ref):
        self.opt_ref = opt_ref

    def __call__(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._started, mode="any")

    def _started(self, grad) -> None:
        opt = self.opt_ref()
        if opt is not None and opt._attached and opt._begun_step != opt._step_id:
            opt._begin_step()


def _tensors_in(output):
    """The tensors of a forward's output (a tensor, or tuples, lists and mappings of them:
    transformers' ModelOutput is a mapping)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors_in(item)


def _add_dw(acc: Optional[torch.Tensor], x2: torch.Tensor, dy2: torch.Tensor) -> torch.Tensor:
    """acc += dYᵀ·X in fp32 ([rows, cols]); x2, dy2 as _linear.as_rows gives them."""
    dw = _linear.rows_2d(dy2).float().t().matmul(_linear.rows_2d(x2).float())
    return dw if acc is None else acc.add_(dw)


def _elementwise_reason(model: nn.Module, p: torch.Tensor, name: str, mods, refusals,
                        pre_hook: bool) -> str:
    """Why a trainable parameter takes the element-wise (hook) path, in words."""
    if mods and not pre_hook:
        return "this torch has no AccumulateGrad pre-hooks to run the fused step"
    if refusals:
        return "weight of a layer FORGE cannot fuse: " + refusals[0]
    if mods:  # (only a sharded Conv1D is left)
        return "a sharded (DTensor) Conv1D weight"
    owner_name = name.rpartition(".")[0]
    try:
        owner = model.get_submodule(owner_name) if owner_name else model
    except AttributeError:
        owner = None
    if type(owner).__name__ == "ParametrizationList":
        return ("a parametrized weight (torch.nn.utils.parametrize): its layer computes the "
                "weight it uses from it in each forward")
    if isinstance(owner, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    if p.dim() < 2:
        return "1-d (bias, norm scale)"
    return (f"a {p.dim()}-d parameter of {type(owner).__name__ if owner is not None else '?'} "
            "outside nn.Linear / Conv1D forwards (F.linear or a matmul in a custom forward "
            "cannot be intercepted without patching torch)")


# id(param) -> weakref to the slot of the live optimizer that drives it (one at a time:
# two would both update it in backward).
_OWNERS: Dict[int, "weakref.ReferenceType"] = {}


def _owner_of(p: torch.Tensor) -> Optional["_ForgeOptimizer"]:
    ref = _OWNERS.get(id(p))
    slot = ref() if ref is not None else None
    if slot is None or slot.param is not p or not slot.is_live():
        return None
    return slot.opt_ref()


class _RoutingMixin:
    """Slots, hooks and backward callbacks of _ForgeOptimizer (see the file header)."""

    def rebind_streams(self) -> None:
        """Binds the gradient nodes of the fused nn.Linear weights to the current CUDA stream.

        FORGE holds each fused weight's AccumulateGrad node to hook it; torch (2.11) records
        in that node the stream current when it was made (this optimizer's construction).
        Backward on another stream then syncs with that stream and warns that "the
        AccumulateGrad node's stream does not match", and a CUDA-graph capture on another
        stream fails (cudaErrorStreamCaptureInvalidated). Call this, between steps, under the
        stream the steps will run on; forge.graphs.CUDAGraphStep does."""
        if not self._attached:
            return
        self._settle_all()
        for slot in self._slots.values():
            if slot.mode == "fused":
                self._rehook(slot)

    def _rehook(self, slot: _Slot) -> None:
        """Hooks W's AccumulateGrad node anew: the one torch holds now, or a new one."""
        for h in slot.handles:
            h.remove()
        slot.handles.clear()
        slot.acc_node = None  # the only reference: the node goes, the next one is new
        self._hook_weight_node(slot)

    def _recover_replaced_node(self, slot: _Slot) -> bool:
        """At step(), for a fused weight whose Linear's backward ran but whose node hooks did
        not. torch makes a parameter a new AccumulateGrad node when its data changes dtype or
        device (model.double() then model.float(), say: the step refuses the weight while it
        differs from what the optimizer was built for, not once it is back), and the hooks were
        on the old one. Where that new node ran, it left the stand-in (and any gradient from a
        use outside the Linear) in W.grad, as where pre-hooks are skipped: the update runs from
        there (_on_weight_grad_done), and W is hooked on its new node for the next steps.
        Returns whether it ran (False: the node is the hooked one, or it never ran)."""
        if slot.dtensor:
            return False
        p = slot.param
        with torch.enable_grad():
            node = p.view_as(p).grad_fn.next_functions[0][0]
        if node is slot.acc_node:
            return False
        ran = type(p.grad) is torch.Tensor
        if ran:
            self._on_weight_grad_done(slot)
        self._rehook(slot)
        return ran

    def detach(self) -> None:
        """Gives the model back: plain nn.Linear forwards, no hooks. The optimizer is
        unusable afterwards (except state_dict())."""
        if not self._attached:
            return
        for handle in (self._wrapper_check, self._backward_start):
            if handle is not None:
                handle.remove()
        self._wrapper_check = self._backward_start = None
        self._settle_all()
        for slot in self._slots.values():
            for h in slot.handles:
                h.remove()
            slot.handles.clear()
            if slot.record is not None:  # (its hook stays on the node, passing gradients on)
                slot.record.enabled = False
                slot.record = slot.record_call = slot.cpp_linear = None
            slot.acc_node = None
            if consumed_of(slot.param.grad) is not None:  # (a plain optimizer could not use it)
                slot.param.grad = None
            for m in slot.modules:
                _linear.unpatch(m, slot.param)
            slot.modules.clear()
            if _OWNERS.get(id(slot.param)) is not None and _owner_of(slot.param) is self:
                del _OWNERS[id(slot.param)]
        self._attached = False

    def __del__(self):
        try:
            self.detach()
        except Exception:  # interpreter shutdown: nothing left to restore
            pass

    # ------------------------------------------------------------------ attaching

    def _attach(self, model: nn.Module, params: Sequence[torch.Tensor],
                names: Dict[int, List[str]]) -> None:
        index_of = {id(p): i for i, p in enumerate(p for g in self.param_groups
                                                   for p in g["params"])}
        layers: Dict[int, List[nn.Module]] = {}  # id(weight) -> its nn.Linear / Conv1D layers
        for m in model.modules():
            weight = _linear.registered_weight(m)
            if _linear.layer_kind(m) is not None and weight is not None:
                layers.setdefault(id(weight), []).append(m)
        # nn.MultiheadAttention keeps out_proj as an nn.Linear but reads its weight directly
        # (F.multi_head_attention_forward), never calling its forward: nothing to reroute
        direct = {id(_linear.registered_weight(m.out_proj)) for m in model.modules()
                  if isinstance(m, nn.MultiheadAttention)}
        post_hook, pre_hook = _has_post_accumulate_hook(), _has_node_prehook()
        self._any_cuda = self._any_cuda or any(p.is_cuda for p in params)
        shared = []
        for p in params:
            p_names = names[id(p)]
            mods = layers.get(id(p), [])
            kinds = {_linear.layer_kind(m) for m in mods}
            refusals = [r for r in map(_linear.why_not_patchable, mods) if r is not None]
            if id(p) in direct:
                refusals.insert(0, "nn.MultiheadAttention's out_proj, whose weight it reads "
                                   "directly, never through the Linear's forward")
            kind = None
            fsdp_shard = distributed.is_fsdp_managed(model, p)
            if fsdp_shard and post_hook:
                mode, reason = "hook", "an FSDP2 shard: its gradient arrives reduce-scattered"
            elif len(p_names) > 1:
                mode, reason = "deferred", "shared/tied (one parameter under several names)"
                shared.append(" = ".join(p_names))
            elif not p.requires_grad:
                # frozen (torch.optim takes it and never steps it): nothing is hooked or
                # patched; should it get a .grad after all, step() applies it
                mode, reason = "deferred", "frozen (requires_grad=False): never stepped"
            elif mods and pre_hook and not refusals and not (
                    "Conv1D" in kinds and distributed.is_dtensor(p)):
                mode = "fused"
                kind = "Conv1D" if kinds == {"Conv1D"} else "Linear"
                reason = {"Linear": "nn.Linear weight",
                          "Conv1D": "transformers Conv1D weight (dW = Xᵀ·dY)"}[kind]
            elif post_hook:
                reason = _elementwise_reason(model, p, p_names[0], mods, refusals, pre_hook)
                mode = "batched" if not distributed.is_dtensor(p) \
                    and p.numel() <= BATCHED_MAX_ELEMENTS else "hook"
            else:
                mode, reason = "deferred", ("this torch has no post-accumulate-grad hooks: "
                                            "applied in opt.step()")
            slot = _Slot(self, p, index_of[id(p)], p_names, mode)
            slot.kind, slot.reason = kind, reason
            slot.fsdp_shard = fsdp_shard
            if mode == "fused" and slot.dtensor:
                slot.layouts = distributed.fused_layouts(p, slot.name)
            self._slots[id(p)] = slot
            _OWNERS[id(p)] = weakref.ref(slot)
            if mode == "fused":
                self._hook_weight_node(slot)
                for m in mods:
                    _linear.patch(m, slot)
                    slot.modules.append(m)
            elif mode == "hook":
                ref = weakref.ref(slot)
                slot.handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, ref=ref: _param_grad_ready(ref)))
        if getattr(self, "_distributed", False):
            # a replica every rank holds alike (a parameter left plain in a parallel model) is
            # counted in the global statistics by rank 0 only
            import torch.distributed as dist
            for p in params:
                slot = self._slots[id(p)]
                if not slot.dtensor:
                    slot.counts = dist.get_rank() == 0
        if self._backward_start is None and any(s.fsdp_shard for s in self._slots.values()):
            # NOTE: prepended, so its hook on the outputs comes before FSDP2's own (the
            # root's pre-backward): a stale gradient is refused before FSDP2 starts anything
            self._backward_start = model.register_forward_hook(
                _BackwardStart(weakref.ref(self)), prepend=True)
        if shared:
            warnings.warn(
                "forge: parameters used in more than one place take the materialized-gradient "
                "path (their full gradient is accumulated and applied in opt.step()): "
                + "; ".join(shared), stacklevel=4)  # the user's constructor call

    def _hook_weight_node(self, slot: _Slot) -> None:
        """Holds W's AccumulateGrad node (torch makes it now if none exists, for the current
        stream) and hooks it: the pre-hook runs the fused step (_on_weight_grad_ready), the
        post-hook is the fallback where pre-hooks were skipped (_on_weight_grad_done). Where
        the C++ pre-hook is built (forge/_prehook.py) both hooks are its, calling these two
        only for what it does not take."""
        p = slot.param
        with torch.enable_grad():
            slot.acc_node = p.view_as(p).grad_fn.next_functions[0][0]
        ref = weakref.ref(slot)
        python_prehook = lambda grads, ref=ref: _weight_grad_ready(ref, grads)  # noqa: E731
        if slot.record is not None:  # (rebind_streams: the old node's hook passes through)
            slot.record.enabled = False
            slot.record = slot.record_call = slot.cpp_linear = None
        cpp = _prehook.get() if not slot.dtensor else None
        if cpp is not None:
            # NOTE: the C++ Linear backward arms the update Python readied (_ready_record),
            # the C++ pre-hook makes it; both call the Python ones for everything else
            # (docs/design.md §7.4)
            if self._clock is None:
                self._clock = cpp.Clock()
            slot.record = cpp.Record(p, self._clock, self._lib.wgrad_step_address,
                                     python_prehook, lambda ref=ref: _weight_grad_done(ref),
                                     lambda status, ref=ref: _armed_call_failed(ref, status),
                                     lambda x, dy, w, ref=ref: _linear_fallback(ref, x, dy, w))
            cpp.install(slot.record)
            cpp.register_hand_off_record(slot.key, slot.record)  # (a compiled backward's)
            slot.cpp_linear = cpp.fused_linear if slot.kind == "Linear" else cpp.fused_conv1d
            return
        slot.handles.append(slot.acc_node.register_prehook(python_prehook))
        # Fallback: torch 2.4's non-reentrant checkpoint runs W's AccumulateGrad without its
        # pre-hooks (but with its post-hooks); see _on_weight_grad_done.
        slot.handles.append(slot.acc_node.register_hook(
            lambda grad_inputs, grad_outputs, ref=ref: _weight_grad_done(ref)))

    # ------------------------------------------------------------------ backward callbacks

    def _second_update_error(self, slot: _Slot) -> RuntimeError:
        return RuntimeError(
            f"forge: parameter '{slot.name}' got a second gradient before opt.step(), but its "
            f"update already ran inside backward (mode='{self._mode_name()}'): call opt.step() "
            "after every backward(), or build the optimizer with mode='deferred' (or 'auto') "
            "to accumulate micro-batches. A parameter used in several reentrant checkpoint "
            "segments also does this: use use_reentrant=False.")

    def _create_graph_error(self, slot: _Slot) -> RuntimeError:
        return RuntimeError(
            f"forge: a backward with create_graph=True reached '{slot.name}', whose update "
            f"runs inside backward (mode='{self._mode_name()}'): its gradient in .grad could "
            "not be differentiated. Nothing was updated. Build the optimizer with "
            "mode='deferred' (or 'auto', deciding at the first step), or take the gradients "
            "with torch.autograd.grad(..., create_graph=True)")

    def _linear_backward(self, slot: _Slot, x, dy, weight, keep_operands: bool = True):
        """A fused weight's use in a backward: x and dy kept for its update, or (not
        keep_operands: a compiled backward's hand-off that keeps none, _ops.py) dW formed now
        in W's dtype. Returns W's stand-in gradient (its first use), None (a later one), or
        dW (a backward that must see it)."""
        if torch.is_grad_enabled():
            # backward(create_graph=True): .grad must hold dW with its graph (a gradient
            # penalty through .grad, Hessian-vector products), as torch computes it
            if not self._deferring:
                raise self._create_graph_error(slot)
            self._graphed_grads = True
            return _materialize_dw(x, dy, weight)
        if self._begun_step != self._step_id:
            self._begin_step()  # (before this backward reads or updates any weight, and
            # before deciding where the update runs: it may hold the step)
        if slot.armed:  # a second use of W in this backward, or the last backward's call
            self._settle_armed(slot)
        if self._deferring:
            if slot.uses == 0 and slot.param.grad is not None and slot.held is None:
                # NOTE: the gradient of earlier micro-batches waits in slot.held while this
                # backward runs, so nothing of autograd's own accumulates into it.
                slot.held, slot.param.grad = slot.param.grad, None
        elif slot.updated_at == self._step_id:
            raise self._second_update_error(slot)
        if slot.layouts is not None:  # tensor parallel: this rank's columns / full tokens
            mesh = slot.param.device_mesh
            x = distributed.as_local_rows(x, slot.layouts[0], mesh)
            dy = distributed.as_local_rows(dy, slot.layouts[1], mesh)
        if slot.param._backward_hooks:
            # a tensor hook (W.register_hook: a gradient mask, a clamp) must see W's whole
            # gradient: it arrives at W's node as from a use outside the Linear, hooked
            if not slot.warned_hooked:
                slot.warned_hooked = True
                warnings.warn(
                    f"forge: weight '{slot.name}' has a tensor hook (register_hook): its "
                    "gradient is materialized for the hook, then updated (no fused step)",
                    stacklevel=2)
            if slot.dtensor:  # (this rank's shard, as a DTensor of the weight's layout)
                dw = _materialize_dw(x, dy, distributed.local(weight))
                return distributed.as_state(dw, weight, tuple(weight.shape))
            return _materialize_dw(x, dy, weight)
        x2, ldx = _linear.as_rows(x, slot.cols)
        dy2, lddy = _linear.as_rows(dy, slot.rows)
        if dy.is_cuda:
            index = dy.get_device()  # NOTE: an int, without building a torch.device
            handle = _linear.current_stream_handle(index)
        else:
            index = handle = None
        slot.uses += 1
        dense = not keep_operands
        if (not dense and slot.record is not None and slot.uses == 1 and not slot.pending
                and slot.partial is None and self._arm(slot, x2, ldx, dy2, lddy, handle)):
            return slot.marker
        if not slot.pending and slot.partial is None:
            if dense:
                slot.partial = product(x2, dy2, slot.param.dtype).reshape(slot.local().shape)
            else:
                slot.pending.append((x2, ldx, dy2, lddy, handle, index))
        else:  # a second use in this backward: sum this one and the earlier ones in fp32
            if slot.partial is not None and slot.partial.dtype != torch.float32:
                slot.partial = slot.partial.float()
            for px, _, pdy, *_ in slot.pending + [(x2, ldx, dy2, lddy, handle, index)]:
                slot.partial = _add_dw(slot.partial, px, pdy)
            slot.pending.clear()
        if slot.uses > 1:
            return None
        # NOTE: W's AccumulateGrad pre-hook is where the fused step runs, and torch 2.4's
        # non-reentrant checkpoint skips that hook when dW is None. So the first use of W in
        # a backward returns a defined stand-in: one zero expanded to W's shape (no memory).
        # The hook knows it by identity and drops it; a sum with a dW from another use is a
        # new tensor and takes the materialized path, as it must.
        # NOTE: made once per weight and reused: a fresh one cost a fill kernel and ~50 µs of
        # host time per Linear per step on the H200's host (forge-bench --profile).
        # Nothing writes to it: autograd copies an expanded gradient before accumulating it.
        # (Remade if the weight moved: _update then says what changed.)
        slot.marker = self._stand_in(slot, weight)
        return slot.marker

    @staticmethod
    def _stand_in(slot: _Slot, weight: torch.Tensor) -> torch.Tensor:
        """slot's stand-in dW, made once (remade if the weight moved)."""
        stand_in = slot.stand_in
        if stand_in is None or stand_in.dtype != weight.dtype or stand_in.device != weight.device:
            zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
            if slot.dtensor:  # (a DTensor weight's gradient is a DTensor of its layout)
                zero = zero.expand(distributed.local(weight).shape)
                slot.stand_in = distributed.as_state(zero, weight, tuple(weight.shape))
            else:
                slot.stand_in = zero.expand(weight.shape)
        return slot.stand_in

    def _arm(self, slot: _Slot, x2, ldx, dy2, lddy, handle) -> bool:
        """The first use of a fused W in this backward, from the Python Linear backward, where
        its C++ pre-hook can make the update: the call _update_wgrad would make is written
        into slot's kept args and its record armed with X and dY (as the C++ Linear backward
        arms it); the pre-hook calls the library when the stand-in arrives alone, and
        _settle_armed commits the call, or takes the operands back where it was never made (a
        second use, another gradient, no pre-hook). False (nothing changed) where the update
        takes the Python path: a parameter without states yet, a capture, another stream, an
        operand dtype the args do not fit. The step's first arming checks the step first
        (_check_step), as its first update would."""
        if self._deferring or self._capturing or slot.layouts is not None:
            return False
        if self._checked_step != self._step_id:
            self._check_step()  # (what the step's first update does: nothing has changed yet)
        ready = self._ready_for(slot, handle)
        if ready is None or not slot.record.is_ready:
            return False
        tokens = x2.size(0) if x2.dim() == 2 else _linear.row_count(x2)
        if tokens <= 0 or self._write_wgrad_call(slot, ready, x2, ldx, dy2, lddy, tokens) is None:
            return False
        slot.record.arm(x2, ldx, dy2, lddy)
        slot.marker = slot.stand_in
        return True

    def _settle_armed(self, slot: _Slot) -> None:
        """Once Python meets an armed weight again (its next use, its node's Python hooks,
        step()): a call the C++ pre-hook made is committed (the step count and updated_at, as
        _update_wgrad's success sets them); an armed call never made becomes the pending pair
        the Python path expects (one use of W, its stand-in returned; a compiled backward's,
        where the C++ hand-off armed it, counted among in_graph_uses)."""
        record = slot.record
        in_graph = record is not None and record.armed_in_graph
        settled = record.settle() if record is not None else None
        if settled is None:
            return
        if settled is True:
            hp = slot.kept_args["wgrad"][2]  # (hparams.step: the step the call made)
            self._commit_step(self.state[slot.param], hp.step, hp)
            slot.updated_at = self._step_id
            slot.marker = None
            slot.uses = slot.in_graph_uses = 0
            return
        x2, ldx, dy2, lddy = settled
        index = dy2.get_device() if dy2.is_cuda else None
        slot.pending.append((x2, ldx, dy2, lddy, slot.ready[1], index))
        slot.uses = max(slot.uses, 1)
        if in_graph:  # (the C++ hand-off's use, which hand_off_in_graph did not count)
            slot.in_graph_uses += 1
        slot.marker = slot.stand_in

    def _settle_all(self) -> None:
        """_settle_armed for every weight whose record is busy (before anything reads the
        step counts, the updates made, or the pending pairs)."""
        for slot in self._slots.values():
            if slot.armed:
                self._settle_armed(slot)

    def _on_weight_grad_ready(self, slot: _Slot, grads) -> Optional[tuple]:
        """W's AccumulateGrad pre-hook: every use of W in this backward is done."""
        if self._begun_step != self._step_id:
            self._begin_step()  # (a gradient from outside the Linear alone: the step's first)
        if slot.armed:  # (the C++ pre-hook's: what it did not take, armed or not)
            self._settle_armed(slot)
        arrived = grads[0] if grads else None
        pending = slot.pending
        # NOTE: the common case first, once per fused Linear per step: one use of W, its
        # stand-in arrived (or nothing), immediate mode, X and dY on this stream; the same
        # steps as the general path below, fewer of them.
        if (arrived is slot.marker and len(pending) == 1 and slot.partial is None
                and not self._deferring and slot.updated_at != self._step_id):
            x2, ldx, dy2, lddy, handle, index = pending[0]
            tokens = x2.size(0) if x2.dim() == 2 else _linear.row_count(x2)
            if tokens > 0 and (handle is None or handle == _linear.current_stream_handle(index)):
                slot.marker = None
                self._update_wgrad(slot, x2, ldx, dy2, lddy, handle, tokens)
                consumed = slot._consumed  # (its dtype and device: checked by the update)
                slot.param.grad = consumed if consumed is not None else slot.consumed_grad()
                pending.clear()
                slot.uses = slot.in_graph_uses = 0
                return (None,) if arrived is not None else None
        if not self._deferring and torch.is_grad_enabled():
            raise self._create_graph_error(slot)  # (a weight reached only outside its Linear)
        outside = None if arrived is None or arrived is slot.marker else \
            self._outside_grad(slot, arrived)
        slot.marker = None
        consumed = (None,) if arrived is not None else None  # nothing reaches .grad
        if not slot.pending and slot.partial is None and outside is None:
            self._restore_held(slot)
            return consumed
        uses = slot.uses + (1 if outside is not None else 0)
        if uses > 1 and not slot.warned_multi_use:
            slot.warned_multi_use = True
            warnings.warn(
                f"forge: weight '{slot.name}' had {uses} uses in one backward (a Linear "
                "applied more than once, or its weight also used outside the Linear); it "
                "takes the materialized-gradient path: its full gradient is summed in fp32, "
                "then updated once", stacklevel=2)
        if self._deferring:
            self._defer_weight_grad(slot, outside)
            slot.grad_left = weakref.ref(slot.param.grad)
        elif slot.updated_at == self._step_id:
            raise self._second_update_error(slot)
        elif len(slot.pending) == 1 and slot.partial is None and outside is None \
                and _linear.row_count(slot.pending[0][0]) > 0:
            x2, ldx, dy2, lddy, handle, index = slot.pending[0]
            # NOTE: X and dY are ready on the stream backward made them on: the step runs
            # there. Autograd normally runs this hook on that same stream; switching streams
            # (a context manager around a wrapper of the raw handle) only when it did not
            # saves host time on every Linear. Handle 0 is the legacy default stream, a real
            # stream: only None means the CPU.
            if handle is None or handle == _linear.current_stream_handle(index):
                self._update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=handle)
            else:
                with torch.cuda.stream(_linear.stream_of_handle(handle, index)):
                    self._update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=handle)
            slot.param.grad = slot.consumed_grad()
        else:
            self._update(slot, grad=self._summed_weight_grad(slot, outside))
            slot.param.grad = slot.consumed_grad()
        slot.clear_backward()
        return consumed

    def _outside_grad(self, slot: _Slot, arrived: torch.Tensor) -> Optional[torch.Tensor]:
        """What of W's gradient `arrived` (not the marker itself) came from uses outside its
        Linears: None for a view of the stand-in (a compiled graph may hand one back), or,
        after two or more hand-offs in a compiled backward, for a sum of their stand-ins,
        all zero. (An outside gradient of exact zeros is then taken for none: the update
        differs at most in the sign of a zero gradient element.)"""
        stand_in = slot.stand_in
        if stand_in is not None and not slot.dtensor and arrived.data_ptr() == stand_in.data_ptr():
            if slot.marker is None:  # no hand-off ran: a replay of a compiled backward
                raise RuntimeError(
                    f"forge: the gradient of '{slot.name}' arrived without its Linear's "
                    "hand-off of X and dY: a CUDA graph replay of a compiled backward "
                    "(torch.compile mode='reduce-overhead')? Compile without CUDA graphs; "
                    "forge.graphs.CUDAGraphStep graphs a whole training step")
            return None
        if slot.in_graph_uses > 1 and not bool(arrived.any()):
            return None
        return arrived

    def _summed_weight_grad(self, slot: _Slot, outside) -> torch.Tensor:
        """The full gradient of a weight with several uses in this backward, summed in fp32;
        a gradient from a use outside its Linears alone, as it arrived."""
        if slot.partial is None and not slot.pending and outside is not None:
            if slot.dtensor:  # (an outside use's DTensor gradient, as this rank's shard)
                outside = distributed.grad_as_param(outside, slot.param)
            return outside.reshape(slot.local().shape)
        grad = slot.partial
        for x2, _, dy2, *_ in slot.pending:
            grad = _add_dw(grad, x2, dy2)
        if outside is not None:
            if slot.dtensor:  # (an outside use's DTensor gradient, as this rank's shard)
                outside = distributed.grad_as_param(outside, slot.param)
            grad = outside.float() if grad is None else grad.add_(outside)
        return grad.reshape(slot.local().shape)

    def _defer_weight_grad(self, slot: _Slot, outside) -> None:
        """Deferred mode: adds this backward's gradient of W to what it holds and leaves it in
        W.grad for the loop and opt.step(): a FactoredGrad of its X and dY while those take
        fewer bytes than dW in W's dtype, else of that dense dW (deferred_store "auto"); a
        plain dense .grad in W's dtype with deferred_store "grad"."""
        p = slot.param
        slot.grad_arrivals += 1  # (an auto optimizer's first step reads it)
        held, slot.held = slot.held, None
        if held is None:
            held = p.grad  # (the fallback path has taken autograd's sum out already)
        single = len(slot.pending) == 1 and slot.partial is None and outside is None
        if single:
            x2, _, dy2, *_ = slot.pending[0]
            x2, dy2 = _linear.rows_2d(x2), _linear.rows_2d(dy2)
        if consumed_of(held) is not None or (isinstance(held, FactoredGrad) and held.on_applied):
            # the last step's gradient, left in .grad (a held step: base.py, _begin_step):
            # this backward's goes on top of it (and of any earlier one's), in a FactoredGrad
            # whatever its size, marked so
            if not isinstance(held, FactoredGrad):
                held = self._new_factored(slot)
                held.on_applied = True
            if single and not slot.dtensor:
                held.add_factors(x2, dy2)
            else:
                held.add_dense(self._summed_weight_grad(slot, outside))
            p.grad = held
            return
        if slot.dtensor:  # a shard's gradient: dense, as a DTensor of the weight's layout
            local = distributed.local(held) if held is not None else None
            if single and local is not None:
                add_product(local, x2, dy2)
            elif single:
                held = distributed.as_state(product(x2, dy2, p.dtype), p, tuple(p.shape))
            elif local is not None:
                local.add_(self._summed_weight_grad(slot, outside))
            else:
                dw = self._summed_weight_grad(slot, outside).to(p.dtype)
                held = distributed.as_state(dw, p, tuple(p.shape))
            p.grad = held
            return
        # (a gradient with its graph, backward(create_graph=True): .grad holds it as it is)
        graphed = outside is not None and outside.requires_grad
        if (self._deferred_store != "grad" and not graphed
                and (held is None or isinstance(held, FactoredGrad))):
            if held is None:
                held = self._new_factored(slot)
            if single:
                held.add_factors(x2, dy2, keep=self._keep_factors(
                    slot, held.factor_bytes() + x2.numel() * x2.element_size()
                    + dy2.numel() * dy2.element_size()))
            else:
                held.add_dense(self._summed_weight_grad(slot, outside))
            p.grad = held
            return
        # a plain dense gradient in W's dtype, as autograd would keep it
        if isinstance(held, FactoredGrad):  # (deferred_store switched to "grad" between steps)
            held = held.scaled_dense()
        if single:
            if held is None:
                held = product(x2, dy2, p.dtype)
            else:
                add_product(held, x2, dy2)
        else:
            dw = self._summed_weight_grad(slot, outside)
            held = dw.to(p.dtype) if held is None else held.add_(dw)
        p.grad = held

    def _new_factored(self, slot: _Slot) -> FactoredGrad:
        """An empty FactoredGrad of slot's weight, in this step's cohort."""
        grad = FactoredGrad(slot.param, slot.name)
        grad.cohort = self._step_cohort()
        grad.cohort.append(weakref.ref(grad))
        return grad

    def _step_cohort(self) -> list:
        """The weak references to this step's FactoredGrads (FactoredGrad.cohort), one list
        per step."""
        if self._cohort_step != self._step_id:
            self._cohort, self._cohort_step = [], self._step_id
        return self._cohort

    def _keep_factors(self, slot: _Slot, factor_bytes: int) -> bool:
        """Whether a weight keeps its gradient as X and dY rather than as dense dW (both in a
        FactoredGrad): deferred_store 'factors' always, else while the factors take fewer
        bytes than dW in W's dtype (what torch's gradient would take)."""
        if self._deferred_store == "factors":
            return True
        return factor_bytes < slot.param.numel() * slot.param.element_size()

    def _restore_held(self, slot: _Slot) -> None:
        if slot.held is not None:
            slot.param.grad, slot.held = slot.held, None

    def _on_weight_grad_done(self, slot: _Slot) -> None:
        """W's AccumulateGrad post-hook. Normally the pre-hook has already run the update
        and nothing is left; where the pre-hook was skipped (torch 2.4, non-reentrant
        checkpoint) the stand-in dW (and any dW from a use outside the Linear) has been
        accumulated into W.grad: take it back out and run the update from here."""
        if slot.armed:
            self._settle_armed(slot)
        if not slot.pending and slot.partial is None:
            return
        arrived = slot.param.grad
        slot.param.grad = None  # W never keeps autograd's own .grad
        # The stand-in was copied (a dense zero tensor); an all-zero sum is no outside use.
        if arrived is not None and not bool(arrived.any()):
            arrived = None
        slot.marker = None  # what arrived is the sum, never the stand-in itself
        self._on_weight_grad_ready(slot, (arrived,))

    def _on_param_grad_ready(self, slot: _Slot) -> None:
        _linear.refuse_compiled_autograd()
        p = slot.param
        if p.grad is None:
            return
        if self._begun_step != self._step_id:
            self._begin_step()  # (before deciding where this update runs: it may hold the step)
        if self._deferring:
            slot.grad_version = p.grad._version  # a change before step(): the loop used it
            slot.grad_left = weakref.ref(p.grad)  # another tensor at step(): the loop's
            slot.grad_arrivals += 1  # more than one backward before step(): accumulated
            return
        if torch.is_grad_enabled():
            raise self._create_graph_error(slot)
        if slot.updated_at == self._step_id:
            raise self._second_update_error(slot)
        self._update(slot, grad=distributed.grad_as_param(p.grad, p))
        p.grad = slot.consumed_grad()
