"""capture.py — a forge optimizer's part in a CUDA-graph capture (forge.graphs.CUDAGraphStep).

While a step is captured, each update is launched with hparams.run_scalars pointing at the
parameter's 256-byte region of a device buffer, from which the kernel reads its step, lr and
seed dependent scalars (and NAdam's product of momentum factors) when it runs; the capture
advances no step count. Before each replay prepare_graph_replay advances the counts (and
NAdam's products), fills the regions from the param groups of that moment (so an LR
scheduler applies) and copies them to the device in one transfer.

The public interface forge.graphs (or any capturing code) uses:
    opt.begin_graph_capture()            before the capture
    cap = opt.end_graph_capture()        after it (also after a failed one)
    opt.prepare_graph_replay(cap)        before every replay, on the replay's stream
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _lib


class _RunScalars:
    """One device's run-scalars buffer: RUN_SCALARS_BYTES per parameter (by slot index), read
    by captured kernels, and two pinned host staging buffers prepare_graph_replay fills in turn.

    NOTE: two staging buffers, each with an event recorded after its copy: the host fills
    one while the copy from the other may still be pending, and waits on a buffer's event
    only before refilling it, so filling step n+1 never writes bytes step n's copy reads."""

    def __init__(self, count: int, device: torch.device):
        nbytes = count * _lib.RUN_SCALARS_BYTES
        self.count = count
        self.device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.device_address = self.device.data_ptr()  # 512-byte aligned (caching allocator)
        self.staging = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.current = 1
        self.host_address = 0

    def next_staging(self) -> None:
        """The other staging buffer, once its last copy is done: host_address is its start."""
        self.current ^= 1
        self.events[self.current].synchronize()  # (returns at once if never recorded)
        self.host_address = self.staging[self.current].data_ptr()

    def upload(self) -> None:
        """Copies the current staging buffer to the device on the device's current stream."""
        self.device.copy_(self.staging[self.current], non_blocking=True)
        self.events[self.current].record(torch.cuda.current_stream(self.device.device))


class GraphCapture:
    """What one capture of an optimizer's step recorded (begin_graph_capture ..
    end_graph_capture); prepare_graph_replay takes it before each replay."""

    def __init__(self, step_id: int, states_loaded: int, last_stats):
        self.step_id = step_id              # opt._step_id when the capture began
        self.states_loaded = states_loaded  # opt._states_loaded then
        self.last_stats = last_stats        # opt._last_stats then (restored after)
        self.run_scalars: Dict[int, _RunScalars] = {}  # device index -> buffers it reads
        # (slot, its hyper-parameters but step/lr/seed, its buffers) per update captured
        self.slots: List[Tuple[Any, tuple, _RunScalars]] = []
        self.seen: set = set()              # id(slot) of those
        self.fixed: Dict[tuple, tuple] = {}  # the distinct _fixed_hparams of those, interned
        self.steps = 0                      # opt.step() calls captured
        self.stats = None                   # the statistics tensors the captured step writes


# What a captured update keeps: every field but these, which are read at each replay.
_REPLAY_FIELDS = ("step", "lr", "seed", "mu_product", "run_scalars")


def _fixed_hparams(hp: _lib.Hparams) -> tuple:
    return tuple(getattr(hp, name) for name, _ in hp._fields_ if name not in _REPLAY_FIELDS)


