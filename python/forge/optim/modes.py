"""modes.py — where a forge optimizer's updates run, and what its step's first callback reads.

  immediate  every update runs inside backward, as soon as its gradient is complete
  deferred   backward leaves each gradient in .grad (a fused weight's as a FactoredGrad:
             deferred.py) and step() applies them, torch.optim's contract
  auto       the first step deferred, then immediate unless the loop used a gradient before
             step() (decide_auto, at the end of that first step)
Any step runs deferred, whatever the mode, where its backward meets the last step's gradient
still in .grad, or a gradient of the weight's own (a held step: hold_step). Shared.deferring
says where the updates of the step in progress run; Shared.mode names the mode asked for.

begin_step is the step's first callback (a Linear's backward, a gradient hook, forge.loss's
head, the first update, or step()): before anything of the step is read or updated, it reads
what the last step left in the fused weights' .grad and what the loop did with it (zeroed it,
set it to None, or left it), and keeps every group's hyper-parameters as backward sees them.
docs/design.md §5.4-5.5 says why each of these is as it is.
"""
from __future__ import annotations

import logging
from typing import Optional

from .. import _lib
from .deferred import FactoredGrad, consumed_of

_log = logging.getLogger("forge")


def applied_still_held(names, then: str) -> str:
    """The error for gradients a step applied that are still in .grad at the next one."""
    return (f"forge: the gradient of {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
            "applied by the last opt.step() is still in .grad (under any this step's backward "
            "added): no zero_grad() since, so torch.optim would step on their sum, and FORGE "
            "keeps no weight gradient to add to. Call opt.zero_grad() (or model.zero_grad()) "
            "after each opt.step(); to accumulate micro-batches, run their backwards before "
            f"one opt.step() with mode='deferred' (or 'auto'). {then}")


def _own_grad(grad) -> bool:
    """Whether a .grad is a gradient of the parameter's own (a tensor autograd or the loop
    put there), not one this optimizer left (ConsumedGrad) or holds (FactoredGrad)."""
    if grad is None or consumed_of(grad) is not None:
        return False
    return not isinstance(getattr(grad, "_local_tensor", grad), FactoredGrad)


def _global_pre_hooks() -> bool:
    import torch.optim.optimizer as torch_optimizer
    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    return bool(hooks)


