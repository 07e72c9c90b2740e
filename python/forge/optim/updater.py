"""updater.py — one update of one parameter: the libforge call, made from its param group.

update makes forge_wgrad_step (from the X and dY a fused Linear's backward left) or
forge_elementwise_step (from a gradient tensor); update_batch the latter for many parameters
in one call (the batched path, routing.py). Every update reads its hyper-parameters from the
param group (a fused Linear's inside backward: as they were at the step's first update), so LR
schedulers, and any change between steps, apply; it uses the parameter's own 1-based step
count (torch's state['step']), and seeds stochastic rounding with seed + the parameter's index.

This is the host's hot path (once per parameter per step): the structs it passes are built
once and cached while nothing changes (calls.py), and a fused Linear's update inside backward
(update_wgrad, or the C++ pre-hook from its record) finds its call made ready by the step's
first update (check_step), which also checks everything the step's updates will read.
"""
from __future__ import annotations

import ctypes
from typing import Dict, Optional, Tuple

import torch

from .. import _lib
from .. import _linear
from .. import muon
from . import distributed
from .recheck import Recheck
from .calls import (NO_OUTPUTS, as_float, as_operand, commit, kept_args, row_block,
                    write_operands)


class Updater:
    """Makes the libforge calls of the optimizer's updates (see the file header).

    shared: the optimizer's Shared; hparams, devices: its calls.HparamsTable and calls.Devices;
    store, stats, capture: its parts (store.py, stats.py, capture.py); begin_step: the step's
    first callback (modes.py), run before a step is checked if nothing ran it yet; model_ref: a
    weak reference to the model."""

    def __init__(self, shared, lib, hparams, devices, store, stats, capture, begin_step,
                 model_ref, *, seed: int, keeps_mu_product: bool):
        self.shared = shared
        self._lib = lib
        self._hparams = hparams
        self._devices = devices
        self._store = store
        self._stats = stats
        self._capture = capture
        self._begin_step = begin_step
        self._model_ref = model_ref
        self.seed = seed
        self._keeps_mu_product = keeps_mu_product
        # The gradient scale of updates that run inside backward: the lagged clip coefficient
        # in immediate mode with max_grad_norm, else 1 (stepping.py sets it)
        self.backward_scale = 1.0
        self._elementwise_address: Optional[int] = None  # _elementwise_step_address()
        # the step's check of the fused weights, repeated in C++ while nothing changed (not
        # for NAdam: its running product is Python's, per call)
        self._recheck = Recheck(shared, devices, stats, store, self._group_hparams,
                                enabled=not keeps_mu_product)

    def check_step(self) -> None:
        """Before the first update of a step: everything the step's updates read is checked
        (parameters, every group's hyper-parameters, every state tensor and step count), so a
        step is refused before it writes anything, never after some parameters changed.
        Where the C++ part repeats the last check of the fused weights (recheck.py), this
        loop checks the other parameters, then the C++ part those weights."""
        shared = self.shared
        if shared.begun_step != shared.step_id:
            self._begin_step()  # (what the last step left: modes.py)
        if shared.step_id == 0 and distributed.world_size() > 1:  # (a wrapper made later)
            model = self._model_ref()
            if model is not None:
                distributed.check_no_replicating_wrapper(model)
        shared.lapse_ready()  # (the C++ records: readied once every check below passed)
        # NOTE: what is the same for a whole group (its hyper-parameters, checked once) or a
        # whole device (its struct on the current stream) is looked up once per step, not
        # once per parameter.
        groups: Dict[int, Tuple[_lib.Hparams, tuple]] = {}  # id(group) -> _group_hparams
        devices: Dict[torch.device, Tuple[Optional[int], _lib.Device]] = {}
        ready_wgrad = not shared.deferring and not shared.capturing
        recheck = self._recheck
        prepared = recheck.prepare(self.seed, groups) if ready_wgrad else None
        if prepared is not None:
            readied = self._check_slots(recheck.rest, groups, devices, ready_wgrad)
            if not recheck.run(prepared, self.backward_scale):
                prepared = None
            elif readied:  # (a weight readied here for the first time joins them)
                recheck.register(recheck.registered + readied, self.seed)
        if prepared is None:
            readied = self._check_slots(shared.slots.values(), groups, devices, ready_wgrad)
            recheck.register(readied, self.seed)
        for slot in readied:
            slot.record.ready()
        shared.checked_step = shared.step_id

    def _check_slots(self, slots, groups, devices, ready_wgrad: bool) -> list:
        """check_step's loop over `slots` (groups, devices: its lookups of this step); returns
        the slots whose C++ records are to be readied once every check passed."""
        # NOTE: a loop over every parameter once per step, inside backward
        shared = self.shared
        readied = []
        step_id = shared.step_id
        state, group_of = shared.state, shared.group_of
        check_storage, param_struct = self._store.check_storage, self._store.param_struct
        for slot in slots:
            p = slot.param
            # (dtypes are singletons: `is` first, the device compare, which builds one, last)
            if p.dtype is not slot.dtype or not p.is_contiguous() or p.device != slot.device:
                raise RuntimeError(
                    f"forge: parameter '{slot.name}' changed dtype, device or layout after the "
                    f"optimizer was built ({slot.dtype} on {slot.device} -> {p.dtype} on "
                    f"{p.device}); build the optimizer after moving the model")
            group = group_of(slot)
            check_storage(slot, group)  # (store.py: formats, dtypes)
            hparams = groups.get(id(group))
            if hparams is None:
                hparams = groups[id(group)] = self._group_hparams(group)
            st = state.get(p)
            if st:
                step = st.get("step")
                if type(step) is not int or step < 0:
                    raise RuntimeError(f"forge: parameter '{slot.name}': state 'step' must be an "
                                       f"int >= 0, got {step!r}")
                if slot.signature is not None:  # (checks replaced state tensors)
                    slot.struct, slot.struct_step = param_struct(slot, st), step_id
                    slot.checked = (st, group)
                    # (a Muon weight: its call writes a direction made per call, in Python)
                    if ready_wgrad and slot.mode == "fused" and not slot.dtensor \
                            and not slot.muon:
                        slot.ready = self.ready_wgrad(slot, st, hparams, devices)
                        if slot.ready is not None and slot.record is not None \
                                and not p._backward_hooks:  # (a hooked W: the Python path)
                            readied.append(slot)
        return readied

    def _group_hparams(self, group) -> Tuple[_lib.Hparams, tuple]:
        """group's HparamsTable.of pair, its values checked by the library (raises naming a
        bad one) once per group and step."""
        hparams = self._hparams.of(group)
        checked = _lib.Hparams.from_buffer_copy(hparams[0])
        checked.step = 1
        self._lib.state_layout(checked, _lib.STATE_FP32, 1, 1)
        return hparams

    def ready_wgrad(self, slot, st, group_hparams, devices):
        """slot's kept forge_wgrad_args made ready, at the step's first update, for its update
        in this step (update_wgrad): the forge_param check_step verified, the group's
        hyper-parameters (group_hparams: HparamsTable.of slot's group), the device on the
        current stream (devices: check_step's, by torch device), the seed and gradient scale.
        Returns (step id, stream handle or None, args, what its struct fields hold, its hparams
        view, the state dict), or None where the update must say what changed (update)."""
        hparams, layout_key = group_hparams
        if slot.signature[0] != layout_key:
            return None
        on = devices.get(slot.device)
        if on is None:
            p = slot.param
            stream = _linear.current_stream_handle(p.get_device()) if p.is_cuda else None
            on = devices[slot.device] = (stream, self._devices.of(p, stream))
        stream, device = on
        outputs = self._stats.outputs(slot.device) if slot.counts else NO_OUTPUTS
        args = kept_args(slot, "wgrad", device, slot.struct, hparams, outputs, st["step"] + 1,
                         self.seed + slot.index, self.backward_scale,
                         st["mu_product"] if self._keeps_mu_product else None, False, None)
        _, held, hp = slot.kept_args["wgrad"]
        if slot.record is not None:
            self._ready_record(slot, args)
            if slot.forms_in_graph:  # (its element-wise call on a formed dW: backward.py)
                dense = kept_args(slot, "elementwise", device, slot.struct, hparams, outputs,
                                  st["step"] + 1, self.seed + slot.index, self.backward_scale,
                                  st["mu_product"] if self._keeps_mu_product else None, False,
                                  None)
                slot.record.set_dense_call(dense, ctypes.addressof(dense),
                                           self._elementwise_step_address())
        return self.shared.step_id, stream, args, held, hp, st

    def _elementwise_step_address(self) -> int:
        """forge_elementwise_step's address (for the C++ pre-hook), looked up once."""
        if self._elementwise_address is None:
            self._elementwise_address = self._lib.elementwise_step_address
        return self._elementwise_address

    def _ready_record(self, slot, args) -> None:
        """Gives slot's C++ record the call ready in args, with the stand-in and the
        ConsumedGrad the pre-hook uses (check_step then readies the record for this step's
        Linear backward)."""
        given = slot.record_call
        # NOTE: once per fused weight per step: what it was given stands (the weight's dtype
        # and device were checked by check_step, so its stand-in is the one made)
        if given is not None and given[0] is args and given[1] is slot.stand_in \
                and given[2] is slot._consumed:
            return
        stand_in = slot.stand_in_for(slot.param)
        consumed = slot._consumed
        if consumed is None:
            consumed = slot.consumed_grad()
        slot.record.set_call(args, ctypes.addressof(args), stand_in, consumed)
        slot.record_call = (args, stand_in, consumed)

    def current_ready(self, slot):
        """slot.ready, brought to this step where the C++ part's check readied its call
        instead of check_step's loop (recheck.py)."""
        ready = slot.ready
        if (ready is None or ready[0] != self.shared.step_id) and self._recheck.adopt(slot):
            ready = slot.ready
        return ready

    def ready_for(self, slot, stream):
        """slot.ready (ready_wgrad's) where it holds this step's call on `stream` (a raw
        handle, None on the CPU) outside a capture; else None."""
        ready = self.current_ready(slot)
        shared = self.shared
        step_id = shared.step_id
        if (ready is None or ready[0] != step_id or slot.struct_step != step_id
                or ready[1] != stream or shared.capturing):
            return None
        return ready

    def update_wgrad(self, slot, x2, ldx, dy2, lddy, stream, tokens: int) -> None:
        """update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=stream): a fused Linear's update
        as its AccumulateGrad pre-hook makes it, with the same call and bits (tokens: the
        rows of x2 and dy2, as _linear.row_count gives).

        NOTE: once per fused Linear per step, in the middle of backward, where every step of
        the host's is slow (its caches hold autograd's work): everything but the operands and
        the step count was made ready at the step's first update, in check_step's loop
        (ready_wgrad), so this writes the operands (calls.write_operands) and calls the
        library; ready_for and the step's commit are written out here (two Python calls
        fewer). The group's hyper-parameters are those of the step's first update (a change
        made while backward runs applies from the next step); anything the ready args do not
        fit (another stream, a capture, an operand dtype met first) takes update."""
        shared = self.shared
        if shared.checked_step != shared.step_id:
            self.check_step()
        step_id = shared.step_id
        ready = slot.ready
        if ready is None or ready[0] != step_id:
            ready = self.current_ready(slot)
        if (ready is not None and ready[0] == step_id and slot.struct_step == step_id
                and ready[1] == stream and not shared.capturing and not slot.muon
                and write_operands(ready[2], x2, ldx, dy2, lddy, tokens)):
            hp, st = ready[4], ready[5]
            self._lib.wgrad_step(ready[2])
            st["step"] = hp.step  # (calls.commit)
            if self._keeps_mu_product:
                st["mu_product"] = hp.mu_product
            slot.updated_at = step_id
            return
        self.update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=stream)

    def settle_registered(self) -> Optional[list]:
        """The calls the C++ pre-hook made for the weights the C++ part's check registered,
        committed there (recheck.py, settle); returns the slots Python settles itself, or
        None: every slot."""
        return self._recheck.settle()

    def commit_made(self, slot, kind: str = "wgrad") -> None:
        """The C++ pre-hook made slot's readied call (kind "wgrad", or "elementwise" on a
        formed dW): its step count (and NAdam's product) move on, as update_wgrad's success
        moves them."""
        hp = slot.kept_args[kind][2]  # (hparams.step: the step the call made)
        st = self.shared.state[slot.param]
        st["step"] = hp.step  # (calls.commit)
        if self._keeps_mu_product:
            st["mu_product"] = hp.mu_product
        slot.updated_at = self.shared.step_id

    def update(self, slot, grad: Optional[torch.Tensor] = None, x=None, dy=None,
               stream=None, scale: Optional[float] = None,
               rows: Optional[Tuple[int, int]] = None, last: bool = True) -> None:
        """One step of slot's parameter, from a gradient tensor or from (X, dY), on `stream`
        (the raw handle of a CUDA stream, _linear.current_stream_handle's; None: the current
        one). rows = (r0, r1): only those rows of the parameter, dY holding their columns
        (forge.loss updates a head's weight block by block); the step is counted once, by the
        call with last=True."""
        shared = self.shared
        if shared.checked_step != shared.step_id:
            self.check_step()
        st, step, param, device, outputs, hparams, capturing = self._call_parts(slot, stream)
        if rows is not None:
            if slot.muon:
                raise RuntimeError(f"forge: parameter '{slot.name}' takes Muon, which needs its "
                                   "whole gradient at once, not block by block as forge.loss's "
                                   "fused head gives it: give the head use_muon=False (AdamW)")
            param = row_block(param, rows)
        if x is not None:
            # NOTE: no torch.no_grad() here (host time on every Linear): forge_dtype's only
            # tensor op, a cast, works on a detached tensor.
            (x2, ldx), (dy2, lddy) = x, dy
            x2, x_code = _linear.forge_dtype(x2)
            dy2, dy_code = _linear.forge_dtype(dy2)
            args = self._kept_args(slot, "wgrad", device, param, hparams, outputs, step,
                                   scale, capturing)
            args.tokens = x2.size(0) if x2.dim() == 2 else _linear.row_count(x2)
            args.x, args.x_dtype, args.ldx = x2.data_ptr(), x_code, ldx
            args.dy, args.dy_dtype, args.lddy = dy2.data_ptr(), dy_code, lddy
            direction = self._muon_direction(slot, args) if slot.muon else None
            self._lib.wgrad_step(args)
        else:
            args, grad = self._elementwise_args(slot, grad, scale, st, step, param, device,
                                                outputs, hparams, capturing)
            direction = self._muon_direction(slot, args) if slot.muon else None
            self._lib.elementwise_step(args)
        if direction is not None:
            self._muon_apply(slot, direction)
        if last:
            self._count_update(slot, st, step, capturing, args.hparams)

    def update_batch(self, items) -> None:
        """Element-wise steps of several parameters in one libforge call
        (forge_elementwise_step_batch), each with the bits update(slot, grad=grad,
        scale=scale) gives it; items: [(slot, grad, scale)]. Every call is prepared, and so
        checked, before the library runs any."""
        if not items:
            return
        shared = self.shared
        if shared.checked_step != shared.step_id:
            self.check_step()
        calls, operands, counts, directions = [], [], [], []
        for slot, grad, scale in items:
            st, step, param, device, outputs, hparams, capturing = self._call_parts(slot, None)
            args, grad = self._elementwise_args(slot, grad, scale, st, step, param, device,
                                                outputs, hparams, capturing)
            if slot.muon:  # (each its own direction matrix: the batch writes them all)
                directions.append((slot, self._muon_direction(slot, args)))
            calls.append(args)
            operands.append(grad)  # (alive until the call returns)
            counts.append((slot, st, step, capturing, args.hparams))
        self._lib.elementwise_step_batch(calls)
        for slot, direction in directions:
            self._muon_apply(slot, direction)
        for slot, st, step, capturing, hp in counts:
            self._count_update(slot, st, step, capturing, hp)

    def _muon_direction(self, slot, args) -> torch.Tensor:
        """The bf16 matrix (zeros: a skipped element adds nothing) that args' Muon step writes
        its direction into, in the weight's place (muon.py); alive until it is applied."""
        if self.shared.capturing:
            raise RuntimeError(f"forge: parameter '{slot.name}' takes Muon, whose Newton-Schulz "
                               "step is not captured in CUDA graphs by FORGE")
        direction = torch.zeros((slot.rows, slot.cols), dtype=torch.bfloat16,
                                device=slot.device)  # [rows, cols]
        # NOTE: set at every call: args (kept per parameter) hold a copy of the forge_param,
        # refreshed only when the struct changes; nothing else makes a Muon slot's calls
        args.param.weight = direction.data_ptr()
        args.param.weight_format = _lib.WEIGHT_BF16
        args.param.master = None
        return direction

    def _muon_apply(self, slot, direction: torch.Tensor) -> None:
        """slot's Muon weight update from the direction its call wrote (muon.py), with its
        group's hyper-parameters as they are now. A DTensor shard's direction is its block of
        the matrix: every rank gathers the whole one and orthogonalizes it, then steps its own
        block."""
        group = self.shared.group_of(slot)
        lr = as_float(group["lr"], "lr")
        if not slot.dtensor:
            muon.apply_direction(slot.param, direction, group, lr)
            return
        # NOTE: each rank runs the whole Newton-Schulz iteration (what a rank would otherwise
        # wait for from another): the same matrix on every rank, so the same bits, and one
        # all-gather of bf16 per weight and step instead of a gather and a scatter.
        geo = slot.geometry
        whole = distributed.full_matrix(direction, slot.param)  # [rows, cols] of the weight
        muon.apply_direction(slot.local(), whole, group, lr,
                             block=(geo.row_offset, geo.rows, geo.col_offset, geo.cols),
                             shape=tuple(slot.param.shape))

    def _call_parts(self, slot, stream):
        """What every update of slot's parameter passes: (its state dict, this update's
        1-based step, forge_param, forge_device on `stream`, statistics outputs, group
        hyper-parameters (shared: copied into the args), whether a capture is running)."""
        shared = self.shared
        capturing = shared.capturing
        if slot.struct_step != shared.step_id and not capturing:
            self._recheck.adopt(slot)  # (a weight the C++ part's check readied: recheck.py)
        if slot.struct_step == shared.step_id and not capturing:
            # NOTE: what check_step verified for this step (the states, the group, the
            # forge_param) is what every update of it reads: the common case, once per
            # parameter per step, skips looking them up again.
            st, group = slot.checked
            hparams, layout_key = self._hparams.of(group)
            if slot.signature[0] == layout_key:
                device = self._devices.of(slot.local() if slot.dtensor else slot.param, stream)
                outputs = self._stats.outputs(slot.device) if slot.counts else NO_OUTPUTS
                return st, st["step"] + 1, slot.struct, device, outputs, hparams, False
        p = slot.param
        group = shared.group_of(slot)
        st = shared.state.get(p)
        if not st:
            if capturing:  # the states' initialization would be replayed with every step
                raise RuntimeError(f"forge: parameter '{slot.name}' has no optimizer state yet: "
                                   "run at least one step eagerly before capturing one "
                                   "(CUDAGraphStep's warmup)")
            st = self._store.allocate(slot, group, init=True)
        elif slot.signature is None:
            slot.signature = self._store.signature(slot, group)
        hparams, layout_key = self._hparams.of(group)  # shared: copied into args later
        if slot.signature[0] != layout_key:
            raise RuntimeError(f"forge: parameter '{slot.name}': its group's settings changed "
                               "the update rule or its states (e.g. momentum 0 <-> > 0, centered) "
                               "after the states were created")
        param = slot.struct if slot.struct_step == shared.step_id else \
            self._store.param_struct(slot, st)
        device = self._devices.of(slot.local() if slot.dtensor else p, stream)
        # NOTE: == p.device (checked), no new object; a replica other ranks also count adds
        # nothing to this rank's statistics
        outputs = self._stats.outputs(slot.device) if slot.counts else NO_OUTPUTS
        return st, st["step"] + 1, param, device, outputs, hparams, capturing

    def _kept_args(self, slot, kind: str, device, param, hparams, outputs, step: int,
                   scale: Optional[float], capturing: bool):
        """calls.kept_args with this optimizer's seed, NAdam's product, the gradient scale
        (None: backward_scale) and, while capturing, slot's run-scalars region."""
        return kept_args(
            slot, kind, device, param, hparams, outputs, step, self.seed + slot.index,
            self.backward_scale if scale is None else scale,
            self.shared.state[slot.param]["mu_product"] if self._keeps_mu_product else None,
            capturing, self._capture.region(slot, hparams) if capturing else None)

    def _elementwise_args(self, slot, grad, scale, st, step, param, device, outputs, hparams,
                          capturing):
        """slot's kept forge_elementwise_args for `grad` (the parts _call_parts gives), and
        the gradient as the library reads it (alive until the call returns)."""
        grad, code = as_operand(grad, slot.param)
        args = self._kept_args(slot, "elementwise", device, param, hparams, outputs, step,
                               scale, capturing)
        args.grad, args.grad_dtype = grad.data_ptr(), code
        return args, grad

    def _count_update(self, slot, st, step: int, capturing: bool, hp: _lib.Hparams) -> None:
        if not capturing:  # a captured update runs at each replay: prepare_replay counts it
            commit(st, step, hp, self._keeps_mu_product)
        slot.updated_at = self.shared.step_id