class _CaptureMixin:
    """CUDA-graph capture and replay bookkeeping of _ForgeOptimizer (see the file header)."""

    def begin_graph_capture(self) -> None:
        """forge.graphs calls this before it captures a step: the updates launched until
        end_graph_capture read their scalars from this optimizer's run-scalars buffers. (The
        caller has checked that every parameter is on CUDA.)"""
        if not self._attached:
            raise RuntimeError("forge: this optimizer was detached from its model")
        if self._deferring:
            raise RuntimeError(
                "forge: a CUDA-graph step needs the optimizer in immediate mode (mode='immediate',"
                " or 'auto' after a first step that used no gradient before opt.step()); this "
                "one is deferred")
        if self.max_grad_norm is not None:
            raise RuntimeError("forge: max_grad_norm is not supported in a CUDA-graph step")
        self._settle_all()
        # NOTE: no statistics tensors yet: the capture makes its own with torch.zeros, whose
        # fill is captured, so every replay adds into zeros (the step's grad_norm).
        if self._stats or any(s.pending or s.partial is not None for s in self._slots.values()):
            raise RuntimeError("forge: a step is in progress (a backward ran without "
                               "opt.step()); finish it before capturing a step")
        cap = GraphCapture(self._step_id, self._states_loaded, self._last_stats)
        # NOTE: the buffers are made here, outside the capture (allocations inside it come
        # from the graph's private pool); a graph keeps the ones it reads through its _Capture.
        count = 1 + max((slot.index for slot in self._slots.values()), default=0)
        for index in {slot.device.index for slot in self._slots.values()}:
            rs = self._run_scalars.get(index)
            if rs is None or rs.count < count:  # (parameters added since: a larger one)
                rs = self._run_scalars[index] = _RunScalars(count, torch.device("cuda", index))
            cap.run_scalars[index] = rs
        self._lapse_ready()
        self._capture, self._capturing = cap, True

    def end_graph_capture(self) -> GraphCapture:
        """Ends the capture begun by begin_graph_capture (also after a failed one) and returns what
        it recorded. The capture ran nothing, so this undoes its bookkeeping: the step it went
        through is not a step taken (the first replay is)."""
        cap, self._capture, self._capturing = self._capture, None, False
        self._lapse_ready()
        cap.steps = self._step_id - cap.step_id
        cap.stats = self._last_stats if cap.steps == 1 else None
        cap.slots.sort(key=lambda entry: entry[0].index)  # NOTE: a group's slots adjacent
        self._step_id, self._last_stats = cap.step_id, cap.last_stats
        self._begun_step = -1
        self._stats, self._stats_outputs = {}, {}
        for slot in self._slots.values():
            slot.clear_backward()
            if slot.updated_at >= cap.step_id:
                slot.updated_at = cap.step_id - 1
        self._last_capture = cap
        return cap

    def _capture_region(self, slot, hparams: _lib.Hparams) -> int:
        """The device address of slot's run-scalars region, for an update being captured
        with the group's hyper-parameters `hparams`; records the slot for prepare_graph_replay."""
        cap = self._capture
        if id(slot) in cap.seen:
            raise RuntimeError(f"forge: parameter '{slot.name}' was updated twice in one "
                               "captured step; a CUDA graph step holds one optimizer step")
        fixed = _fixed_hparams(hparams)
        fixed = cap.fixed.setdefault(fixed, fixed)  # one object per value: compared by identity
        rs = cap.run_scalars[slot.device.index]
        cap.seen.add(id(slot))
        cap.slots.append((slot, fixed, rs))
        return rs.device_address + slot.index * _lib.RUN_SCALARS_BYTES

    def prepare_graph_replay(self, capture: Optional[GraphCapture] = None) -> None:
        """Before a replay of a captured step (`capture`, end_graph_capture's; default the last):
        advances every captured parameter's step count, fills its run-scalars region for that
        step from its param group as it is now (a scheduler's new lr), copies the regions to
        the device in one transfer on the current stream, and closes the step's bookkeeping
        (the statistics are the tensors the replay writes)."""
        cap = capture if capture is not None else self._last_capture
        if cap is None:
            raise RuntimeError("forge: no captured step to replay")
        if cap.states_loaded != self._states_loaded:
            raise RuntimeError("forge: load_state_dict replaced the optimizer states after this "
                               "step was captured; capture it again (a new CUDAGraphStep)")
        for rs in cap.run_scalars.values():
            rs.next_staging()
        step_id, nbytes = self._step_id, _lib.RUN_SCALARS_BYTES
        base = fixed_checked = hp = None
        for slot, fixed, rs in cap.slots:
            group_hp = self._group_hparams(self._group_of(slot))[0]
            if group_hp is not base or fixed is not fixed_checked:  # NOTE: once per group
                if _fixed_hparams(group_hp) != fixed:
                    raise RuntimeError(
                        f"forge: the hyper-parameters of parameter '{slot.name}' changed since "
                        "its step was captured; between replays only lr may change (capture "
                        "again for other changes)")
                base, fixed_checked = group_hp, fixed
                hp = _lib.Hparams.from_buffer_copy(group_hp)
            st = self.state[slot.param]
            step = st["step"] + 1
            hp.step, hp.seed = step, self.seed + slot.index
            if self._keeps_mu_product:
                hp.mu_product = self._mu_product_through(st, hp, step)
            self._lib.run_scalars_fill(hp, rs.host_address + slot.index * nbytes, nbytes)
            self._commit_step(st, step, hp)
            slot.updated_at = step_id
        for rs in cap.run_scalars.values():
            rs.upload()
        self._last_stats = cap.stats
        self._step_id = step_id + 1
