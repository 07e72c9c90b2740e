"""calls.py — the C structs of a libforge call, built from a param group and a parameter's states.

Functions of their arguments, and two caches of what they build:
  HparamsTable   a group's forge_hparams (the rule's, from rules.py), cached on the group's
                 values, so a scheduler's new lr, or any change, is honoured at the next call
  Devices        forge_device of a tensor's device and stream, or of the CPU's threads
  kept_args      a parameter's forge_wgrad_args / forge_elementwise_args, kept between calls,
                 with one call's structs and scalars written in
  write_operands the operands of a fused call (X and dY) into kept args
  row_block      the forge_param of a block of rows (forge.loss's head updates W row-block-wise)
  as_operand     a gradient as the library reads it
The updater (updater.py) makes the calls with them; the store (store.py) makes forge_param.
"""
from __future__ import annotations

import ctypes
import math
import operator
import struct
from typing import Any, Dict, Optional, Tuple

import torch

from .. import _lib
from .. import _linear

NO_OUTPUTS = _lib.StepOutputs()  # (NULL pointers: no statistics)
_OPERANDS, _OPERANDS_AT = _lib.WGRAD_OPERANDS

# Entries of the small caches (hyper-parameters, devices) before they are emptied: a
# scheduler's new lr every step, or a new CUDA stream every step, stays bounded.
_CACHE_LIMIT = 64


def fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def nadam_mu(beta1: float, momentum_decay: float, step: int) -> float:
    """NAdam's momentum factor μ_step, in double as torch.optim.NAdam computes it."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


def mu_product_through(mu_product: float, hp: _lib.Hparams, step: int) -> float:
    """NAdam's μ_1 ⋯ μ_step as torch.optim.NAdam keeps it: the fp32 state['mu_product']
    (through step - 1) times this step's μ, made in double from hp's beta1 and
    momentum_decay as torch makes it, both rounded to fp32 as torch's fp32 state multiplies
    them. With the product carried, a beta1 that changes between steps (OneCycleLR's
    cycle_momentum) weighs each step with its own, as torch does."""
    return fp32(mu_product * fp32(nadam_mu(hp.beta1, hp.momentum_decay, step)))


def commit(st: Dict[str, Any], step: int, hp: _lib.Hparams, keeps_mu_product: bool) -> None:
    """A parameter's update with hp (its call's hyper-parameters) ran: its step count, and
    NAdam's running product of momentum factors, move on."""
    st["step"] = step
    if keeps_mu_product:
        st["mu_product"] = hp.mu_product


def as_float(value, name: str) -> float:
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


