"""backward.py — what a forge optimizer does inside backward: the callbacks of its hooks.

routing.py decides each parameter's path and puts the hooks on; they call in here:
  linear_backward        a fused Linear's backward (Slot.linear_backward; a compiled backward's
                         hand-off, Slot.hand_off_in_graph) hands over X and dY, or dW
  on_weight_grad_ready   W's AccumulateGrad pre-hook: every use of W in this backward is done;
                         its update runs (immediate mode) or its gradient is kept in .grad
                         (deferred: a FactoredGrad, deferred.py)
  on_weight_grad_done    W's post-hook, where a pre-hook was skipped
  on_param_grad_ready    a hook parameter's post-accumulate-grad hook
Where the C++ part is built (forge/_prehook.py) a fused weight's record is armed by the C++
Linear backward and its call made by the C++ pre-hook; Python meets the record again later and
settles it (settle_armed). RowUpdate is forge.loss's way in: its head's update, made block of
rows by block in the head's own backward.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional, Tuple

import torch

from .. import _linear
from . import distributed
from .calls import write_operands
from .deferred import FactoredGrad, add_product, consumed_of, product
from .slot import materialize_dw


class Backward:
    """The optimizer's callbacks inside backward (see the file header). shared: its Shared;
    updater: its Updater (updater.py); modes: its Modes (modes.py)."""

    def __init__(self, shared, updater, modes):
        self.shared = shared
        self._modes = modes
        # NOTE: bound once: the per-Linear path calls them without looking them up
        self._begin_step = modes.begin_step
        self._update = updater.update
        self._update_wgrad = updater.update_wgrad
        self._check_step = updater.check_step
        self._ready_for = updater.ready_for
        self._current_ready = updater.current_ready
        self._commit_made = updater.commit_made
        self._settle_registered = updater.settle_registered
        self._cohort: list = []  # this step's FactoredGrads, weakly (new_factored)
        self._cohort_step = -1

    # ------------------------------------------------------------------ errors

    def second_update_error(self, slot) -> RuntimeError:
        return RuntimeError(
            f"forge: parameter '{slot.name}' got a second gradient before opt.step(), but its "
            f"update already ran inside backward (mode='{self.shared.mode}'): call opt.step() "
            "after every backward(), or build the optimizer with mode='deferred' (or 'auto') "
            "to accumulate micro-batches. A parameter used in several reentrant checkpoint "
            "segments also does this: use use_reentrant=False.")

    def create_graph_error(self, slot) -> RuntimeError:
        return RuntimeError(
            f"forge: a backward with create_graph=True reached '{slot.name}', whose update "
            f"runs inside backward (mode='{self.shared.mode}'): its gradient in .grad could "
            "not be differentiated. Nothing was updated. Build the optimizer with "
            "mode='deferred' (or 'auto', deciding at the first step), or take the gradients "
            "with torch.autograd.grad(..., create_graph=True)")

    # ------------------------------------------------------------------ a Linear's hand-off

    def linear_backward(self, slot, x, dy, weight, keep_operands: bool = True):
        """A fused weight's use in a backward: x and dy kept for its update, or (not
        keep_operands: a compiled backward's hand-off that keeps none, _ops.py) dW formed now
        in W's dtype. Returns W's stand-in gradient (its first use), None (a later one), or
        dW (a backward that must see it)."""
        shared = self.shared
        if torch.is_grad_enabled():
            # backward(create_graph=True): .grad must hold dW with its graph (a gradient
            # penalty through .grad, Hessian-vector products), as torch computes it
            if not shared.deferring:
                raise self.create_graph_error(slot)
            self._modes.graphed_grads = True
            return materialize_dw(x, dy, weight)
        if shared.begun_step != shared.step_id:
            self._begin_step()  # (before this backward reads or updates any weight, and
            # before deciding where the update runs: it may hold the step)
        if slot.armed:  # a second use of W in this backward, or the last backward's call
            self.settle_armed(slot)
        if shared.deferring:
            if slot.uses == 0 and slot.param.grad is not None and slot.held is None:
                # NOTE: the gradient of earlier micro-batches waits in slot.held while this
                # backward runs, so nothing of autograd's own accumulates into it.
                slot.held, slot.param.grad = slot.param.grad, None
        elif slot.updated_at == shared.step_id:
            raise self.second_update_error(slot)
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
                dw = materialize_dw(x, dy, distributed.local(weight))
                return distributed.as_state(dw, weight, tuple(weight.shape))
            return materialize_dw(x, dy, weight)
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
                if not slot.forms_in_graph:  # (from the next step, the C++ hand-off forms it)
                    slot.forms_in_graph = True
                    shared.check_version += 1
                formed = product(x2, dy2, slot.param.dtype).reshape(slot.local().shape)
                if (slot.record is not None and slot.uses == 1
                        and self._arm_dense(slot, formed, handle)):
                    return slot.marker
                slot.partial = formed
            else:
                slot.pending.append((x2, ldx, dy2, lddy, handle, index))
        else:  # a second use in this backward: sum this one and the earlier ones in fp32
            slot.add_use(x2, dy2)
        if slot.uses > 1:
            return None
        # NOTE: W's AccumulateGrad pre-hook is where the fused step runs, and torch 2.4's
        # non-reentrant checkpoint skips that hook when dW is None. So the first use of W in
        # a backward returns a defined stand-in: one zero expanded to W's shape (no memory).
        # The hook knows it by identity and drops it; a sum with a dW from another use is a
        # new tensor and takes the materialized path, as it must.
        # NOTE: made once per weight and reused: a fresh one costs a fill kernel and host time
        # per Linear per step (forge-bench --profile showed it).
        # Nothing writes to it: autograd copies an expanded gradient before accumulating it.
        # (Remade if the weight moved: the update then says what changed.)
        slot.marker = slot.stand_in_for(weight)
        return slot.marker

    def _arm(self, slot, x2, ldx, dy2, lddy, handle) -> bool:
        """The first use of a fused W in this backward, from the Python Linear backward, where
        its C++ pre-hook can make the update: the call update_wgrad would make is written into
        slot's kept args and its record armed with X and dY (as the C++ Linear backward arms
        it); the pre-hook calls the library when the stand-in arrives alone, and settle_armed
        commits the call, or takes the operands back where it was never made (a second use,
        another gradient, no pre-hook). False (nothing changed) where the update takes the
        Python path: a parameter without states yet, a capture, another stream, an operand
        dtype the args do not fit. The step's first arming checks the step first
        (check_step), as its first update would."""
        shared = self.shared
        if shared.deferring or shared.capturing or slot.layouts is not None:
            return False
        if shared.checked_step != shared.step_id:
            self._check_step()  # (what the step's first update does: nothing has changed yet)
        ready = self._ready_for(slot, handle)
        if ready is None or not slot.record.is_ready:
            return False
        tokens = x2.size(0) if x2.dim() == 2 else _linear.row_count(x2)
        if tokens <= 0 or not write_operands(ready[2], x2, ldx, dy2, lddy, tokens):
            return False
        slot.record.arm(x2, ldx, dy2, lddy)
        slot.marker = slot.stand_in
        return True

    def _arm_dense(self, slot, formed, handle) -> bool:
        """_arm for a compiled backward's hand-off that formed dW (`formed`, in W's dtype):
        where the check readied slot's element-wise call for this step, its record is armed
        with dW, as the C++ hand-off arms it, so that a later use of W in this backward finds
        it armed (and takes the Python path, as after _arm). False: nothing changed."""
        shared = self.shared
        if shared.deferring or shared.capturing or slot.layouts is not None:
            return False
        if shared.checked_step != shared.step_id:
            self._check_step()
        if (self._ready_for(slot, handle) is None or not slot.record.is_ready
                or not slot.record.arm_dense(formed)):
            return False
        slot.marker = slot.stand_in
        return True

    def settle_armed(self, slot) -> None:
        """Once Python meets an armed weight again (its next use, its node's Python hooks,
        step()): a call the C++ pre-hook made is committed (the step count and updated_at, as
        update_wgrad's success sets them); an armed call never made becomes the pending pair
        the Python path expects (one use of W, its stand-in returned; a compiled backward's,
        where the C++ hand-off armed it, counted among in_graph_uses); an armed element-wise
        call never made, its formed dW (slot.partial)."""
        record = slot.record
        in_graph = record is not None and record.armed_in_graph
        settled = record.settle() if record is not None else None
        if settled is None:
            return
        if settled is True or isinstance(settled, str):  # (True: the fused call)
            self._commit_made(slot, "wgrad" if settled is True else settled)
            slot.marker = None
            slot.uses = slot.in_graph_uses = 0
            return
        if len(settled) == 1:
            slot.partial = settled[0].reshape(slot.local().shape)
            slot.uses = max(slot.uses, 1)
            if in_graph:
                slot.in_graph_uses += 1
            slot.marker = slot.stand_in
            return
        x2, ldx, dy2, lddy = settled
        index = dy2.get_device() if dy2.is_cuda else None
        slot.pending.append((x2, ldx, dy2, lddy, self._current_ready(slot)[1], index))
        slot.uses = max(slot.uses, 1)
        if in_graph:  # (the C++ hand-off's use, which hand_off_in_graph did not count)
            slot.in_graph_uses += 1
        slot.marker = slot.stand_in

    def settle_all(self) -> None:
        """settle_armed for every weight whose record is busy (before anything reads the
        step counts, the updates made, or the pending pairs); the calls the C++ pre-hook made
        for the weights the C++ part's check registered are committed there, as settle_armed
        commits them (recheck.py, settle)."""
        left = self._settle_registered()
        for slot in self.shared.slots.values() if left is None else left:
            if slot.armed:
                self.settle_armed(slot)

    # ------------------------------------------------------------------ W's gradient node

    def on_weight_grad_ready(self, slot, grads) -> Optional[tuple]:
        """W's AccumulateGrad pre-hook: every use of W in this backward is done."""
        shared = self.shared
        if shared.begun_step != shared.step_id:
            self._begin_step()  # (a gradient from outside the Linear alone: the step's first)
        if slot.armed:  # (the C++ pre-hook's: what it did not take, armed or not)
            self.settle_armed(slot)
        arrived = grads[0] if grads else None
        pending = slot.pending
        # NOTE: the common case first, once per fused Linear per step: one use of W, its
        # stand-in arrived (or nothing), immediate mode, X and dY on this stream; the same
        # steps as the general path below, fewer of them.
        if (arrived is slot.marker and len(pending) == 1 and slot.partial is None
                and not shared.deferring and slot.updated_at != shared.step_id):
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
        if not shared.deferring and torch.is_grad_enabled():
            raise self.create_graph_error(slot)  # (a weight reached only outside its Linear)
        outside = None if arrived is None or arrived is slot.marker else \
            slot.outside_grad(arrived)
        slot.marker = None
        consumed = (None,) if arrived is not None else None  # nothing reaches .grad
        if not slot.pending and slot.partial is None and outside is None:
            slot.restore_held()
            return consumed
        uses = slot.uses + (1 if outside is not None else 0)
        if uses > 1 and not slot.warned_multi_use:
            slot.warned_multi_use = True
            warnings.warn(
                f"forge: weight '{slot.name}' had {uses} uses in one backward (a Linear "
                "applied more than once, or its weight also used outside the Linear); it "
                "takes the materialized-gradient path: its full gradient is summed in fp32, "
                "then updated once", stacklevel=2)
        if shared.deferring:
            self._defer_weight_grad(slot, outside)
            slot.grad_left = weakref.ref(slot.param.grad)
        elif slot.updated_at == shared.step_id:
            raise self.second_update_error(slot)
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
            self._update(slot, grad=slot.summed_grad(outside))
            slot.param.grad = slot.consumed_grad()
        slot.clear_backward()
        return consumed

    def on_weight_grad_done(self, slot) -> None:
        """W's AccumulateGrad post-hook. Normally the pre-hook has already run the update
        and nothing is left; where the pre-hook was skipped (torch 2.4, non-reentrant
        checkpoint) the stand-in dW (and any dW from a use outside the Linear) has been
        accumulated into W.grad: take it back out and run the update from here."""
        if slot.armed:
            self.settle_armed(slot)
        if not slot.pending and slot.partial is None:
            return
        arrived = slot.param.grad
        slot.param.grad = None  # W never keeps autograd's own .grad
        # The stand-in was copied (a dense zero tensor); an all-zero sum is no outside use.
        if arrived is not None and not bool(arrived.any()):
            arrived = None
        slot.marker = None  # what arrived is the sum, never the stand-in itself
        self.on_weight_grad_ready(slot, (arrived,))

    def on_param_grad_ready(self, slot) -> None:
        """A hook parameter's post-accumulate-grad hook: its gradient is complete."""
        _linear.refuse_compiled_autograd()
        p = slot.param
        if p.grad is None:
            return
        shared = self.shared
        if shared.begun_step != shared.step_id:
            self._begin_step()  # (before deciding where this update runs: it may hold the step)
        if shared.deferring:
            slot.grad_version = p.grad._version  # a change before step(): the loop used it
            slot.grad_left = weakref.ref(p.grad)  # another tensor at step(): the loop's
            slot.grad_arrivals += 1  # more than one backward before step(): accumulated
            return
        if torch.is_grad_enabled():
            raise self.create_graph_error(slot)
        if slot.updated_at == shared.step_id:
            raise self.second_update_error(slot)
        self._update(slot, grad=distributed.grad_as_param(p.grad, p))
        p.grad = slot.consumed_grad()

    # ------------------------------------------------------------------ forge.loss's head

    def updates_inside(self, slot) -> bool:
        """Whether slot's update of this step runs inside the running backward (forge.loss's
        head: RowUpdate), this being the step's first callback where none ran before (it may
        hold the step, deferring it); a second update of the weight in one step is refused."""
        shared = self.shared
        if shared.begun_step != shared.step_id:
            self._begin_step()
        if shared.deferring:
            return False
        if slot.updated_at == shared.step_id:
            raise self.second_update_error(slot)
        return True

    def update_rows(self, slot, x2: torch.Tensor, dy: torch.Tensor,
                    rows: Optional[Tuple[int, int]], last: bool) -> None:
        """The update of rows [r0, r1) of slot's weight (rows None: all of them) from x2
        [T, cols] and dy [T, r1 - r0]; last: the step is counted by this call."""
        self._update(slot, x=(x2, x2.stride(0)), dy=(dy, dy.stride(0)), rows=rows, last=last)

    # ------------------------------------------------------------------ deferred mode

    def _defer_weight_grad(self, slot, outside) -> None:
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
            # the last step's gradient, left in .grad (a held step: modes.py, begin_step):
            # this backward's goes on top of it (and of any earlier one's), in a FactoredGrad
            # whatever its size, marked so
            if not isinstance(held, FactoredGrad):
                held = self._new_factored(slot)
                held.on_applied = True
            if single and not slot.dtensor:
                held.add_factors(x2, dy2)
            else:
                held.add_dense(slot.summed_grad(outside))
            p.grad = held
            return
        if slot.dtensor:  # a shard's gradient: dense, as a DTensor of the weight's layout
            local = distributed.local(held) if held is not None else None
            if single and local is not None:
                add_product(local, x2, dy2)
            elif single:
                held = distributed.as_state(product(x2, dy2, p.dtype), p, tuple(p.shape))
            elif local is not None:
                local.add_(slot.summed_grad(outside))
            else:
                dw = slot.summed_grad(outside).to(p.dtype)
                held = distributed.as_state(dw, p, tuple(p.shape))
            p.grad = held
            return
        # (a gradient with its graph, backward(create_graph=True): .grad holds it as it is)
        graphed = outside is not None and outside.requires_grad
        store = self._modes.deferred_store
        if (store != "grad" and not graphed
                and (held is None or isinstance(held, FactoredGrad))):
            if held is None:
                held = self._new_factored(slot)
            if single:
                factor_bytes = held.factor_bytes() + x2.numel() * x2.element_size() \
                    + dy2.numel() * dy2.element_size()
                held.add_factors(x2, dy2, keep=self.keeps_factors(p, factor_bytes))
            else:
                held.add_dense(slot.summed_grad(outside))
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
            dw = slot.summed_grad(outside)
            held = dw.to(p.dtype) if held is None else held.add_(dw)
        p.grad = held

    def keeps_factors(self, param: torch.Tensor, factor_bytes: int) -> bool:
        """Whether a deferred step keeps a fused weight's X and dY (factor_bytes of them) rather
        than its dW: while they take fewer bytes than dW in W's dtype, what torch's gradient
        would take (deferred_store "auto"); always with "factors", never with "grad"."""
        store = self._modes.deferred_store
        return store == "factors" or (
            store == "auto" and factor_bytes < param.numel() * param.element_size())

    def _new_factored(self, slot) -> FactoredGrad:
        """An empty FactoredGrad of slot's weight, in this step's cohort (FactoredGrad.cohort:
        the weak references to this step's FactoredGrads, one list per step)."""
        grad = FactoredGrad(slot.param, slot.name)
        step_id = self.shared.step_id
        if self._cohort_step != step_id:
            self._cohort, self._cohort_step = [], step_id
        grad.cohort = self._cohort
        grad.cohort.append(weakref.ref(grad))
        return grad


class RowUpdate:
    """forge.loss's head: a fused weight's update made in its own backward, block of rows by
    block (each block of vocabulary rows from the hidden states and its logits' gradient),
    the step counted once, by the last block; then the weight holds its ConsumedGrad, as
    after a fused Linear's update."""

    def __init__(self, backward: Backward, slot):
        self._backward = backward
        self._slot = slot

    @classmethod
    def begin(cls, weight: torch.Tensor) -> Optional["RowUpdate"]:
        """The update of `weight` where a live forge optimizer fuses it and runs its update
        inside this backward (this is the step's first callback where nothing ran before:
        it may hold the step, deferring it); None where none does (the head then returns dW).
        Refuses a second update of the weight in one step."""
        slot = _linear.slot_of(weight)
        if slot is None or slot.mode != "fused":
            return None
        backward = slot.backward_ref()
        if backward is None or not backward.updates_inside(slot):
            return None
        return cls(backward, slot)

    @staticmethod
    def deferred_factors(weight: torch.Tensor, factor_bytes: int):
        """forge.loss's head where a forge optimizer defers the fused weight's gradient (begin
        returned None for that reason): the weight's slot, whose linear_backward then takes
        the head's X and whole dY as any Linear's (a FactoredGrad of them), where keeping them
        (factor_bytes) is what a Linear's deferred store would do (Backward.keeps_factors);
        else None (the head returns dW)."""
        slot = _linear.slot_of(weight)
        if slot is None or slot.mode != "fused" or slot.dtensor or weight._backward_hooks:
            return None
        backward = slot.backward_ref()
        if backward is None or not backward.shared.deferring:
            return None
        return slot if backward.keeps_factors(weight, factor_bytes) else None

    def update(self, x2: torch.Tensor, dy: torch.Tensor,
               rows: Optional[Tuple[int, int]] = None, last: bool = True) -> None:
        """The update of rows [r0, r1) of the weight (None: all of them) from x2 [T, cols]
        and dy [T, r1 - r0]; last: the step is counted by this call."""
        self._backward.update_rows(self._slot, x2, dy, rows, last)

    def finish(self) -> None:
        """The weight's gradient was applied: its ConsumedGrad goes in .grad."""
        slot = self._slot
        consumed = slot.consumed_grad()
        if consumed is not None:
            slot.param.grad = consumed

