"""recheck.py — a step's check of the fused weights, repeated by the C++ part while nothing
changed.

Before a step's first update, check_step (updater.py) verifies everything the step's updates
read and readies each fused weight's call: Python's work per weight and step, the largest part
of a compiled model's host time per Linear (its backward's hand-offs and pre-hooks run in C++).
Once a check passed, the weights whose records it readied are registered with the C++ part
(csrc/prehook.cpp, StepRecheck). At a later step, where nothing decided per optimizer, group
or device changed (prepare: the slots, the seed, the store's options, each group's rule
layout, state format and hyper-parameters, which the library checks again), the C++ part
verifies each registered weight as the loop would and writes its call (run); check_step then
loops over the other parameters only. Anything different, and the loop checks every parameter
itself and registers anew. After the backward, the C++ part also commits each registered
weight's call its pre-hook made (settle), where Python's settle_armed would. Without the C++
part (or with NAdam's running product, which Python computes per call) check_step always
loops.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _linear, _prehook
from .calls import NO_OUTPUTS


class Recheck:
    """check_step's last registration and its repetition (see the file header).

    shared: the optimizer's Shared; devices, stats, store: its calls.Devices, Stats, Store;
    group_hparams(group): the group's HparamsTable.of pair, checked by the library (updater.py);
    enabled: False where every step is checked in Python (a rule whose calls carry a value
    Python computes per call)."""

    def __init__(self, shared, devices, stats, store,
                 group_hparams: Callable[[Dict[str, Any]], Tuple[Any, tuple]], enabled: bool):
        self.shared = shared
        self._devices = devices
        self._stats = stats
        self._store = store
        self._group_hparams = group_hparams
        self._enabled = enabled
        self._cpp = None       # the C++ StepRecheck, made at the first registration
        self._slots: List[Any] = []  # the registered slots (each with slot.rechecked set)
        self._rest: List[Any] = []   # every other slot: check_step's loop checks them
        # (group, its layout key, its (state_format, min_8bit_size)) of the registered slots
        self._groups: List[Tuple[Dict[str, Any], tuple, tuple]] = []
        # (torch.device, a registered parameter on it, whether one there counts statistics)
        self._where: List[Tuple[torch.device, torch.Tensor, bool]] = []
        self._key: Optional[tuple] = None  # _optimizer_key at the registration
        self._no_outputs = (NO_OUTPUTS, ctypes.addressof(NO_OUTPUTS))
        # The step and readiness epoch of run's last success, and the stream per device then:
        # adopt's
        self._step_id = -1
        self._epoch = -1
        self._streams: List[Optional[int]] = []

    def _optimizer_key(self, seed: int) -> tuple:
        shared, store = self.shared, self._store
        return (len(shared.slots), shared.check_version, seed, store.master_weights,
                store.stochastic_rounding)

    # ------------------------------------------------------------------ registration

    def clear(self) -> None:
        for slot in self._slots:
            slot.rechecked = None
        self._slots, self._rest, self._groups, self._where = [], [], [], []
        self._key = None
        if self._cpp is not None:
            self._cpp.clear()

    def register(self, readied: List[Any], seed: int) -> None:
        """After a check that passed (check_step's loop over every slot): `readied`, the slots
        whose records it readied, are repeated by the C++ part from the next step on."""
        self.clear()
        cpp = _prehook.get() if self._enabled and readied else None
        if cpp is None:
            return
        if self._cpp is None:
            self._cpp = cpp.StepRecheck()
        group_index: Dict[int, int] = {}
        where_index: Dict[torch.device, int] = {}
        for slot in readied:
            st, group = slot.checked
            g = group_index.get(id(group))
            if g is None:
                g = group_index[id(group)] = len(self._groups)
                self._groups.append((group, self._group_hparams(group)[1],
                                     (group.get("state_format"), group.get("min_8bit_size"))))
            d = where_index.get(slot.device)
            if d is None:
                d = where_index[slot.device] = len(self._where)
                self._where.append((slot.device, slot.param, False))
            if slot.counts and not self._where[d][2]:
                self._where[d] = (slot.device, slot.param, True)
            dense = slot.kept_args.get("elementwise") if slot.forms_in_graph else None
            self._cpp.add(slot.record, slot, slot.param, st, slot.kept_args["wgrad"][1],
                          None if dense is None else dense[1], slot.struct,
                          ctypes.addressof(slot.struct), g, d, seed + slot.index, slot.counts)
            slot.rechecked = (st, group, d)
            self._slots.append(slot)
        registered = {id(slot) for slot in self._slots}
        self._rest = [s for s in self.shared.slots.values() if id(s) not in registered]
        self._key = self._optimizer_key(seed)

    # ------------------------------------------------------------------ a step

    def prepare(self, seed: int, groups: Dict[int, Tuple[Any, tuple]]) -> Optional[tuple]:
        """Before a step's check: where the registration still stands at the optimizer,
        group and device level, what run() passes on (the groups' checked hyper-parameters
        are added to `groups`, check_step's by id(group)); None where check_step must loop
        over every slot."""
        if not self._slots or self._key != self._optimizer_key(seed):
            return None
        param_groups = self.shared.param_groups
        hparams = []
        for group, layout_key, storage in self._groups:
            for g in param_groups:  # NOTE: a plain loop: cheaper than any(<genexpr>)
                if g is group:
                    break
            else:
                return None
            if (group.get("state_format"), group.get("min_8bit_size")) != storage:
                return None
            pair = groups.get(id(group))
            if pair is None:
                pair = groups[id(group)] = self._group_hparams(group)  # (raises: bad values)
            if pair[1] != layout_key:
                return None
            hparams.append((pair[0], ctypes.addressof(pair[0])))
        devices, outputs, streams = [], [], []
        for device, param, counts in self._where:
            stream = _linear.current_stream_handle(param.get_device()) if param.is_cuda \
                else None
            d = self._devices.of(param, stream)
            devices.append((d, ctypes.addressof(d)))
            out = self._stats.outputs(device) if counts else None
            outputs.append(None if out is None else (out, ctypes.addressof(out)))
            streams.append(stream)
        return hparams, devices, outputs, streams

    def run(self, prepared: tuple, grad_scale: float) -> bool:
        """The C++ part's check of every registered weight and, where all passed, their calls
        written and their records readied for this step (prepared: prepare's); False where
        check_step must loop over every slot (nothing was written)."""
        hparams, devices, outputs, streams = prepared
        shared = self.shared
        if not self._cpp.run(shared.state, hparams, devices, outputs, self._no_outputs,
                             grad_scale):
            return False
        self._step_id, self._epoch, self._streams = shared.step_id, shared.clock.epoch, streams
        return True

    def settle(self) -> Optional[List[Any]]:
        """After a backward (backward.py, settle_all): the C++ part commits each registered
        weight whose call its pre-hook made, as settle_armed would. Returns the slots left for
        Python to settle (registered ones holding anything else, then every other slot), or
        None where the registration no longer covers the optimizer's slots (Python settles
        every one)."""
        shared = self.shared
        key = self._key
        if key is None or key[0] != len(shared.slots) or key[1] != shared.check_version:
            return None
        left = self._cpp.settle(shared.state, shared.step_id)
        left.extend(self._rest)
        return left

    @property
    def registered(self) -> List[Any]:
        """The slots run() checks."""
        return list(self._slots)

    @property
    def rest(self) -> List[Any]:
        """The slots run() does not check: check_step's loop checks them."""
        return self._rest

    def adopt(self, slot) -> bool:
        """Where this step's run() readied slot's call: slot's Python view of it (ready,
        struct_step, checked) as check_step's loop would have left it. False: not readied
        by run() in this step (or lapsed since)."""
        rechecked = slot.rechecked
        shared = self.shared
        if rechecked is None or self._step_id != shared.step_id \
                or shared.clock is None or shared.clock.epoch != self._epoch:
            return False
        st, group, d = rechecked
        if d >= len(self._streams):  # (registered after run(): readied by the loop itself)
            return False
        args, held, hp = slot.kept_args["wgrad"]
        step_id = shared.step_id
        slot.struct_step = step_id  # (slot.struct: the one registered, its pointers verified)
        slot.checked = (st, group)
        slot.ready = (step_id, self._streams[d], args, held, hp, st)
        return True
