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
from .calls import commit, mu_product_through


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
        self.step_id = step_id              # the optimizer's step when the capture began
        self.states_loaded = states_loaded  # Capture.states_loaded then
        self.last_stats = last_stats        # the last step's statistics then (restored after)
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


class Capture:
    """The optimizer's capture and replay bookkeeping (see the file header); the optimizer's
    begin_graph_capture, end_graph_capture and prepare_graph_replay are these. shared: its
    Shared; hparams: its calls.HparamsTable; stats: its stats.Stats."""

    def __init__(self, shared, lib, hparams, stats, keeps_mu_product: bool):
        self.shared = shared
        self._lib = lib
        self._hparams = hparams
        self._stats = stats
        self._keeps_mu_product = keeps_mu_product
        # the capture in progress (its updates read their scalars from run-scalars buffers),
        # the last one ended, the buffers by device index, and a count of load_state_dict
        # calls (they replace the state tensors a graph reads: optimizer.py counts them)
        self.current: Optional[GraphCapture] = None
        self.last: Optional[GraphCapture] = None
        self._run_scalars: Dict[int, Any] = {}  # device index -> _RunScalars
        self.states_loaded = 0

    def begin(self) -> None:
        """The updates launched until end() read their scalars from this optimizer's
        run-scalars buffers. (The optimizer has checked that its updates run in backward and
        settled the C++ records; the caller, that every parameter is on CUDA.)"""
        shared = self.shared
        slots = shared.slots
        # NOTE: no statistics tensors yet: the capture makes its own with torch.zeros, whose
        # fill is captured, so every replay adds into zeros (the step's grad_norm).
        if self._stats.current or any(s.pending or s.partial is not None
                                      for s in slots.values()):
            raise RuntimeError("forge: a step is in progress (a backward ran without "
                               "opt.step()); finish it before capturing a step")
        cap = GraphCapture(shared.step_id, self.states_loaded, self._stats.last)
        # NOTE: the buffers are made here, outside the capture (allocations inside it come
        # from the graph's private pool); a graph keeps the ones it reads through its _Capture.
        count = 1 + max((slot.index for slot in slots.values()), default=0)
        for index in {slot.device.index for slot in slots.values()}:
            rs = self._run_scalars.get(index)
            if rs is None or rs.count < count:  # (parameters added since: a larger one)
                rs = self._run_scalars[index] = _RunScalars(count, torch.device("cuda", index))
            cap.run_scalars[index] = rs
        shared.lapse_ready()
        self.current, shared.capturing = cap, True

    def end(self) -> GraphCapture:
        """Ends the capture begun by begin (also after a failed one) and returns what it
        recorded. The capture ran nothing, so this undoes its bookkeeping: the step it went
        through is not a step taken (the first replay is)."""
        shared = self.shared
        cap, self.current, shared.capturing = self.current, None, False
        shared.lapse_ready()
        cap.steps = shared.step_id - cap.step_id
        cap.stats = self._stats.last if cap.steps == 1 else None
        cap.slots.sort(key=lambda entry: entry[0].index)  # NOTE: a group's slots adjacent
        shared.step_id, self._stats.last = cap.step_id, cap.last_stats
        shared.begun_step = -1
        self._stats.discard()
        for slot in shared.slots.values():
            slot.clear_backward()
            if slot.updated_at >= cap.step_id:
                slot.updated_at = cap.step_id - 1
        self.last = cap
        return cap

    def region(self, slot, hparams: _lib.Hparams) -> int:
        """The device address of slot's run-scalars region, for an update being captured
        with the group's hyper-parameters `hparams`; records the slot for prepare_replay."""
        cap = self.current
        if id(slot) in cap.seen:
            raise RuntimeError(f"forge: parameter '{slot.name}' was updated twice in one "
                               "captured step; a CUDA graph step holds one optimizer step")
        fixed = _fixed_hparams(hparams)
        fixed = cap.fixed.setdefault(fixed, fixed)  # one object per value: compared by identity
        rs = cap.run_scalars[slot.device.index]
        cap.seen.add(id(slot))
        cap.slots.append((slot, fixed, rs))
        return rs.device_address + slot.index * _lib.RUN_SCALARS_BYTES

    def prepare_replay(self, capture: Optional[GraphCapture], seed: int) -> None:
        """Before a replay of a captured step (`capture`, end()'s; None: the last): advances
        every captured parameter's step count, fills its run-scalars region for that step from
        its param group as it is now (a scheduler's new lr; seed: the optimizer's stochastic
        rounding seed), copies the regions to
        the device in one transfer on the current stream, and closes the step's bookkeeping
        (the statistics are the tensors the replay writes)."""
        cap = capture if capture is not None else self.last
        if cap is None:
            raise RuntimeError("forge: no captured step to replay")
        if cap.states_loaded != self.states_loaded:
            raise RuntimeError("forge: load_state_dict replaced the optimizer states after this "
                               "step was captured; capture it again (a new CUDAGraphStep)")
        for rs in cap.run_scalars.values():
            rs.next_staging()
        shared = self.shared
        step_id, nbytes = shared.step_id, _lib.RUN_SCALARS_BYTES
        state, group_of = shared.state, shared.group_of
        keeps_mu_product = self._keeps_mu_product
        base = fixed_checked = hp = None
        for slot, fixed, rs in cap.slots:
            group_hp = self._hparams.of(group_of(slot))[0]
            if group_hp is not base or fixed is not fixed_checked:  # NOTE: once per group
                if _fixed_hparams(group_hp) != fixed:
                    raise RuntimeError(
                        f"forge: the hyper-parameters of parameter '{slot.name}' changed since "
                        "its step was captured; between replays only lr may change (capture "
                        "again for other changes)")
                base, fixed_checked = group_hp, fixed
                hp = _lib.Hparams.from_buffer_copy(group_hp)
            st = state[slot.param]
            step = st["step"] + 1
            hp.step, hp.seed = step, seed + slot.index
            if keeps_mu_product:
                hp.mu_product = mu_product_through(st["mu_product"], hp, step)
            self._lib.run_scalars_fill(hp, rs.host_address + slot.index * nbytes, nbytes)
            commit(st, step, hp, keeps_mu_product)
            slot.updated_at = step_id
        for rs in cap.run_scalars.values():
            rs.upload()
        self._stats.last = cap.stats
        shared.step_id = step_id + 1