class HparamsTable:
    """A group's forge_hparams, from the rule's class (rules.py: its classmethods _rule, _fill
    and _layout_key), cached on the values of the group keys it reads."""

    def __init__(self, lib, rules: type, keys: Tuple[str, ...]):
        self._lib = lib
        self._rules = rules
        self._keys = keys  # (3 at least: the rule's defaults, lr, weight_decay, maximize)
        self._values = operator.itemgetter(*keys)
        self._cache: Dict[tuple, Tuple[_lib.Hparams, tuple]] = {}
        self._defaults: Dict[int, _lib.Hparams] = {}

    def check(self, group: Dict[str, Any]) -> None:
        """torch.optim's checks of a group's hyper-parameters, with its messages, and the
        rule's own (rules.py, _check_group_rule)."""
        lr = as_float(group["lr"], "lr")
        if not 0.0 <= lr < math.inf:
            raise ValueError(f"Invalid learning rate: {group['lr']} (must be finite and >= 0)")
        wd = as_float(group["weight_decay"], "weight_decay")
        if not 0.0 <= wd < math.inf:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        if "betas" in group:
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"Invalid betas: {betas!r} (a pair of floats)")
            for i, b in enumerate(betas):
                if not 0.0 <= as_float(b, "betas") < 1.0:
                    raise ValueError(f"Invalid beta parameter at index {i}: {b} "
                                     "(must be in [0, 1))")
        if "eps" in group and not 0.0 < as_float(group["eps"], "eps") < math.inf:
            raise ValueError(f"Invalid epsilon value: {group['eps']} (FORGE needs eps > 0)")
        self._rules._check_group_rule(group)

    def check_in_library(self, group: Dict[str, Any], what: str) -> None:
        """The library's own validation of group's forge_hparams, as a backstop: a ValueError
        naming the field (what: who asks, the optimizer's name)."""
        try:
            self._lib.state_layout(self.for_call(group, step=1, seed=0), _lib.STATE_FP32, 1, 1)
        except _lib.ForgeInvalidArgument as e:
            raise ValueError(f"{what}: {e}") from None

    def layout_key(self, group: Dict[str, Any]) -> tuple:
        """What decides the rule and its states; a change after the states exist is refused."""
        return self._rules._layout_key(group)

    def for_call(self, group: Dict[str, Any], step: int, seed: int) -> _lib.Hparams:
        """group's forge_hparams for one call (a copy: the caller may change it)."""
        hp = _lib.Hparams.from_buffer_copy(self.of(group)[0])
        hp.step = step
        hp.seed = seed
        return hp

    def of(self, group: Dict[str, Any]) -> Tuple[_lib.Hparams, tuple]:
        """(forge_hparams of group's current values, step and seed the library's defaults;
        its layout_key).
        The pair is shared and never changed: callers copy the struct (for_call, or a ctypes
        field assignment, which copies).

        NOTE: cached on the values of every key the rule reads (self._keys), read from the
        group on every call, so a scheduler's new lr or a user's new betas is honoured at the
        next update; the cache only skips the ~10 conversions and ctypes stores (1.0 µs per
        update uncached, 0.2 µs on a hit, 2-core CPU dev host). Values that could change in
        place without the key changing (a tensor lr, a list of betas) are never cached."""
        try:
            key = self._values(group)  # NOTE: one C call: 1/3 of tuple(map(group.get))
        except KeyError:  # a key deleted from the group by hand (maximize defaults to False)
            key = tuple(map(group.get, self._keys))
        try:
            cached = self._cache.get(key)
        except TypeError:  # an unhashable value (betas given as a list): never cached
            cached = None
        if cached is not None:
            return cached
        rules = self._rules
        rule = rules._rule(group)
        default = self._defaults.get(rule)
        if default is None:
            default = self._defaults[rule] = self._lib.hparams_default(rule)
        hp = _lib.Hparams.from_buffer_copy(default)
        hp.lr = as_float(group["lr"], "lr")
        hp.weight_decay = as_float(group["weight_decay"], "weight_decay")
        hp.maximize = int(bool(group.get("maximize", False)))
        rules._fill(hp, group)
        cached = (hp, rules._layout_key(group))
        if _immutable_values(key):
            if len(self._cache) >= _CACHE_LIMIT:  # e.g. a new lr every step
                self._cache.clear()
            self._cache[key] = cached
        return cached


