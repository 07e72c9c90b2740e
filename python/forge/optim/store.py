"""store.py — how a forge optimizer stores its states: formats, tensors, the forge_param struct.

The state format ("fp32", "bf16", "int8", "fp8", "int4") is per parameter: its param group's
"state_format" (default: the constructor's state_format), where a block format ("int8", "fp8",
"int4") gives a parameter of fewer than the group's "min_8bit_size" elements (default 4096,
bitsandbytes' name and value) fp32 states. It is fixed when the parameter's states are made
(slot.state_format); a group changed afterwards is refused at the next step. With
master_weights / stochastic_rounding it decides the storage codes passed to libforge; the
states of a parameter are plain tensors in optimizer.state[param] under torch.optim's names
(exp_avg, exp_avg_sq, ...; block formats add <name>_absmax, master weights "master"; int4
codes are two per byte, the last dimension halved, rounded up), so
state_dict() holds the raw buffers, and its 'forge' entry each parameter's format
(checkpoint.py).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .. import _lib
from . import distributed

STATE_FORMATS = ("fp32", "bf16", "int8", "fp8", "int4")
# Formats of a code per element and an fp32 absmax per block of 64 columns of a row.
BLOCK_FORMATS = ("int8", "fp8", "int4")
_UPDATABLE = (torch.float32, torch.bfloat16)  # parameter dtypes FORGE updates
MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller parameters keep fp32 states under 8 bits
# The keys a param group may carry to choose its storage (defaults: the constructor's).
STORAGE_KEYS = ("state_format", "min_8bit_size")


def check_storage_options(state_format, min_8bit_size, where: str = "") -> None:
    """state_format / min_8bit_size as a constructor argument or a param group's key
    (`where` names the group); one ValueError naming the argument."""
    if not isinstance(state_format, str) or state_format not in STATE_FORMATS:
        raise ValueError(f"{where}state_format: unknown value {state_format!r}; choose one of "
                         f"{', '.join(STATE_FORMATS)}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) \
            or min_8bit_size < 0:
        raise ValueError(f"{where}min_8bit_size: must be an int >= 0, got {min_8bit_size!r}")


def packed_shape(shape: tuple) -> tuple:
    """An int4 state's shape: the parameter's, two codes per byte along the last dimension
    (each row ceil(cols / 2) bytes, as libforge lays them out)."""
    if not shape:
        return (1,)
    return tuple(shape[:-1]) + (-(-shape[-1] // 2),)


def requested_format(group: Dict[str, Any], numel: int, default_format: str,
                     default_min_8bit_size: int) -> str:
    """The state format a parameter of `numel` elements in `group` gets: the group's
    "state_format", with a block format meaning fp32 below "min_8bit_size" elements."""
    fmt = group.get("state_format", default_format)
    if fmt in BLOCK_FORMATS and numel < group.get("min_8bit_size", default_min_8bit_size):
        return "fp32"
    return fmt


def state_format_code(fmt: str, stochastic_rounding: bool) -> int:
    if fmt == "fp32":
        return _lib.STATE_FP32
    if fmt == "int8":
        return _lib.STATE_INT8_BLOCK64
    if fmt == "fp8":
        return _lib.STATE_FP8_BLOCK64
    if fmt == "int4":
        return _lib.STATE_INT4_BLOCK64
    return _lib.STATE_BF16_STOCHASTIC if stochastic_rounding else _lib.STATE_BF16


class Store:
    """The states of every parameter: their formats, tensors and forge_param (see the file
    header). shared: the optimizer's Shared; hparams: its calls.HparamsTable; devices: its
    calls.Devices."""

    def __init__(self, shared, lib, hparams, devices, *, state_format: str,
                 min_8bit_size: int, master_weights: bool, stochastic_rounding: bool,
                 keeps_mu_product: bool):
        self.shared = shared
        self._lib = lib
        self._hparams = hparams
        self._devices = devices
        self.state_format = state_format  # the default of every param group
        self.min_8bit_size = min_8bit_size
        self.master_weights = master_weights
        self.stochastic_rounding = stochastic_rounding
        self._keeps_mu_product = keeps_mu_product  # NAdam: state['mu_product'] (rules.py)

    @torch.no_grad()
    def state_fp32(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The optimizer states of `param` decoded to fp32 tensors of its shape (bf16
        widened, int8 / fp8 codes decoded through forge_state_to_fp32), for inspection."""
        slot = self.shared.slots.get(id(param))
        if slot is None or slot.param is not param:
            raise ValueError("state_fp32: not a parameter of this optimizer")
        st = self.shared.state.get(param)
        if not st or slot.signature is None:
            return {}
        group = self.shared.group_of(slot)
        hp = self._hparams.for_call(group, step=max(1, st["step"]), seed=0)
        fp = self.param_struct(slot, st)
        out = {}
        for i, name in enumerate(slot.signature[1]):
            t = torch.empty(slot.local().shape, dtype=torch.float32, device=param.device)
            self._lib.state_to_fp32(fp, hp, i, t.data_ptr(), self._devices.of(param))
            out[name] = distributed.as_state(t, param, tuple(param.shape))
        return out

    @torch.no_grad()
    def recode_linear_int4(self, slot, index: int) -> None:
        """Re-encodes int4 state `index` of slot's parameter, whose codes are the linear map's
        (an older state dict's second moments: value (c + 1) / 16 · absmax), as those values
        through forge_state_from_fp32: the codes and absmax the current map gives them."""
        st = self.shared.state[slot.param]
        name = slot.signature[1][index]
        codes, absmax = st[name], st[name + "_absmax"]
        codes, absmax = distributed.local(codes), distributed.local(absmax)
        rows, cols = slot.local().shape  # codes: [rows, ceil(cols / 2)]
        nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(rows, -1)[:, :cols]
        scale = absmax.repeat_interleave(64, dim=1)[:, :cols]  # absmax: [rows, ceil(cols / 64)]
        values = ((nibbles.float() + 1) / 16 * scale).contiguous()  # [rows, cols]
        group = self.shared.group_of(slot)
        hp = self._hparams.for_call(group, step=max(1, st["step"]), seed=0)
        self._lib.state_from_fp32(self.param_struct(slot, st), hp, index, values.data_ptr(),
                                  self._devices.of(slot.param))

    def weight_format(self, slot) -> int:
        if slot.dtype == torch.float32:
            return _lib.WEIGHT_FP32
        if slot.dtype != torch.bfloat16:  # accepted frozen at construction, trained now
            raise RuntimeError(f"forge: parameter '{slot.name}' ({slot.dtype}) got a gradient, "
                               "but FORGE updates float32 or bfloat16 parameters only (it was "
                               "frozen when the optimizer was built, so it was accepted)")
        if self.master_weights:
            return _lib.WEIGHT_BF16_MASTER
        return _lib.WEIGHT_BF16_STOCHASTIC if self.stochastic_rounding else _lib.WEIGHT_BF16

    def requested_format(self, slot, group: Dict[str, Any]) -> str:
        """The state format slot's group asks for: its "state_format", with "int8" / "fp8"
        meaning fp32 below "min_8bit_size" elements (of the whole parameter, on every rank
        alike)."""
        return requested_format(group, slot.param.numel(), self.state_format,
                                self.min_8bit_size)

    def format_of(self, slot, group: Dict[str, Any]) -> str:
        """slot's state format: fixed once its states exist, else what its group asks for."""
        if slot.state_format is not None and self.shared.state.get(slot.param):
            return slot.state_format
        return self.requested_format(slot, group)

    def check_group_storage(self, group: Dict[str, Any]) -> None:
        """A param group's "state_format" / "min_8bit_size" (torch fills the defaults in)."""
        index = next((i for i, g in enumerate(self.shared.param_groups) if g is group), None)
        where = "param group: " if index is None else f"param group {index}: "
        fmt = group.get("state_format", self.state_format)
        min_size = group.get("min_8bit_size", self.min_8bit_size)
        check_storage_options(fmt, min_size, where=where)

    def formats_by_index(self) -> Dict[int, str]:
        """{state_dict index: state format} of every parameter that has states."""
        state = self.shared.state
        return {slot.index: slot.state_format for slot in self.shared.slots.values()
                if slot.state_format is not None and state.get(slot.param)}

    def _fix_state_format(self, slot, group: Dict[str, Any]) -> None:
        """slot's states are made now: their format is fixed from here on (check_storage)."""
        slot.state_format = self.requested_format(slot, group)
        slot.storage_asked = (group.get("state_format"), group.get("min_8bit_size"))

    def check_storage(self, slot, group: Dict[str, Any]) -> None:
        """Before a step's first update (updater.py, check_step): refuses a parameter of a
        dtype FORGE does not update (accepted frozen) that now holds a gradient, and a group
        whose state format changed after slot's states were made (their buffers hold the old
        format; converting them is not implemented)."""
        if slot.dtype not in _UPDATABLE and slot.param.grad is not None:
            self.weight_format(slot)  # (raises, naming it)
        if slot.state_format is None:  # states not made yet: made in the group's format
            return
        # NOTE: the group's keys as they were when the format was fixed: nothing changed (the
        # common case, once per parameter per step): 0.9 -> 0.3-0.5 µs (2-core CPU dev host)
        if slot.storage_asked == (group.get("state_format"), group.get("min_8bit_size")):
            return
        if not self.shared.state.get(slot.param):
            return
        want = self.requested_format(slot, group)
        if want != slot.state_format:
            raise RuntimeError(
                f"forge: parameter '{slot.name}': its param group now asks for "
                f"state_format={want!r} (state_format={group.get('state_format')!r}, "
                f"min_8bit_size={group.get('min_8bit_size')!r}), but its states were made as "
                f"{slot.state_format!r}; a parameter's state format is fixed once its states "
                "exist: restore the group's value, or build a new optimizer")

    def layout(self, slot, group: Dict[str, Any], fmt: Optional[str] = None
               ) -> _lib.StateLayout:
        hp = self._hparams.for_call(group, step=1, seed=0)
        code = state_format_code(fmt or self.format_of(slot, group), self.stochastic_rounding)
        return self._lib.state_layout(hp, code, slot.rows, slot.cols)

    def spec(self, slot, group: Dict[str, Any], local: bool = False,
             fmt: Optional[str] = None) -> Dict[str, Tuple[torch.dtype, tuple]]:
        """Every state tensor this parameter keeps: key -> (dtype, shape), the shape of the
        full parameter's state, or (local) of this rank's shard of it; in format `fmt`
        (default: the parameter's, format_of)."""
        fmt = fmt or self.format_of(slot, group)
        layout = self.layout(slot, group, fmt)
        if local:
            shape, rows, cols = tuple(slot.local().shape), slot.rows, slot.cols
        else:
            shape = tuple(slot.param.shape)
            cols = shape[-1] if shape else 1
            rows = slot.param.numel() // cols if cols else 0
        spec = {}
        for i in range(layout.num_states):
            name = layout.names[i].decode()
            if fmt == "fp32":
                spec[name] = (torch.float32, shape)
            elif fmt == "bf16":
                spec[name] = (torch.bfloat16, shape)
            else:  # int8 / fp8 / int4
                spec[name] = (torch.uint8, packed_shape(shape) if fmt == "int4" else shape)
                spec[name + "_absmax"] = (torch.float32, (rows, -(-cols // _lib.INT8_BLOCK)))
        if self.weight_format(slot) == _lib.WEIGHT_BF16_MASTER:
            spec["master"] = (torch.float32, shape)
        return spec

    def signature(self, slot, group: Dict[str, Any]) -> tuple:
        if slot.state_format is None:  # states made by hand (torch-style): fixed from here on
            self._fix_state_format(slot, group)
        layout = self.layout(slot, group)
        return (self._hparams.layout_key(group),
                tuple(layout.names[i].decode() for i in range(layout.num_states)))

    def allocate(self, slot, group: Dict[str, Any], init: bool) -> Dict[str, Any]:
        """slot's states made anew (init: to the rule's initial values; else left for a load
        to fill) in its group's format, which is fixed from here on."""
        p = slot.param
        fmt = self.requested_format(slot, group)
        if slot.dtensor and fmt in BLOCK_FORMATS:
            distributed.check_int8_blocks(slot.geometry, slot.name)
        self._fix_state_format(slot, group)
        slot.struct_step = -1  # (new state tensors: the struct check_step made is stale)
        st = self.shared.state[p]
        st.clear()
        full = self.spec(slot, group)
        for key, (dtype, shape) in self.spec(slot, group, local=True).items():
            t = torch.empty(shape, dtype=dtype, device=p.device)
            if slot.dtensor:  # a DTensor of the parameter's layout (checkpoints reshard it)
                placements = (distributed.absmax_placements(p) if key.endswith("_absmax")
                              else None)
                t = distributed.as_state(t, p, full[key][1], placements)
            st[key] = t
        st["step"] = 0
        if self._keeps_mu_product:
            st["mu_product"] = 1.0  # (NAdam's product of momentum factors: none yet)
        slot.signature = self.signature(slot, group)
        if init:
            if "master" in st:
                distributed.local(st["master"]).copy_(slot.local().detach())
            hp = self._hparams.for_call(group, step=1, seed=0)
            self._lib.state_init(self.param_struct(slot, st), hp, self._devices.of(p))
        return st

    def param_struct(self, slot, st: Dict[str, Any]) -> _lib.Param:
        """slot's forge_param: built once and kept while the formats, the weight and every
        state tensor stay the same (a state replaced by load_state_dict, or by hand, has a new
        data pointer, and the struct is rebuilt)."""
        # NOTE: the options the formats derive from (slot.dtype is fixed), not the formats
        # themselves, and a list comprehension with isinstance instead of a generator with
        # torch.is_tensor: 0.86 -> 0.53 µs per update (2-core CPU dev host).
        key = [slot.state_format, self.master_weights, self.stochastic_rounding]
        if slot.dtensor:
            local = distributed.local
            key.append(local(slot.param).data_ptr())
            key += [local(t).data_ptr() for t in st.values() if isinstance(t, torch.Tensor)]
        else:  # NOTE: no call per tensor where nothing is sharded (every step, every parameter)
            key.append(slot.param.data_ptr())
            key += [t.data_ptr() for t in st.values() if isinstance(t, torch.Tensor)]
        cached = slot.param_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        fp = self._build_param_struct(slot, st)
        slot.param_cache = (key, fp)
        return fp

    def _check_state_tensors(self, slot, st: Dict[str, Any]) -> None:
        """Every state tensor libforge will read and write for slot: present, of the format's
        dtype and the parameter's shape, on its device, contiguous (a tensor replaced by hand
        is checked here before any pointer of it is passed on)."""
        p = slot.param
        spec = self.spec(slot, self.shared.group_of(slot), local=True)
        for key, (dtype, shape) in spec.items():
            t = st.get(key)
            if isinstance(t, torch.Tensor):
                t = distributed.local(t)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape \
                    or t.device != p.device or not t.is_contiguous():
                raise RuntimeError(
                    f"forge: parameter '{slot.name}': state '{key}' must be a contiguous "
                    f"{dtype} tensor of shape {list(shape)} on {p.device}, got "
                    f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}"
                    f"{' on ' + str(t.device) if isinstance(t, torch.Tensor) else ''}")

    def _build_param_struct(self, slot, st: Dict[str, Any]) -> _lib.Param:
        self._check_state_tensors(slot, st)
        local = distributed.local
        fp = _lib.Param()
        fp.rows, fp.cols = slot.rows, slot.cols
        fp.weight_format = self.weight_format(slot)
        fp.weight = slot.local().data_ptr()
        if "master" in st:
            fp.master = _lib.float_ptr(local(st["master"]).data_ptr())
        fp.state_format = state_format_code(slot.state_format, self.stochastic_rounding)
        for i, name in enumerate(slot.signature[1]):
            fp.state[i] = local(st[name]).data_ptr()
            if slot.state_format in BLOCK_FORMATS:
                fp.state_absmax[i] = _lib.float_ptr(local(st[name + "_absmax"]).data_ptr())
        geo = slot.geometry
        if geo.full_cols and hasattr(fp, "row_offset"):  # a shard: its elements' full indices
            fp.row_offset, fp.col_offset, fp.full_cols = \
                geo.row_offset, geo.col_offset, geo.full_cols
        return fp
