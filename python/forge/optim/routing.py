"""routing.py — which path each parameter takes, and the hooks that lead its gradient there.

Each optimized parameter gets a slot (slot.py) and one of four paths:

  fused     the weight of an nn.Linear (or of transformers' Conv1D, a transposed Linear):
            its forward is rerouted to FusedLinearFunction (FusedConv1DFunction; both in
            forge/_linear.py), whose backward computes dX and hands (X, dY) to the slot. When
            autograd reaches the weight's AccumulateGrad node (all consumers of W in this
            backward are done), a pre-hook runs forge_wgrad_step: dW = dYᵀX tile by tile
            with the update applied in place; no dW tensor exists. If W had more than one
            use (a Linear applied twice, or W also read outside its Linear) the hook sums
            the full gradient in fp32 instead and applies forge_elementwise_step once.
            In a backward compiled by torch.compile the hand-off is the custom operator
            forge::wgrad_hand_off (forge/_ops.py, Slot.hand_off_in_graph); the hooks run
            after the compiled backward, and a weight with several uses in it gets the sum
            of their stand-ins, which Slot.outside_grad tells from an outside gradient.
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

The Router attaches the slots to the model (patched forwards, hooks) and detaches them; the
hooks call the optimizer's Backward (backward.py) through the slot, which they hold weakly.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, List, Sequence

import torch
import torch.nn as nn

from .. import _linear, _prehook
from . import distributed
from .deferred import consumed_of
from .slot import Slot, materialize_dw

# Tests set this to exercise the fallback for torch without the autograd hooks.
_FORCE_NO_HOOKS = False

# Element-wise parameters of at most this many elements (biases, norm scales) take the
# "batched" path: no hook; step() applies all their gradients in one library call.
# NOTE: a hook per parameter costs the host a Python call and an update of its own inside
# backward (tens of µs each, 113 of them on Qwen3-0.6B), where freeing a gradient this small
# early saves nothing: up to 256 KiB each in fp32.
BATCHED_MAX_ELEMENTS = 1 << 16

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _has_post_accumulate_hook() -> bool:
    return (not _FORCE_NO_HOOKS
            and hasattr(torch.Tensor, "register_post_accumulate_grad_hook"))


def _has_node_prehook() -> bool:
    return not _FORCE_NO_HOOKS and hasattr(torch.autograd.graph.Node, "register_prehook")


def parameter_names(model: nn.Module) -> Dict[int, List[str]]:
    """id(param) -> every name it is registered under (two or more: shared/tied)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


# ---------------------------------------------------------------------- the hooks' callbacks
# (module functions holding the slot weakly: a hook never keeps an optimizer alive)

def _backward_of(slot):
    return slot.backward_ref() if slot is not None and slot.live else None


def _weight_grad_done(ref) -> None:
    slot = ref()
    backward = _backward_of(slot)
    if backward is not None:
        backward.on_weight_grad_done(slot)


def _weight_grad_ready(ref, grads):
    slot = ref()
    backward = slot.backward_ref() if slot is not None and slot.live else None
    if backward is None:
        return None
    return backward.on_weight_grad_ready(slot, grads)


def _armed_call_failed(ref, status: int, call: str) -> None:
    """The C++ pre-hook's call (forge_wgrad_step, or forge_elementwise_step on a formed dW)
    failed (nothing was committed): backward's hand-offs are dropped and the library's error
    raised."""
    slot = ref()
    if slot is None or slot.backward_ref() is None:
        raise RuntimeError(f"forge: {call} failed (status {status})")
    slot.marker = None
    slot.clear_backward()
    from .. import _lib
    _lib.get().check(status, call)


def _linear_fallback(ref, x, dy, weight):
    """The C++ Linear backward's dW where its record could not arm: the Python routing's."""
    slot = ref()
    if slot is None:
        return materialize_dw(x, dy, weight)
    return slot.linear_backward(x, dy, weight)


def _param_grad_ready(ref) -> None:
    slot = ref()
    backward = _backward_of(slot)
    if backward is not None:
        backward.on_param_grad_ready(slot)


class BackwardStart:
    """A model with FSDP2 shards: its forward hook. FSDP2 adds a shard's reduced gradient into
    its .grad before any of FORGE's callbacks of the step runs, so the step's first callback
    (modes.py, begin_step: what the last step left in .grad, zeroed or stale) is the start of
    the backward: a hook on the forward's outputs, run as the first of them gets its
    gradient."""

    def __init__(self, modes_ref):
        self.modes_ref = modes_ref

    def __call__(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._started, mode="any")

    def _started(self, grad) -> None:
        modes = self.modes_ref()
        shared = modes.shared if modes is not None else None
        if shared is not None and shared.attached and shared.begun_step != shared.step_id:
            modes.begin_step()


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