class Devices:
    """forge_device structs, one per (device index, stream) or CPU thread count, made once: the
    callers pass them on by value (a ctypes Structure assigned to a field, or passed as an
    argument, is copied) and never change them."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads  # CPU backend threads (0: torch.get_num_threads())
        self._structs: Dict[Tuple[int, int], _lib.Device] = {}

    def of(self, t: torch.Tensor, stream: Optional[int] = None) -> _lib.Device:
        """Where a call on t runs: its CUDA device and `stream` (the raw cudaStream_t handle,
        as _linear.current_stream_handle gives; None: the device's current stream), or the
        CPU with num_threads."""
        if t.is_cuda:
            index = t.get_device()
            if stream is None:
                stream = _linear.current_stream_handle(index)
            key = (index, stream)
        else:
            key = (-1, self.num_threads or torch.get_num_threads())
        d = self._structs.get(key)
        if d is None:
            d = _lib.Device()
            if key[0] >= 0:
                d.kind, d.index, d.stream = _lib.DEVICE_CUDA, key[0], key[1]
            else:
                d.kind, d.num_threads = _lib.DEVICE_CPU, key[1]
            if len(self._structs) >= _CACHE_LIMIT:  # streams made and dropped by the user
                self._structs.clear()
            self._structs[key] = d
        return d


def kept_args(slot, kind: str, device, param, hparams, outputs, step: int, seed: int,
              scale: float, mu_product: Optional[float], capturing: bool,
              region: Optional[int]):
    """slot's forge_wgrad_args or forge_elementwise_args (kind "wgrad" / "elementwise"),
    kept between calls, with this call's structs and scalars in it (outputs None: the ones
    it holds): seed, the gradient scale, NAdam's running product through the step before
    (mu_product; None for other rules) and, while capturing, the address of the run-scalars
    region the call reads (capture.py). The caller sets the operands' pointers."""
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
    hp.step, hp.seed = step, seed
    if mu_product is not None:
        hp.mu_product = mu_product_through(mu_product, hp, step)
    if hp.grad_scale != scale:
        hp.grad_scale = scale
    if capturing or held[4]:
        hp.run_scalars = region
        held[4] = capturing
    return args


def write_operands(args, x2: torch.Tensor, ldx: int, dy2: torch.Tensor, lddy: int,
                   tokens: int) -> bool:
    """Writes a fused call's operands (x2, dy2: tokens rows, leading dimensions ldx, lddy)
    into its forge_wgrad_args; False (nothing written) for a dtype the library does not
    read."""
    codes = _linear.FORGE_DTYPE_CODES
    x_code, dy_code = codes.get(x2.dtype), codes.get(dy2.dtype)
    if x_code is None or dy_code is None:
        return False
    _OPERANDS.pack_into(args, _OPERANDS_AT, tokens, x2.data_ptr(), x_code, ldx,
                        dy2.data_ptr(), dy_code, lddy)
    return True


def as_operand(grad: torch.Tensor, p: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """A gradient as libforge reads it: detached, on p's device, contiguous, in a dtype it
    takes; and that dtype's code (forge_dtype)."""
    # NOTE: no torch.no_grad() here: .grad tensors do not require grad (but for a
    # create_graph=True backward's, detached), so the casts below record nothing.
    if grad.requires_grad:
        grad = grad.detach()
    if grad.device != p.device:
        grad = grad.to(p.device)
    if not grad.is_contiguous():
        grad = grad.contiguous()
    return _linear.forge_dtype(grad)


_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "bf16_sr": 2, "bf16_master": 2}
_STATE_BYTES = {"fp32": 4, "bf16": 2, "bf16_sr": 2, "int8": 1, "fp8": 1}


def _state_row_bytes(state_format: str, cols: int) -> int:
    """Bytes of one row of a state of `cols` elements (int4: two codes per byte)."""
    return -(-cols // 2) if state_format == "int4" else cols * _STATE_BYTES[state_format]


def row_block(param: _lib.Param, rows: Tuple[int, int]) -> _lib.Param:
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
    state_row = _state_row_bytes(
        lib.enum_names(_lib.ENUM_STATE_FORMAT)[param.state_format], cols)
    blocks_per_row = -(-cols // _lib.INT8_BLOCK)
    for i in range(_lib.MAX_STATES):
        if param.state[i]:
            block.state[i] = param.state[i] + r0 * state_row
        if param.state_absmax[i]:
            block.state_absmax[i] = _lib.float_ptr(
                ctypes.addressof(param.state_absmax[i].contents) + r0 * blocks_per_row * 4)
    if hasattr(block, "row_offset"):
        if not param.full_cols:  # the full parameter: its rows are the block's place in it
            block.full_cols = cols
        block.row_offset = param.row_offset + r0
    return block
