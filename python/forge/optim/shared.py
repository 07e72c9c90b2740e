"""shared.py — what the parts of one forge optimizer share: torch.optim's containers, the slots,
and where the step stands.

The optimizer (optimizer.py) is composed of parts (routing, backward, updater, store, modes,
stepping, capture), each holding this one record; none of them holds another's attributes or
the optimizer itself (only weak references lead back to it, so a dropped optimizer is freed
and detached at once). Each field says which part writes it; everyone reads.

NOTE: plain __slots__ fields, read on the host's per-Linear path (backward.py, updater.py):
a part binds this record to a local once per call and reads the fields from there.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional


class Shared:
    """The fields below, and the two lookups every part makes on them (group_of, lapse_ready)."""

    __slots__ = ("param_groups", "state", "slots", "step_id", "begun_step", "checked_step",
                 "deferring", "capturing", "attached", "mode", "clock", "check_version",
                 "_group_cache")

    def __init__(self, mode: str, deferring: bool):
        # torch.optim.Optimizer's param_groups and state (the optimizer's attributes of those
        # names are these: optimizer.py), filled by torch's constructor
        self.param_groups: List[Dict[str, Any]] = []
        self.state: Dict[Any, Dict[str, Any]] = {}
        self.slots: Dict[int, Any] = {}  # id(param) -> its Slot (routing.py makes them)
        self.step_id = 0        # completed step() calls (stepping.py; capture.py rewinds it)
        self.begun_step = -1    # the step whose first callback ran (modes.py, begin_step)
        self.checked_step = -1  # the step updater.py's check_step last passed
        self.deferring = deferring  # updates wait for step() (modes.py); else run in backward
        self.capturing = False  # a CUDA-graph capture is running (capture.py)
        self.attached = False   # the model is routed through the slots (routing.py)
        # the mode asked for, "auto", "immediate" or "deferred", as error messages name it
        # (optimizer.py: the constructor and the accumulate_grad switch)
        self.mode = mode
        # the C++ records' readiness epoch (forge/_prehook.py), made with the first record
        # (routing.py): advanced where the calls readied by check_step lapse (lapse_ready)
        self.clock = None
        # advanced where what a step's check readies changes while no parameter, state or
        # record does (a weight's compiled hand-off starts forming dW: backward.py), so that
        # the C++ part's repetition of the check stops and Python checks anew (recheck.py)
        self.check_version = 0
        self._group_cache: Dict[int, Dict[str, Any]] = {}

    def group_of(self, slot) -> Dict[str, Any]:
        """The param group holding slot's parameter (param_groups may have been replaced or
        extended since the last look)."""
        cached = self._group_cache.get(id(slot.param))
        if cached is not None:
            for g in self.param_groups:  # NOTE: a plain loop: cheaper than any(<genexpr>)
                if g is cached:
                    return cached
        for g in self.param_groups:  # param_groups were replaced or extended: look again
            for q in g["params"]:
                self._group_cache[id(q)] = g
                if q is slot.param:
                    cached = g
        if cached is None:
            raise RuntimeError(f"forge: parameter '{slot.name}' is in no param group")
        return cached

    def lapse_ready(self) -> None:
        """The calls check_step readied are no longer this step's: the C++ Linear backward arms
        none until the next check readies them again."""
        clock: Optional[Any] = self.clock
        if clock is not None:
            clock.advance()
