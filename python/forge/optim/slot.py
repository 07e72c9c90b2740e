"""slot.py — one optimized parameter: its path, its names, and what backward left for it.

routing.py makes a Slot per parameter (and says why it takes its path); the layers' patched
forwards (forge/_linear.py), a compiled backward's hand-off (forge/_ops.py) and forge.loss find
it and enter the optimizer through it: linear_backward and hand_off_in_graph lead to the
optimizer's backward part (backward.py), which the slot reaches through a weak reference. The
fields are what the parts read and write of the parameter: its C structs' caches (updater.py,
store.py), the pairs and partial sums a backward handed over (backward.py), its C++ record
(forge/_prehook.py).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .. import _linear, _ops
from . import distributed
from .deferred import ConsumedGrad


class Slot:
    """One optimized parameter (see the file header)."""

    def __init__(self, backward, param: torch.Tensor, index: int, names: List[str], mode: str):
        self.backward_ref = weakref.ref(backward)  # the optimizer's Backward (backward.py)
        self.live = False           # routed through this slot: set by routing.py's attach/detach
        self.param = param
        self.index = index          # position in param_groups order (state_dict index)
        self.names = names
        self.name = names[0]
        self.mode = mode            # "fused" | "hook" | "batched" | "deferred"
        self.kind = None            # fused: the layer, "Linear" or "Conv1D"
        # Muon's rule: libforge's step writes a direction, muon.py orthogonalizes and applies it
        # (updater.py); never a C++ record, a batch shared with others, a shard or a capture
        self.muon = False
        self.reason = ""            # why this path, in words (opt.summary())
        self.state_format = None    # store.STATE_FORMATS, fixed when its states are made
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
        # dtype where a compiled backward's hand-off formed it (backward.py, linear_backward)
        self.partial: Optional[torch.Tensor] = None
        self.uses = 0               # Linear backward calls seen since the last update
        self.updated_at = -1        # the step (Shared.step_id) of its last update
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
        # Whether such a hand-off formed its dW (it could not keep X and dY): from then on each
        # step's check readies its element-wise call for the C++ hand-off too (updater.py)
        self.forms_in_graph = False
        # (formats and data pointers, forge_param) of the last update; rebuilt on any change
        self.param_cache: Optional[Tuple[tuple, Any]] = None
        self.modules: List[nn.Linear] = []
        self.warned_multi_use = False
        self.warned_hooked = False
        # Deferred mode: the gradient of earlier backwards while another runs (see
        # backward.py, linear_backward), a hook parameter's .grad version when backward last
        # left it, the .grad backward last left (a weak reference), and how many backwards left
        # a hook or fused parameter a gradient (an auto optimizer's first step reads the last
        # three).
        self.held: Optional[torch.Tensor] = None
        self.grad_version: Optional[int] = None
        self.grad_left: Optional[weakref.ReferenceType] = None
        self.grad_arrivals = 0
        # Whether torch.optim would hold a gradient tensor for it now: one since a step updated
        # it, until a zero_grad set it to None (stepping.py, step_on_zeros reads it)
        self.grad_kept = False
        self._consumed: Optional[torch.Tensor] = None  # consumed_grad()
        self.fsdp_shard = False  # FSDP2 manages it (set by routing.py)
        # The host's fast path (updater.py): the forge_param checked this step (and the step),
        # the (state dict, param group) checked with it, and the forge_wgrad_args kept for
        # this parameter with what its struct fields hold.
        self.struct = None
        self.struct_step = -1
        self.checked: Optional[Tuple[Dict[str, Any], Dict[str, Any]]] = None
        self.ready: Optional[tuple] = None  # a fused weight's args for this step (updater.py)
        # (state dict, param group, device index) where the C++ part repeats the step's check
        # of this weight (recheck.py), else None
        self.rechecked: Optional[tuple] = None
        # "wgrad" / "elementwise" -> (the forge_*_args kept for its calls, what its struct
        # fields hold, a view of its hparams): calls.py, kept_args
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
        (backward.py, settle_armed)."""
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
        gradient would stay until zero_grad (modes.py, begin_step reads it): a fused weight's
        (the update comes before any other gradient could accumulate into it), and an FSDP2
        shard's (FSDP2 accumulates into it, after the step's first callback: routing.py,
        BackwardStart). Any other parameter's AccumulateGrad may run before a step's first
        callback, so its .grad is None after opt.step()."""
        return self.mode == "fused" or self.fsdp_shard

    def clear_backward(self) -> None:
        """Forgets what backward handed over since the last update (pending pairs, the fp32
        partial sum, the use counts)."""
        self.pending.clear()
        self.partial = None
        self.uses = 0
        self.in_graph_uses = 0

    def restore_held(self) -> None:
        """The gradient of earlier backwards, set aside while another ran, back in .grad."""
        if self.held is not None:
            self.param.grad, self.held = self.held, None

    def local(self) -> torch.Tensor:
        """The parameter's tensor on this rank (a DTensor's local shard)."""
        return distributed.local(self.param)

    def is_live(self) -> bool:
        """Whether a live optimizer routes this parameter through the slot."""
        return self.live and self.backward_ref() is not None

    def stand_in_for(self, weight: torch.Tensor) -> torch.Tensor:
        """The stand-in dW of this weight, made once (remade if the weight moved): one zero
        expanded to its shape (no memory); backward.py says why."""
        stand_in = self.stand_in
        if stand_in is None or stand_in.dtype != weight.dtype or stand_in.device != weight.device:
            zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
            if self.dtensor:  # (a DTensor weight's gradient is a DTensor of its layout)
                zero = zero.expand(distributed.local(weight).shape)
                self.stand_in = distributed.as_state(zero, weight, tuple(weight.shape))
            else:
                self.stand_in = zero.expand(weight.shape)
        return self.stand_in

    def outside_grad(self, arrived: torch.Tensor) -> Optional[torch.Tensor]:
        """What of W's gradient `arrived` (not the marker itself) came from uses outside its
        Linears: None for a view of the stand-in (a compiled graph may hand one back), or,
        after two or more hand-offs in a compiled backward, for a sum of their stand-ins,
        all zero. (An outside gradient of exact zeros is then taken for none: the update
        differs at most in the sign of a zero gradient element.)"""
        stand_in = self.stand_in
        if stand_in is not None and not self.dtensor and arrived.data_ptr() == stand_in.data_ptr():
            if self.marker is None:  # no hand-off ran: a replay of a compiled backward
                raise RuntimeError(
                    f"forge: the gradient of '{self.name}' arrived without its Linear's "
                    "hand-off of X and dY: a CUDA graph replay of a compiled backward "
                    "(torch.compile mode='reduce-overhead')? Compile without CUDA graphs; "
                    "forge.graphs.CUDAGraphStep graphs a whole training step")
            return None
        if self.in_graph_uses > 1 and not bool(arrived.any()):
            return None
        return arrived

    def add_use(self, x2: torch.Tensor, dy2: torch.Tensor) -> None:
        """A second (or later) use of W in this backward: its dW and those of the pending
        pairs summed into the fp32 partial sum."""
        if self.partial is not None and self.partial.dtype != torch.float32:
            self.partial = self.partial.float()
        for px, _, pdy, *_ in self.pending:
            self.partial = add_dw(self.partial, px, pdy)
        self.partial = add_dw(self.partial, x2, dy2)
        self.pending.clear()

    def summed_grad(self, outside) -> torch.Tensor:
        """The full gradient of a weight with several uses in this backward, summed in fp32;
        a gradient from a use outside its Linears alone, as it arrived."""
        if self.partial is None and not self.pending and outside is not None:
            if self.dtensor:  # (an outside use's DTensor gradient, as this rank's shard)
                outside = distributed.grad_as_param(outside, self.param)
            return outside.reshape(self.local().shape)
        grad = self.partial
        for x2, _, dy2, *_ in self.pending:
            grad = add_dw(grad, x2, dy2)
        if outside is not None:
            if self.dtensor:  # (an outside use's DTensor gradient, as this rank's shard)
                outside = distributed.grad_as_param(outside, self.param)
            grad = outside.float() if grad is None else grad.add_(outside)
        return grad.reshape(self.local().shape)

    def linear_backward(self, x, dy, weight, node=None):
        """x: [..., cols], dy: [..., rows], the fused step's operands for this [rows, cols]
        parameter (dW = dyᵀ·x): a Linear's input and output gradient, a Conv1D's output
        gradient and input. `node`: the Linear's backward node, where it is a Python one."""
        _linear.refuse_compiled_autograd()
        use = _linear.weight_grad_use(self.param, node)
        if use == _linear.GRAD_DROPPED:
            return None
        backward = self.backward_ref() if self.live else None
        if use == _linear.GRAD_RETURNED or backward is None:
            return materialize_dw(x, dy, weight)  # what torch returns; plain nn.Linear's
        return backward.linear_backward(self, x, dy, weight)

    def hand_off_in_graph(self, x, dy, weight, keep: bool) -> torch.Tensor:
        """linear_backward for forge::wgrad_hand_off, a compiled backward's hand-off: the op
        returns a tensor of one layout (the stand-in's), so a second use of W in this backward
        gets the stand-in too; the pre-hook then sees their sum (backward.py,
        on_weight_grad_ready)."""
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
        backward = self.backward_ref() if self.live else None
        if backward is None:
            raise RuntimeError(
                f"forge: the optimizer of '{self.name}' was detached between a compiled forward "
                "and its backward: its gradient has no place to go; detach between steps")
        if x.is_cuda and not backward.shared.capturing \
                and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "forge: a compiled backward with fused Linears is being captured into a CUDA "
                "graph (torch.compile mode='reduce-overhead'?): a replay would run its kernels "
                "but not hand X and dY to the optimizer. Compile without CUDA graphs; "
                "forge.graphs.CUDAGraphStep graphs a whole training step")
        self.in_graph_uses += 1
        dw = backward.linear_backward(self, x, dy, weight, keep_operands=keep)
        return self.stand_in if dw is None else dw


def materialize_dw(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ·X in the compute dtype, as torch's linear backward, cast to W's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    return dy2.t().matmul(x2).to(weight.dtype)


def add_dw(acc: Optional[torch.Tensor], x2: torch.Tensor, dy2: torch.Tensor) -> torch.Tensor:
    """acc += dYᵀ·X in fp32 ([rows, cols]); x2, dy2 as _linear.as_rows gives them."""
    dw = _linear.rows_2d(dy2).float().t().matmul(_linear.rows_2d(x2).float())
    return dw if acc is None else acc.add_(dw)