class WrapperCheck:
    """The model's forward pre-hook on several ranks (optimizer.py): checks once, at the first
    forward that records a graph before the first step, for a DDP / FSDP1 wrapper made after
    the optimizer, then removes itself (a wrapper made later still meets the first update's
    check)."""

    def __init__(self, router_ref):
        self.router_ref = router_ref

    def __call__(self, module, args) -> None:
        router = self.router_ref()
        if router is None or not torch.is_grad_enabled():
            return
        if router.shared.step_id == 0:
            distributed.check_no_replicating_wrapper(module)  # (raises: the hook stays)
        if router.wrapper_check is not None:
            router.wrapper_check.remove()
            router.wrapper_check = None


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


def owner_of(p: torch.Tensor):
    """The Backward (backward.py) of the live optimizer that drives p, or None."""
    ref = _OWNERS.get(id(p))
    slot = ref() if ref is not None else None
    if slot is None or slot.param is not p or not slot.is_live():
        return None
    return slot.backward_ref()


class Router:
    """The optimizer's slots on the model (see the file header). shared: its Shared;
    backward, modes: its parts (backward.py, modes.py), which the hooks reach."""

    def __init__(self, shared, lib, backward, modes, torch_name: str, distributed_: bool,
                 muon_group=lambda group: False):
        self.shared = shared
        self._lib = lib
        self._backward = backward
        self._modes = modes
        self._torch_name = torch_name
        # a model spread over ranks (DTensor parameters): a replica every rank holds alike is
        # counted in the global statistics by rank 0 only
        self._distributed = distributed_
        self.any_cuda = False  # a parameter on CUDA
        self.wrapper_check = None  # the model's WrapperCheck hook (optimizer.py makes it)
        self._muon_group = muon_group  # whether a param group's rule is Muon's (slot.muon)
        self._backward_start = None  # the model's BackwardStart hook, with FSDP2 shards

    def check_params(self, model: nn.Module, params: Sequence[torch.Tensor],
                     names: Dict[int, List[str]]) -> None:
        """Refuses, by name, a parameter FORGE cannot drive (before anything is touched)."""
        sparse = {id(_linear.registered_weight(m)) for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        for p in params:
            if id(p) not in names:
                raise ValueError(f"{self._torch_name}: a parameter of shape {list(p.shape)} in "
                                 "the param groups is not a parameter of the model")
            name = names[id(p)][0]
            if not isinstance(p, nn.Parameter) and not p.is_leaf:
                raise ValueError(f"parameter '{name}': not a leaf tensor")
            # (a frozen parameter of another dtype, e.g. a quantized base layer's uint8
            # storage, is accepted as torch.optim accepts it: it is never stepped)
            if p.dtype not in _SUPPORTED_DTYPES and p.requires_grad:
                raise TypeError(f"parameter '{name}': dtype {p.dtype} is not supported by FORGE "
                                "(float32 or bfloat16)")
            if p.device.type == "cuda":
                if not self._lib.has_cuda:
                    raise ValueError(
                        f"parameter '{name}' is on {p.device}, but this libforge "
                        f"({self._lib.path}) was built without the CUDA backend; rebuild with "
                        "nvcc available (-DFORGE_CUDA=ON) or keep the model on the CPU")
            elif p.device.type != "cpu":
                raise ValueError(f"parameter '{name}': device {p.device} is not supported by "
                                 "FORGE (cpu or cuda)")
            if p.is_sparse or not p.is_contiguous():
                raise ValueError(f"parameter '{name}': must be a dense contiguous tensor")
            if p.numel() == 0:
                raise ValueError(f"parameter '{name}': is empty")
            if id(p) in sparse:
                raise ValueError(f"parameter '{name}': nn.Embedding(sparse=True) gives sparse "
                                 "gradients, which FORGE does not support")
            owner = owner_of(p)
            if owner is not None:
                mine = owner is self._backward
                raise ValueError(f"parameter '{name}': already driven by "
                                 f"{'this' if mine else 'another'} forge optimizer"
                                 f"{'' if mine else '; call its .detach() first'}")

    def attach(self, model: nn.Module, params: Sequence[torch.Tensor],
               names: Dict[int, List[str]]) -> None:
        """A slot per parameter on its path: patched forwards, hooks (see the file header)."""
        shared = self.shared
        index_of = {id(p): i for i, p in enumerate(p for g in shared.param_groups
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
        self.any_cuda = self.any_cuda or any(p.is_cuda for p in params)
        tied = []
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
                tied.append(" = ".join(p_names))
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
            slot = Slot(self._backward, p, index_of[id(p)], p_names, mode)
            slot.kind, slot.reason = kind, reason
            slot.muon = self._muon_group(shared.group_of(slot))
            slot.fsdp_shard = fsdp_shard
            slot.live = True
            if mode == "fused" and slot.dtensor:
                slot.layouts = distributed.fused_layouts(p, slot.name)
            shared.slots[id(p)] = slot
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
        slots = shared.slots
        if self._distributed:
            import torch.distributed as dist
            for p in params:
                slot = slots[id(p)]
                if not slot.dtensor:
                    slot.counts = dist.get_rank() == 0
        if self._backward_start is None and any(s.fsdp_shard for s in slots.values()):
            # NOTE: prepended, so its hook on the outputs comes before FSDP2's own (the
            # root's pre-backward): a stale gradient is refused before FSDP2 starts anything
            self._backward_start = model.register_forward_hook(
                BackwardStart(weakref.ref(self._modes)), prepend=True)
        if tied:
            warnings.warn(
                "forge: parameters used in more than one place take the materialized-gradient "
                "path (their full gradient is accumulated and applied in opt.step()): "
                + "; ".join(tied), stacklevel=4)  # the user's constructor call

    def _hook_weight_node(self, slot) -> None:
        """Holds W's AccumulateGrad node (torch makes it now if none exists, for the current
        stream) and hooks it: the pre-hook runs the fused step (on_weight_grad_ready), the
        post-hook is the fallback where pre-hooks were skipped (on_weight_grad_done). Where
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
            # NOTE: the C++ Linear backward arms the update Python readied (updater.py,
            # ready_wgrad), the C++ pre-hook makes it; both call the Python ones for
            # everything else (docs/design.md §5.3)
            shared = self.shared
            if shared.clock is None:
                shared.clock = cpp.Clock()
            slot.record = cpp.Record(p, shared.clock, self._lib.wgrad_step_address,
                                     python_prehook, lambda ref=ref: _weight_grad_done(ref),
                                     lambda status, call, ref=ref:
                                     _armed_call_failed(ref, status, call),
                                     lambda x, dy, w, ref=ref: _linear_fallback(ref, x, dy, w))
            cpp.install(slot.record)
            cpp.register_hand_off_record(slot.key, slot.record)  # (a compiled backward's)
            slot.cpp_linear = cpp.fused_linear if slot.kind == "Linear" else cpp.fused_conv1d
            return
        slot.handles.append(slot.acc_node.register_prehook(python_prehook))
        # Fallback: torch 2.4's non-reentrant checkpoint runs W's AccumulateGrad without its
        # pre-hooks (but with its post-hooks); see Backward.on_weight_grad_done.
        slot.handles.append(slot.acc_node.register_hook(
            lambda grad_inputs, grad_outputs, ref=ref: _weight_grad_done(ref)))

    def rehook(self, slot) -> None:
        """Hooks W's AccumulateGrad node anew: the one torch holds now, or a new one."""
        for h in slot.handles:
            h.remove()
        slot.handles.clear()
        slot.acc_node = None  # the only reference: the node goes, the next one is new
        self._hook_weight_node(slot)

    def rebind_streams(self) -> None:
        """The fused weights' gradient nodes hooked anew, for the current CUDA stream
        (optimizer.py, rebind_streams, says why)."""
        if not self.shared.attached:
            return
        self._backward.settle_all()
        for slot in self.shared.slots.values():
            if slot.mode == "fused":
                self.rehook(slot)

    def recover_replaced_node(self, slot) -> bool:
        """At step(), for a fused weight whose Linear's backward ran but whose node hooks did
        not. torch makes a parameter a new AccumulateGrad node when its data changes dtype or
        device (model.double() then model.float(), say: the step refuses the weight while it
        differs from what the optimizer was built for, not once it is back), and the hooks were
        on the old one. Where that new node ran, it left the stand-in (and any gradient from a
        use outside the Linear) in W.grad, as where pre-hooks are skipped: the update runs from
        there (Backward.on_weight_grad_done), and W is hooked on its new node for the next
        steps. Returns whether it ran (False: the node is the hooked one, or it never ran)."""
        if slot.dtensor:
            return False
        p = slot.param
        with torch.enable_grad():
            node = p.view_as(p).grad_fn.next_functions[0][0]
        if node is slot.acc_node:
            return False
        ran = type(p.grad) is torch.Tensor
        if ran:
            self._backward.on_weight_grad_done(slot)
        self.rehook(slot)
        return ran

    def detach(self) -> None:
        """Gives the model back: plain nn.Linear forwards, no hooks."""
        shared = self.shared
        if not shared.attached:
            return
        for handle in (self.wrapper_check, self._backward_start):
            if handle is not None:
                handle.remove()
        self.wrapper_check = self._backward_start = None
        self._backward.settle_all()
        for slot in shared.slots.values():
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
            if _OWNERS.get(id(slot.param)) is not None and owner_of(slot.param) is self._backward:
                del _OWNERS[id(slot.param)]
            slot.live = False
        shared.attached = False
