"""call.py — one update of one parameter: the libforge call, built from its param group.

_update builds forge_wgrad_args (from the X and dY a fused Linear's backward left) or
forge_elementwise_args (from a gradient tensor) and calls libforge; _update_batch does the
latter for many parameters in one call (the batched path, routing.py). Every update reads its
hyper-parameters from the param group (a fused Linear's inside backward: as they were at the
step's first update), so LR schedulers, and any change between steps, apply; it uses the
parameter's own 1-based step count (torch's state['step']), and seeds stochastic rounding
with seed + the parameter's index. This is the host's hot path (once per parameter per
step): the structs it passes are built once and cached while nothing changes, and a fused
Linear's update inside backward (_update_wgrad) finds its call made ready by the step's first
update (_check_step).
"""
from __future__ import annotations

import ctypes
import struct
from typing import Any, Dict, Optional, Tuple

import torch

from .. import _lib
from .. import _linear
from . import distributed

_NO_OUTPUTS = _lib.StepOutputs()  # (NULL pointers: no statistics)
_OPERANDS, _OPERANDS_AT = _lib.WGRAD_OPERANDS

# Entries of the optimizer's small caches (hyper-parameters, devices) before they are
# emptied: a scheduler's new lr every step, or a new CUDA stream every step, stays bounded.
_CACHE_LIMIT = 64


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _nadam_mu(beta1: float, momentum_decay: float, step: int) -> float:
    """NAdam's momentum factor μ_step, in double as torch.optim.NAdam computes it."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


def _as_float(value, name: str) -> float:
    if type(value) is float:  # NOTE: the common case first: ~7 calls per update
        return value
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"{name}: a tensor hyper-parameter must have one element")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__}")
    return float(value)


_IMMUTABLE_TYPES = (float, int, bool, type(None))


def _immutable_values(values: tuple) -> bool:
    """Every value a number, None, or a tuple of them: nothing that can change in place
    (a tensor, a list) and so leave a cache key equal while the value it stands for moves."""
    for v in values:
        if type(v) is tuple:
            if not all(type(e) in _IMMUTABLE_TYPES for e in v):
                return False
        elif type(v) not in _IMMUTABLE_TYPES:
            return False
    return True


class _CallMixin:
    """Building and making the libforge call of one update (see the file header)."""

    def _group_of(self, slot) -> Dict[str, Any]:
        cached = self._group_cache.get(id(slot.param))
        if cached is not None:
            for g in self.param_groups:  # NOTE: a plain loop, ~0.2 µs less than any(<genexpr>)
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

    def _hparams(self, group: Dict[str, Any], step: int, seed: int) -> _lib.Hparams:
        """group's forge_hparams for one call (a copy: the caller may change it)."""
        hp = _lib.Hparams.from_buffer_copy(self._group_hparams(group)[0])
        hp.step = step
        hp.seed = seed
        return hp

    def _group_hparams(self, group: Dict[str, Any]) -> Tuple[_lib.Hparams, tuple]:
        """(forge_hparams of group's current values, step and seed 0; its _layout_key).
        The pair is shared and never changed: callers copy the struct (_hparams, or a ctypes
        field assignment, which copies).

        NOTE: cached on the values of every key _hparams reads (self._hparam_keys), read
        from the group on every call, so a scheduler's new lr or a user's new betas is
        honoured at the next update; the cache only skips the ~10 conversions and ctypes
        stores (1.0 µs per update for the old _hparams, 0.2 µs for this on a hit, 2-core CPU
        dev host). Values that could change in place without the key changing (a tensor lr,
        a list of betas) are never cached."""
        try:
            key = self._hparam_values(group)  # NOTE: one C call: 1/3 of tuple(map(group.get))
        except KeyError:  # a key deleted from the group by hand (maximize defaults to False)
            key = tuple(map(group.get, self._hparam_keys))
        try:
            cached = self._hparams_cache.get(key)
        except TypeError:  # an unhashable value (betas given as a list): never cached
            cached = None
        if cached is not None:
            return cached
        rule = self._rule(group)
        default = self._default_hparams.get(rule)
        if default is None:
            default = self._default_hparams[rule] = self._lib.hparams_default(rule)
        hp = _lib.Hparams.from_buffer_copy(default)
        hp.lr = _as_float(group["lr"], "lr")
        hp.weight_decay = _as_float(group["weight_decay"], "weight_decay")
        hp.maximize = int(bool(group.get("maximize", False)))
        self._fill(hp, group)
        cached = (hp, self._layout_key(group))
        if _immutable_values(key):
            if len(self._hparams_cache) >= _CACHE_LIMIT:  # e.g. a new lr every step
                self._hparams_cache.clear()
            self._hparams_cache[key] = cached
        return cached

    def _device_struct(self, t: torch.Tensor, stream: Optional[int] = None) -> _lib.Device:
        """Where a call on t runs: its CUDA device and `stream` (the raw cudaStream_t handle,
        as _linear.current_stream_handle gives; None: the device's current stream), or the
        CPU with num_threads.

        NOTE: one struct per (device index, stream) or thread count, made once: the callers
        pass it on by value (a ctypes Structure assigned to a field, or passed as an argument,
        is copied) and never change it."""
        if t.is_cuda:
            index = t.get_device()
            if stream is None:
                stream = _linear.current_stream_handle(index)
            key = (index, stream)
        else:
            key = (-1, self.num_threads or torch.get_num_threads())
        d = self._devices.get(key)
        if d is None:
            d = _lib.Device()
            if key[0] >= 0:
                d.kind, d.index, d.stream = _lib.DEVICE_CUDA, key[0], key[1]
            else:
                d.kind, d.num_threads = _lib.DEVICE_CPU, key[1]
            if len(self._devices) >= _CACHE_LIMIT:  # streams made and dropped by the user
                self._devices.clear()
            self._devices[key] = d
        return d

    def _outputs(self, device: torch.device) -> _lib.StepOutputs:
        """This step's statistics outputs on `device` (made at its first update)."""
        out = self._stats_outputs.get(device)
        if out is not None:
            return out
        stats = (torch.zeros((), dtype=torch.float64, device=device),
                 torch.zeros((), dtype=torch.int64, device=device))
        self._stats[device] = stats
        out = _lib.StepOutputs()
        out.grad_sq_sum = ctypes.cast(stats[0].data_ptr(), ctypes.POINTER(ctypes.c_double))
        out.nonfinite_count = ctypes.cast(stats[1].data_ptr(), ctypes.POINTER(ctypes.c_int64))
        self._stats_outputs[device] = out
        return out

    def _check_step(self) -> None:
        """Before the first update of a step: everything the step's updates read is checked
        (parameters, every group's hyper-parameters, every state tensor and step count), so a
        step is refused before it writes anything, never after some parameters changed."""
        if self._begun_step != self._step_id:
            self._begin_step()  # (what the last step left: base.py)
        if self._step_id == 0 and distributed.world_size() > 1:  # (a wrapper made later)
            model = self._model_ref()
            if model is not None:
                distributed.check_no_replicating_wrapper(model)
        # NOTE: a loop over every parameter once per step, inside backward: what is the same
        # for a whole group (its hyper-parameters, checked once) or a whole device (its struct
        # on the current stream) is looked up once per step, not once per parameter.
        self._lapse_ready()  # (the C++ records: readied once every check below passed)
        readied = []
        groups: Dict[int, Tuple[_lib.Hparams, tuple]] = {}  # id(group) -> _group_hparams
        devices: Dict[torch.device, Tuple[Optional[int], _lib.Device]] = {}
        step_id = self._step_id
        ready_wgrad = not self._deferring and not self._capturing
        state = self.state
        for slot in self._slots.values():
            p = slot.param
            # (dtypes are singletons: `is` first, the device compare, which builds one, last)
            if p.dtype is not slot.dtype or not p.is_contiguous() or p.device != slot.device:
                raise RuntimeError(
                    f"forge: parameter '{slot.name}' changed dtype, device or layout after the "
                    f"optimizer was built ({slot.dtype} on {slot.device} -> {p.dtype} on "
                    f"{p.device}); build the optimizer after moving the model")
            group = self._group_of(slot)
            self._check_storage(slot, group)  # (states.py: formats, dtypes)
            hparams = groups.get(id(group))
            if hparams is None:
                hparams = groups[id(group)] = self._group_hparams(group)
                checked = _lib.Hparams.from_buffer_copy(hparams[0])
                checked.step = 1
                self._lib.state_layout(checked, _lib.STATE_FP32, 1, 1)
            st = state.get(p)
            if st:
                step = st.get("step")
                if type(step) is not int or step < 0:
                    raise RuntimeError(f"forge: parameter '{slot.name}': state 'step' must be an "
                                       f"int >= 0, got {step!r}")
                if slot.signature is not None:  # (checks replaced state tensors)
                    slot.struct, slot.struct_step = self._param_struct(slot, st), step_id
                    slot.checked = (st, group)
                    if ready_wgrad and slot.mode == "fused" and not slot.dtensor:
                        slot.ready = self._ready_wgrad(slot, st, hparams, devices)
                        if slot.ready is not None and slot.record is not None \
                                and not p._backward_hooks:  # (a hooked W: the Python path)
                            readied.append(slot.record)
        for record in readied:
            record.ready()
        self._checked_step = step_id

    def _ready_wgrad(self, slot, st, group_hparams, devices):
        """slot's kept forge_wgrad_args made ready, at the step's first update, for its update
        in this step (_update_wgrad): the forge_param _check_step verified, the group's
        hyper-parameters (group_hparams: _group_hparams of slot's group), the device on the
        current stream (devices: _check_step's, by torch device), the seed and gradient scale.
        Returns (step id, stream handle or None, args, what its struct fields hold, its hparams
        view, the state dict), or None where the update must say what changed (_update)."""
        hparams, layout_key = group_hparams
        if slot.signature[0] != layout_key:
            return None
        on = devices.get(slot.device)
        if on is None:
            p = slot.param
            stream = _linear.current_stream_handle(p.get_device()) if p.is_cuda else None
            on = devices[slot.device] = (stream, self._device_struct(p, stream))
        stream, device = on
        outputs = self._outputs(slot.device) if slot.counts else _NO_OUTPUTS
        args = self._kept_args(slot, "wgrad", device, slot.struct, hparams, outputs,
                               st["step"] + 1, None, False)
        _, held, hp = slot.kept_args["wgrad"]
        if slot.record is not None:
            self._ready_record(slot, args)
        return self._step_id, stream, args, held, hp, st

    def _ready_record(self, slot, args) -> None:
        """Gives slot's C++ record the call ready in args, with the stand-in and the
        ConsumedGrad the pre-hook uses (_check_step then readies the record for this step's
        Linear backward)."""
        given = slot.record_call
        # NOTE: once per fused weight per step: what it was given stands (the weight's dtype
        # and device were checked by _check_step, so its stand-in is the one made)
        if given is not None and given[0] is args and given[1] is slot.stand_in \
                and given[2] is slot._consumed:
            return
        stand_in = self._stand_in(slot, slot.param)
        consumed = slot._consumed
        if consumed is None:
            consumed = slot.consumed_grad()
        slot.record.set_call(args, ctypes.addressof(args), stand_in, consumed)
        slot.record_call = (args, stand_in, consumed)

    def _update_wgrad(self, slot, x2, ldx, dy2, lddy, stream, tokens: int) -> None:
        """_update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=stream): a fused Linear's update
        as its AccumulateGrad pre-hook makes it, with the same call and bits (tokens: the
        rows of x2 and dy2, as _linear.row_count gives).

        NOTE: once per fused Linear per step, in the middle of backward, where every step of
        the host's is slow (its caches hold autograd's work): everything but the operands and
        the step count was made ready at the step's first update, in _check_step's loop
        (_ready_wgrad), so this writes the operands and the step (_write_wgrad_call) and calls
        the library. The group's hyper-parameters are those of the step's first update (a
        change made while backward runs applies from the next step); anything the ready args
        do not fit (another stream, a capture, an operand dtype met first) takes _update."""
        if self._checked_step != self._step_id:
            self._check_step()
        ready = self._ready_for(slot, stream)
        call = None if ready is None else \
            self._write_wgrad_call(slot, ready, x2, ldx, dy2, lddy, tokens)
        if call is None:
            self._update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=stream)
            return
        args, st, step = call
        self._lib.wgrad_step(args)
        self._commit_step(st, step, args.hparams)
        slot.updated_at = self._step_id

    def _ready_for(self, slot, stream):
        """slot.ready (_ready_wgrad's) where it holds this step's call on `stream` (a raw
        handle, None on the CPU) outside a capture; else None."""
        ready = slot.ready
        step_id = self._step_id
        if (ready is None or ready[0] != step_id or slot.struct_step != step_id
                or ready[1] != stream or self._capturing):
            return None
        return ready

    def _write_wgrad_call(self, slot, ready, x2, ldx, dy2, lddy, tokens: int):
        """Writes the operands of slot's fused update from (x2, dy2) into the ready args
        (_ready_for's; _ready_wgrad wrote the rest, the statistics outputs and the step).
        Returns (args, the state dict, the step the call makes), or None (nothing written)
        for an operand dtype the library does not read."""
        codes = _linear.FORGE_DTYPE_CODES
        x_code, dy_code = codes.get(x2.dtype), codes.get(dy2.dtype)
        if x_code is None or dy_code is None:
            return None
        _, _, args, _, hp, st = ready
        _OPERANDS.pack_into(args, _OPERANDS_AT, tokens, x2.data_ptr(), x_code, ldx,
                            dy2.data_ptr(), dy_code, lddy)
        return args, st, hp.step

    def _kept_args(self, slot, kind: str, device, param, hparams, outputs, step: int,
                   scale: Optional[float], capturing: bool):
        """slot's forge_wgrad_args or forge_elementwise_args (kind "wgrad" / "elementwise"),
        kept between calls, with this call's structs and scalars in it (outputs None: the ones
        it holds); the caller sets the operands' pointers."""
        # NOTE: kept per parameter: a field that holds a struct (device, param, hparams,
        # outputs) is copied in only when what it holds changed (a ctypes struct assignment
        # copies); the rest is set per call.
        kept = slot.kept_args.get(kind)
        if kept is None:
            args = _lib.WgradArgs() if kind == "wgrad" else _lib.ElementwiseArgs()
            args.abi_version = _lib.ABI_VERSION
            # (args, what its struct fields hold, a view of its hparams, whether
            # hparams.run_scalars is set)
            kept = slot.kept_args[kind] = (args, [None, None, None, None, False], args.hparams)
        args, held, hp = kept
        if held[0] is not device:
            args.device, held[0] = device, device
        if held[1] is not param:
            args.param, held[1] = param, param
        if held[2] is not hparams:
            args.hparams, held[2] = hparams, hparams  # (a copy into args: the view sees it)
            held[4] = False
        if held[3] is not outputs and outputs is not None:
            args.outputs, held[3] = outputs, outputs
        hp.step, hp.seed = step, self.seed + slot.index
        if self._keeps_mu_product:
            hp.mu_product = self._mu_product_through(self.state[slot.param], hp, step)
        if scale is None:
            scale = self._backward_scale
        if hp.grad_scale != scale:
            hp.grad_scale = scale
        if capturing or held[4]:
            hp.run_scalars = self._capture_region(slot, hparams) if capturing else None
            held[4] = capturing
        return args

    def _update(self, slot, grad: Optional[torch.Tensor] = None, x=None, dy=None,
                stream=None, scale: Optional[float] = None,
                rows: Optional[Tuple[int, int]] = None, last: bool = True) -> None:
        """One step of slot's parameter, from a gradient tensor or from (X, dY), on `stream`
        (the raw handle of a CUDA stream, _linear.current_stream_handle's; None: the current
        one). rows = (r0, r1): only those rows of the parameter, dY holding their columns
        (forge.loss updates a head's weight block by block); the step is counted once, by the
        call with last=True."""
        if self._checked_step != self._step_id:
            self._check_step()
        st, step, param, device, outputs, hparams, capturing = self._call_parts(slot, stream)
        if rows is not None:
            param = _row_block(param, rows)
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
            self._lib.wgrad_step(args)
        else:
            args, grad = self._elementwise_args(slot, grad, scale, st, step, param, device,
                                                outputs, hparams, capturing)
            self._lib.elementwise_step(args)
        if last:
            self._count_update(slot, st, step, capturing, args.hparams)

    def _update_batch(self, items) -> None:
        """Element-wise steps of several parameters in one libforge call
        (forge_elementwise_step_batch), each with the bits _update(slot, grad=grad,
        scale=scale) gives it; items: [(slot, grad, scale)]. Every call is prepared, and so
        checked, before the library runs any."""
        if not items:
            return
        if self._checked_step != self._step_id:
            self._check_step()
        calls, operands, counts = [], [], []
        for slot, grad, scale in items:
            st, step, param, device, outputs, hparams, capturing = self._call_parts(slot, None)
            args, grad = self._elementwise_args(slot, grad, scale, st, step, param, device,
                                                outputs, hparams, capturing)
            calls.append(args)
            operands.append(grad)  # (alive until the call returns)
            counts.append((slot, st, step, capturing, args.hparams))
        self._lib.elementwise_step_batch(calls)
        for slot, st, step, capturing, hp in counts:
            self._count_update(slot, st, step, capturing, hp)

    def _call_parts(self, slot, stream):
        """What every update of slot's parameter passes: (its state dict, this update's
        1-based step, forge_param, forge_device on `stream`, statistics outputs, group
        hyper-parameters (shared: copied into the args), whether a capture is running)."""
        capturing = self._capturing
        if slot.struct_step == self._step_id and not capturing:
            # NOTE: what _check_step verified for this step (the states, the group, the
            # forge_param) is what every update of it reads: the common case, once per
            # parameter per step, skips looking them up again.
            st, group = slot.checked
            hparams, layout_key = self._group_hparams(group)
            if slot.signature[0] == layout_key:
                device = self._device_struct(slot.local() if slot.dtensor else slot.param,
                                             stream)
                outputs = self._outputs(slot.device) if slot.counts else _NO_OUTPUTS
                return st, st["step"] + 1, slot.struct, device, outputs, hparams, False
        p = slot.param
        group = self._group_of(slot)
        st = self.state.get(p)
        if not st:
            if capturing:  # the states' initialization would be replayed with every step
                raise RuntimeError(f"forge: parameter '{slot.name}' has no optimizer state yet: "
                                   "run at least one step eagerly before capturing one "
                                   "(CUDAGraphStep's warmup)")
            st = self._allocate_state(slot, group, init=True)
        elif slot.signature is None:
            slot.signature = self._signature(slot, group)
        hparams, layout_key = self._group_hparams(group)  # shared: copied into args later
        if slot.signature[0] != layout_key:
            raise RuntimeError(f"forge: parameter '{slot.name}': its group's settings changed "
                               "the update rule or its states (e.g. momentum 0 <-> > 0, centered) "
                               "after the states were created")
        param = slot.struct if slot.struct_step == self._step_id else \
            self._param_struct(slot, st)
        device = self._device_struct(slot.local() if slot.dtensor else p, stream)
        # NOTE: == p.device (checked), no new object; a replica other ranks also count adds
        # nothing to this rank's statistics
        outputs = self._outputs(slot.device) if slot.counts else _NO_OUTPUTS
        return st, st["step"] + 1, param, device, outputs, hparams, capturing

    def _elementwise_args(self, slot, grad, scale, st, step, param, device, outputs, hparams,
                          capturing):
        """slot's kept forge_elementwise_args for `grad` (the parts _call_parts gives), and
        the gradient as the library reads it (alive until the call returns)."""
        grad, code = _as_operand(grad, slot.param)
        args = self._kept_args(slot, "elementwise", device, param, hparams, outputs, step,
                               scale, capturing)
        args.grad, args.grad_dtype = grad.data_ptr(), code
        return args, grad

    def _count_update(self, slot, st, step: int, capturing: bool, hp: _lib.Hparams) -> None:
        if not capturing:  # a captured update runs at each replay: prepare_graph_replay counts it
            self._commit_step(st, step, hp)
        slot.updated_at = self._step_id

    def _commit_step(self, st, step: int, hp: _lib.Hparams) -> None:
        """A parameter's update with hp (its call's hyper-parameters) ran: its step count, and
        NAdam's running product of momentum factors, move on."""
        st["step"] = step
        if self._keeps_mu_product:
            st["mu_product"] = hp.mu_product

    def _mu_product_through(self, st, hp: _lib.Hparams, step: int) -> float:
        """NAdam's μ_1 ⋯ μ_step as torch.optim.NAdam keeps it: the fp32 state['mu_product']
        (through step - 1) times this step's μ, made in double from hp's beta1 and
        momentum_decay as torch makes it, both rounded to fp32 as torch's fp32 state multiplies
        them. With the product carried, a beta1 that changes between steps (OneCycleLR's
        cycle_momentum) weighs each step with its own, as torch does."""
        return _fp32(st["mu_product"] * _fp32(_nadam_mu(hp.beta1, hp.momentum_decay, step)))