class Modes:
    """The optimizer's mode and the step's beginning (see the file header). shared: its
    Shared; hparams: its calls.HparamsTable."""

    def __init__(self, shared, hparams, mode: str, deferred_store: str,
                 accumulate_grad: bool):
        self.shared = shared
        self._hparams = hparams
        self._requested = (mode, deferred_store)  # what accumulate_grad=False returns to
        # deferred mode, per fused Linear: "auto" | "factors" | "grad" (backward.py reads it)
        self.deferred_store = "grad" if accumulate_grad else deferred_store
        # mode="auto": whether its loop needs the gradients before step() (every step then
        # deferred), as learned at its first step or loaded with a state dict; None: to learn
        self.auto_deferring: Optional[bool] = None
        # A held step's (hold_step) mode outside it (Shared.deferring's value), None outside one
        self.outside_hold: Optional[bool] = None
        self.loop_needs_grads = False  # a step pre-hook was registered (auto mode)
        self.graphed_grads = False  # a backward with create_graph=True reached a fused weight
        # What steps leave in .grad (deferred.py, ConsumedGrad): the slots whose ConsumedGrad
        # the last step() left (Slot.keeps_consumed), and whether the loop zeroed them keeping
        # them (set_to_none=False): stepping.py steps those on zeros
        self.left: list = []
        self.grads_zeroed = False
        # Each group's hyper-parameters as the step's first backward saw them: [(group, bytes
        # of its forge_hparams, or None where the values are refused later)]
        self.backward_hparams: list = []

    @property
    def requested_mode(self) -> str:
        """The mode the constructor was given ("auto", "immediate" or "deferred")."""
        return self._requested[0]

    @property
    def accumulate_grad(self) -> bool:
        return self.shared.deferring and self.deferred_store == "grad"

    def set_accumulate_grad(self, value: bool) -> None:
        """accumulate_grad switched between steps (the caller checked that none is in
        progress): deferred with dense gradients, or back to the constructor's mode."""
        shared = self.shared
        if value:
            shared.mode, self.deferred_store = "deferred", "grad"
        else:
            shared.mode, self.deferred_store = self._requested
        deferring = shared.mode == "deferred" or (
            shared.mode == "auto" and self.auto_deferring is not False)
        if self.outside_hold is not None:  # (a held step: its mode after it)
            self.outside_hold = deferring
        else:
            shared.deferring = deferring
        shared.lapse_ready()

    def allow_step_pre_hook(self) -> None:
        """A step pre-hook runs before the update: refused where updates run inside backward;
        an auto optimizer stays deferred."""
        if not self.shared.deferring or self.outside_hold is False:
            raise RuntimeError(
                "forge: a step pre-hook runs before the update, but this optimizer updates "
                f"inside backward (mode='{self.shared.mode}'); build it with "
                "mode='deferred' (or 'auto') to use step pre-hooks")
        self.loop_needs_grads = True

    def learned(self, meta) -> None:
        """After load_state_dict: an auto optimizer runs where the saved one ran (its dict's
        'forge' entry says what it learned of the loop), or learns anew."""
        shared = self.shared
        if shared.mode == "auto":
            learned = meta.get("auto_deferring") if meta.get("mode") == "auto" else None
            self.auto_deferring = learned if isinstance(learned, bool) else None
            shared.deferring = self.auto_deferring is not False

    # ------------------------------------------------------------------ the step's beginning

    def begin_step(self) -> None:
        """At a step's first callback (a Linear's backward, a gradient hook, the fused head's
        backward, the first update, or step()), before anything of the step is read or
        updated, or where an update runs decided: what the last step left in the fused
        weights' .grad. torch.optim would add this step's gradients to the ones it applied
        unless the loop zeroed them: where the loop set them to None nothing is left; where it
        zeroed them (set_to_none=False) the weight starts this step from a zero gradient, and
        the step then also updates, on zeros, the parameters that had a gradient before and
        that no backward of it reaches (stepping.py, step_on_zeros). Where one is left as it
        was, torch would add this step's gradients to it, which matters only if the loop steps
        before it zeroes them (another model's loss reaching these weights, as a GAN's
        generator loss reaches the discriminator, is zeroed first): the step holds every
        gradient until step() (hold_step), and a weight's lands on top of the applied one
        (FactoredGrad's on_applied), refused where read or stepped on. A DTensor shard's is
        refused here, before anything is updated."""
        shared = self.shared
        stale = []
        for slot in self.left:
            g = consumed_of(slot.param.grad)
            if g is None:
                slot.grad_kept = False  # (set to None, or replaced by the loop)
                continue
            if g.zeroed:
                g.zeroed = False
                slot.param.grad = None
                self.grads_zeroed = True
            else:
                stale.append(slot)
        self.left = []
        shared.begun_step = shared.step_id
        self.backward_hparams = self._hparams_snapshot()
        if stale:
            shards = [slot.name for slot in stale if slot.dtensor]
            if shards:
                raise RuntimeError(applied_still_held(shards, "Nothing was updated."))
            self.hold_step()
        elif not shared.deferring:
            self._hold_for_own_grads()

    def _hold_for_own_grads(self) -> None:
        """A fused weight may hold a gradient no step of this optimizer made: from a backward
        before it was built or before the parameter was added to it, or one the loop put in
        .grad. torch adds this step's gradient to it; an update inside backward would drop it.
        The step runs deferred instead (hold_step), which sums the two. (Not for DTensor
        shards: under tensor parallel their .grad was found set at every step's first
        callback, a case not examined further.)"""
        if any(slot.mode == "fused" and not slot.dtensor and _own_grad(slot.param.grad)
               for slot in self.shared.slots.values()):
            self.hold_step()

    def hold_step(self) -> None:
        """This step runs deferred, whatever the mode: every gradient waits in .grad until
        step() (or zero_grad). An immediate optimizer is immediate again after it, or from
        the zero_grad(set_to_none=True) that leaves nothing held."""
        shared = self.shared
        if self.outside_hold is None:
            self.outside_hold = shared.deferring
            shared.deferring = True
            shared.lapse_ready()

    def end_hold(self) -> None:
        shared = self.shared
        if self.outside_hold is not None:
            shared.deferring, self.outside_hold = self.outside_hold, None
            shared.lapse_ready()

    def zeroed(self, set_to_none: bool) -> None:
        """The loop's zero_grad: keeping zeros (stepping.py, step_on_zeros), or to None,
        which leaves nothing held: a held step goes on in the optimizer's mode."""
        if not set_to_none:
            self.grads_zeroed = True
        else:
            for slot in self.shared.slots.values():
                slot.grad_kept = False
            self.end_hold()

    # ------------------------------------------------------------------ hyper-parameters

    def _hparams_snapshot(self) -> list:
        snapshot = []
        for group in self.shared.param_groups:
            try:
                snapshot.append((group, bytes(self._hparams.of(group)[0])))
            except (KeyError, TypeError, ValueError, RuntimeError):
                snapshot.append((group, None))  # (refused, by name, where an update reads it)
        return snapshot

    def hparams_changed(self) -> Optional[str]:
        """What a loop changed in a group's hyper-parameters since the step's first backward
        (a scheduler stepped before opt.step(), an lr set there), in words; None if nothing."""
        for group, before in self.backward_hparams:
            if before is None:
                continue
            try:
                now = self._hparams.of(group)[0]
            except (KeyError, TypeError, ValueError, RuntimeError):
                continue
            if bytes(now) == before:
                continue
            old = _lib.Hparams.from_buffer_copy(before)
            index = next((i for i, g in enumerate(self.shared.param_groups) if g is group), "?")
            return ", ".join(f"{name} of param group {index} ({getattr(old, name)!r} -> "
                             f"{getattr(now, name)!r})" for name, _ in _lib.Hparams._fields_
                             if getattr(old, name) != getattr(now, name))
        return None

    def refuse_hparams_changed_after_updates(self) -> None:
        """Updates ran inside this step's backward with the hyper-parameters set then; torch
        applies those of opt.step(). Where the loop changed one in between, refused."""
        shared = self.shared
        changed = self.hparams_changed() if self.backward_hparams else None
        if changed is None or not any(s.updated_at == shared.step_id
                                      for s in shared.slots.values()):
            return
        auto = (" (mode='auto' went immediate after its first step, where nothing changed "
                "there)" if shared.mode == "auto" else "")
        raise RuntimeError(
            f"forge: {changed} changed between backward and opt.step(): the weights were "
            f"updated inside backward with the values set then{auto}, where torch.optim applies "
            "those of opt.step(). Change hyper-parameters before backward or after opt.step() "
            "(an LR scheduler's step() after opt.step(), as torch asks), or use mode='deferred', "
            "which applies them at opt.step()")

    # ------------------------------------------------------------------ mode="auto"

    def decide_auto(self, held, clipping: bool, pre_hooks: bool) -> None:
        """End of an auto optimizer's first step (held: the (slot, gradient) pairs it applies;
        clipping: max_grad_norm is set; pre_hooks: the optimizer has step pre-hooks): stay
        deferred if the loop used a gradient before opt.step() (or may have: a DTensor's use
        is not seen), else run immediate from the next step."""
        shared = self.shared
        slots = shared.slots.values()
        touched = [slot.name for slot, g in held
                   if (slot.mode in ("fused", "hook") and slot.grad_arrivals > 1)
                   or (slot.grad_left is not None and slot.grad_left() is not g)
                   or (isinstance(g, FactoredGrad) and (g.touched or len(g.parts) > 1))
                   or (slot.mode == "hook" and slot.grad_version is not None
                       and g._version != slot.grad_version)]
        # A gradient a backward made and the loop set aside before opt.step() (zero_grad
        # between a backward and the step: a clean pass for an adversarial input, a skipped
        # batch): immediate mode would have applied it inside that backward.
        kept = {id(slot) for slot, _ in held}
        discarded = [slot.name for slot in slots
                     if slot.mode in ("fused", "hook") and slot.grad_arrivals == 1
                     and id(slot) not in kept]
        reasons = []
        if touched:
            reasons.append("the gradient of " + ", ".join(touched[:3])
                           + (" ..." if len(touched) > 3 else "")
                           + " was used, accumulated, replaced or made anew")
        if discarded:
            reasons.append("the gradient of " + ", ".join(discarded[:3])
                           + (" ..." if len(discarded) > 3 else "")
                           + " was zeroed between a backward and opt.step()")
        if any(slot.dtensor for slot in slots):
            # NOTE: an in-place op on a DTensor gradient (clip_grad_norm_'s _foreach_mul_)
            # may leave both its and its local tensor's version counters as they were
            reasons.append("the model has DTensor parameters (tensor parallel, FSDP2), whose "
                           "gradients' use by the loop cannot be seen; build the optimizer with "
                           "mode='immediate' where the loop never reads a gradient")
        if self.graphed_grads:
            reasons.append("a backward with create_graph=True made gradients to differentiate")
        changed = self.hparams_changed()
        if changed:
            reasons.append(f"{changed} changed between backward and opt.step()")
        if clipping:
            reasons.append("max_grad_norm is set")
        if self.loop_needs_grads or pre_hooks or _global_pre_hooks():
            reasons.append("a step pre-hook is registered")
        self.auto_deferring = bool(reasons)
        if reasons:
            _log.info("forge: mode='auto' stays deferred: %s", "; ".join(reasons))
        else:
            shared.deferring = False
            shared.lapse_ready()
            _log.info("forge: mode='auto': the loop does not use gradients before opt.step(); "
                      "updates run inside backward from the next step on")
