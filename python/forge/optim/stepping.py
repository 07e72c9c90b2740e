"""stepping.py — what opt.step() does.

It settles what backward left (the C++ records, weights whose node never ran), then
  deferred   applies every gradient held in .grad (fused Linear weights through one fused
             GEMM + update over all their tokens, the small plain ones in one library call),
             clipped first with max_grad_norm (the exact global norm), each freed once applied;
  immediate  updates what backward did not (shared weights, the batched small parameters);
then steps on zeros the parameters a zeroing loop keeps a gradient for that no backward
reached, and closes the step: its statistics (stats.py), the lagged clip coefficient of the
next step's updates in backward, the step count. Where the step's updates run is modes.py's.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from . import distributed
from .deferred import FactoredGrad, consumed_of, fill_sum_sqs, sum_sq_fp64
from .modes import applied_still_held
from .routing import BATCHED_MAX_ELEMENTS


class Stepper:
    """opt.step()'s work (see the file header), over the optimizer's parts."""

    def __init__(self, shared, router, backward, updater, modes, stats,
                 max_grad_norm: Optional[float], distributed_: bool):
        self.shared = shared
        self._router = router
        self._backward = backward
        self._updater = updater
        self._modes = modes
        self._stats = stats
        self.max_grad_norm = max_grad_norm
        self._distributed = distributed_  # the statistics are summed over the ranks
        self._clip_norm: Optional[torch.Tensor] = None  # this step's norm before clipping
        self.last_clip_norm: Optional[torch.Tensor] = None  # the last step's
        # The norm immediate mode's next coefficient comes from: the last finite one of a step
        # (None before any); saved in the state dict, so a resumed run clips as it would have.
        self.lagged_norm: Optional[float] = None

    def step(self, pre_hooks: bool) -> None:
        """One opt.step() (pre_hooks: the optimizer has step pre-hooks, which keep an auto
        optimizer deferred)."""
        shared, modes = self.shared, self._modes
        if not shared.capturing and self._router.any_cuda \
                and torch.cuda.is_current_stream_capturing():
            warnings.warn(
                "forge: this step is being captured into a CUDA graph, but not by a "
                "forge.graphs.CUDAGraphStep given this optimizer: every replay would repeat this "
                "step's step number, lr and rounding seed; capture it with "
                "forge.graphs.CUDAGraphStep(fn, optimizers=[..., this optimizer])", stacklevel=3)
        if shared.begun_step != shared.step_id:
            modes.begin_step()
        if not shared.deferring and shared.checked_step != shared.step_id:
            self._updater.check_step()  # (a refusal first: before the warning below, or any update)
        self._backward.settle_all()  # (calls the C++ pre-hook made, or ones it never reached)
        shared.lapse_ready()
        if not shared.deferring and not shared.capturing:
            modes.refuse_hparams_changed_after_updates()
        slots = shared.slots.values()
        missed = [s for s in slots if s.pending or s.partial is not None]
        missed = [s.name for s in missed if not self._router.recover_replaced_node(s)]
        if missed:
            warnings.warn(
                "forge: backward ran through the nn.Linear of " + ", ".join(missed) + " but "
                "never reached the weight's gradient node, so it was not updated this step",
                stacklevel=3)
        for slot in slots:
            # NOTE: tested first: after a step whose updates all ran, both are no-ops
            if slot.pending or slot.partial is not None or slot.uses or slot.in_graph_uses:
                slot.clear_backward()
            if slot.held is not None:
                slot.restore_held()
        deferred = shared.deferring
        if deferred:
            self._step_deferred(pre_hooks)
        else:
            self._step_immediate()
        if modes.grads_zeroed:
            self._step_on_zeros()
        modes.grads_zeroed = False
        stats = self._stats
        if self._distributed and not shared.capturing:
            stats.reduce(slot.device for slot in slots)
        if not deferred and self.max_grad_norm is not None and stats.current:
            # lagged clipping: the true norm is the consumed one (summed over the ranks) over
            # the coefficient used
            self._clip_norm = torch.tensor(stats.consumed_norm() / self._updater.backward_scale)
            if math.isfinite(float(self._clip_norm)):  # (fp32: a sum beyond it is inf)
                self.lagged_norm = float(self._clip_norm)
        stats.close()
        self.last_clip_norm, self._clip_norm = self._clip_norm, None
        for slot in slots:
            if slot.updated_at == shared.step_id:
                slot.grad_kept = True  # (torch's gradient stays until a zero_grad)
        modes.end_hold()
        self.set_backward_scale()
        shared.step_id += 1

    def set_backward_scale(self) -> None:
        """The gradient scale of the next step's updates inside backward: immediate mode's
        lagged clip coefficient (1 where the step runs deferred)."""
        self._updater.backward_scale = \
            self._lagged_clip_scale() if not self.shared.deferring else 1.0

    def in_progress(self) -> bool:
        """A backward ran since the last step() (an update ran, or a gradient is held)."""
        self._backward.settle_all()
        step_id = self.shared.step_id
        return any(s.updated_at == step_id or s.pending or s.partial is not None
                   or s.held is not None
                   or (s.param.grad is not None and consumed_of(s.param.grad) is None)
                   for s in self.shared.slots.values())

    def _lagged_clip_scale(self) -> float:
        """Immediate mode with max_grad_norm: the clip coefficient of the previous step's
        norm (1 for the first step). After a step whose norm was not finite (its elements
        finite, their sum beyond fp32: a non-finite element is skipped and left out of the
        norm), that of the last finite norm: torch's formula would give 0 there, a gradient
        scale the library refuses, and the run would stop at the next backward."""
        if self.max_grad_norm is None or self.lagged_norm is None:
            return 1.0
        return min(1.0, self.max_grad_norm / (self.lagged_norm + 1e-6))

    def _leave_consumed(self, slot) -> None:
        """After a parameter's update in step(): a fused weight or an FSDP2 shard keeps its
        ConsumedGrad in .grad, where torch.optim's gradient would stay until zero_grad; any
        other gets None (Slot.keeps_consumed)."""
        consumed = slot.consumed_grad() if slot.keeps_consumed else None
        slot.param.grad = consumed
        if consumed is not None:
            self._modes.left.append(slot)

    def _step_immediate(self) -> None:
        shared, update = self.shared, self._updater.update
        batch = []  # (slot, grad, scale) of the plain gradients: one library call
        for slot in shared.slots.values():
            p = slot.param
            grad = p.grad
            if grad is None:
                continue
            if consumed_of(grad) is not None:
                if slot.keeps_consumed:
                    self._modes.left.append(slot)  # (kept: where torch's gradient would stay)
                else:
                    p.grad = None
                continue
            if slot.updated_at == shared.step_id:
                raise RuntimeError(
                    f"forge: parameter '{slot.name}' was already updated in this step's "
                    "backward but holds a .grad again; set it to None, or use mode='deferred' "
                    "to apply gradients in step()")
            if grad.is_sparse:
                raise RuntimeError(f"forge: parameter '{slot.name}' has a sparse gradient, "
                                   "which FORGE does not support")
            if slot.dtensor:
                update(slot, grad=distributed.grad_as_param(grad, p))
                p.grad = None
            else:
                batch.append((slot, distributed.grad_as_param(grad, p), None))
        self._updater.update_batch(batch)
        for slot, _, _ in batch:  # (only once applied: a refused batch keeps them)
            slot.param.grad = None

    def _step_on_zeros(self) -> None:
        """The loop zeroed the last step's gradients keeping them (zero_grad(set_to_none=False)):
        torch.optim steps every parameter that holds a gradient tensor, so each parameter
        updated before (a gradient tensor in torch's place) that no backward of this step
        reached steps on zeros: its moments decay and weight decay applies. (One whose
        gradient a zero_grad set to None before is not: torch holds none for it.)"""
        shared = self.shared
        batch = []
        for slot in shared.slots.values():
            p = slot.param
            if not slot.grad_kept or slot.updated_at == shared.step_id or p.grad is not None:
                continue
            if slot.keeps_consumed or slot.dtensor:  # (one parameter's zeros at a time)
                self._updater.update(slot, grad=distributed.grad_as_param(torch.zeros_like(p), p),
                                     scale=1.0)
                self._leave_consumed(slot)
                if p.grad is not None:
                    consumed_of(p.grad).zeroed = True  # (zeros, as torch's gradient is now)
            else:
                batch.append((slot, torch.zeros_like(p), None))
        self._updater.update_batch(batch)

    def _step_deferred(self, pre_hooks: bool) -> None:
        shared, modes, update = self.shared, self._modes, self._updater.update
        held = [(slot, slot.param.grad) for slot in shared.slots.values()
                if slot.param.grad is not None]
        for slot, grad in held:
            if consumed_of(grad) is not None and slot.updated_at == shared.step_id:
                raise RuntimeError(f"forge: parameter '{slot.name}' holds the gradient of an "
                                   "update that already ran inside backward")
        applied = [slot.name for slot, grad in held if consumed_of(grad) is not None
                   or (isinstance(grad, FactoredGrad) and grad.on_applied)]
        if applied:  # (the last step's gradient, with or without this step's on top)
            raise RuntimeError(applied_still_held(applied, "Nothing was updated; the "
                                                  "gradients stay as they are."))
        for slot, grad in held:
            if not isinstance(grad, FactoredGrad) and grad.is_sparse:
                raise RuntimeError(f"forge: parameter '{slot.name}' has a sparse gradient, "
                                   "which FORGE does not support")
        self._updater.check_step()  # nothing is written unless every update of the step can run
        if shared.mode == "auto" and modes.auto_deferring is None:
            modes.decide_auto(held, self.max_grad_norm is not None, pre_hooks)
        clip, nonfinite_norm = 1.0, False
        if self.max_grad_norm is not None and held:
            total = _global_norm([g for _, g in held])
            self._clip_norm = total
            # torch's clip_grad_norm_: max_norm / (total + 1e-6), at most 1, in fp32
            clip = torch.clamp(self.max_grad_norm / (total.float() + 1e-6), max=1.0)
            # NOTE: one host synchronization per step, for both numbers
            clip, total_norm = torch.stack([clip.double(), total.double()]).tolist()
            # A total norm that is not finite (a diverged step: an inf or NaN gradient element)
            # or beyond fp32 gives no usable clip coefficient (NaN, or 0): torch's
            # clip_grad_norm_ would scale every gradient by it. Here every element of the step
            # is then a non-finite gradient, which the update skips and counts
            # (opt.nonfinite_count): no weight or state changes.
            nonfinite_norm = not (math.isfinite(total_norm) and math.isfinite(clip) and clip > 0)
            if not nonfinite_norm:
                self.lagged_norm = total_norm  # (an immediate step next clips with it)
        # NOTE: each gradient is freed as soon as its update ran, so the step's peak is what is
        # held plus the states made so far, never every gradient and every state at once (on
        # the first step the states are made here, weight by weight, in the memory the
        # gradients leave). The small plain gradients (biases, norm scales) go in one call.
        batch = []  # (slot, grad, scale) of the small plain gradients: one library call
        for i in range(len(held)):
            (slot, grad), held[i] = held[i], None
            if nonfinite_norm:
                if isinstance(grad, FactoredGrad):
                    grad.spend()
                nan = torch.full(slot.local().shape, float("nan"), dtype=slot.param.dtype,
                                 device=slot.param.device)
                update(slot, grad=nan, scale=1.0)
                del grad, nan
                self._leave_consumed(slot)
                continue
            if isinstance(grad, FactoredGrad):
                scale = clip * _host_scale(grad.scale)
                if grad.dense is not None:
                    update(slot, grad=grad.dense, scale=scale)
                elif any(x.size(0) for x, _ in grad.parts):
                    x2, dy2 = grad.tokens()
                    update(slot, x=(x2, x2.stride(0)), dy=(dy2, dy2.stride(0)), scale=scale)
                    del x2, dy2
                else:  # zeroed (zero_grad(set_to_none=False)), or backwards of no tokens (an
                    # empty batch, an expert no token was routed to): torch steps on zeros
                    update(slot, grad=torch.zeros_like(slot.param), scale=1.0)
                grad.spend()
            elif slot.dtensor or grad.numel() > BATCHED_MAX_ELEMENTS:
                update(slot, grad=distributed.grad_as_param(grad, slot.param), scale=clip)
            else:
                batch.append((slot, distributed.grad_as_param(grad, slot.param), clip))
                continue
            del grad
            self._leave_consumed(slot)
        self._updater.update_batch(batch)
        for slot, _, _ in batch:
            self._leave_consumed(slot)


def _global_norm(grads) -> torch.Tensor:
    """The global L2 norm of a step's gradients (FactoredGrad or dense), fp64, on the first
    gradient's device."""
    device = grads[0].device
    fill_sum_sqs(grads)  # (the factored ones batched where their shapes allow)
    squares = []
    for g in grads:
        if isinstance(g, FactoredGrad):
            sq = sum_sq_fp64(g.dense) if g.dense is not None else g.sum_sq()
            scale = g.scale
            if torch.is_tensor(scale):
                sq = sq * scale.double() ** 2
            elif scale != 1:
                sq = sq * float(scale) ** 2
        elif distributed.is_dtensor(g):  # a shard's sum: summed over the ranks once
            sq = g.double().square().sum().full_tensor()
        else:
            sq = sum_sq_fp64(g)
        squares.append(sq.to(device))
    # NOTE: one stack and one sum, not an addition launched per gradient
    return torch.stack(squares).sum().sqrt()


def _host_scale(scale) -> float:
    return float(scale.item()) if torch.is_tensor(scale) else float(scale)