def _as_operand(grad: torch.Tensor, p: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """A gradient as libforge reads it: detached, on p's device, contiguous, in a dtype it
    takes; and that dtype's code (forge_dtype)."""
    # NOTE: no torch.no_grad() here either: .grad tensors do not require grad (but for
    # a create_graph=True backward's, detached), so the casts below record nothing.
    if grad.requires_grad:
        grad = grad.detach()
    if grad.device != p.device:
        grad = grad.to(p.device)
    if not grad.is_contiguous():
        grad = grad.contiguous()
    return _linear.forge_dtype(grad)


_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "bf16_sr": 2, "bf16_master": 2}
_STATE_BYTES = {"fp32": 4, "bf16": 2, "bf16_sr": 2, "int8": 1, "fp8": 1}


def _row_block(param: _lib.Param, rows: Tuple[int, int]) -> _lib.Param:
    """The forge_param of rows [r0, r1) of `param` (contiguous rows: the pointers move by
    whole rows), placed at its rows in the full parameter for stochastic rounding."""
    lib = _lib.get()
    r0, r1 = rows
    block = _lib.Param.from_buffer_copy(param)
    cols = param.cols
    block.rows = r1 - r0
    block.weight = param.weight + r0 * cols * _WEIGHT_BYTES[
        lib.enum_names(_lib.ENUM_WEIGHT_FORMAT)[param.weight_format]]
    if param.master:
        block.master = _lib.float_ptr(ctypes.addressof(param.master.contents) + r0 * cols * 4)
    state_bytes = _STATE_BYTES[lib.enum_names(_lib.ENUM_STATE_FORMAT)[param.state_format]]
    blocks_per_row = -(-cols // _lib.INT8_BLOCK)
    for i in range(_lib.MAX_STATES):
        if param.state[i]:
            block.state[i] = param.state[i] + r0 * cols * state_bytes
        if param.state_absmax[i]:
            block.state_absmax[i] = _lib.float_ptr(
                ctypes.addressof(param.state_absmax[i].contents) + r0 * blocks_per_row * 4)
    if hasattr(block, "row_offset"):
        if not param.full_cols:  # the full parameter: its rows are the block's place in it
            block.full_cols = cols
        block.row_offset = param.row_offset + r0
    return block
