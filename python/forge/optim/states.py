"""states.py — how a forge optimizer stores its states: formats, tensors, the forge_param struct.

state_format ("fp32", "bf16", "int8") and master_weights / stochastic_rounding decide the
storage codes passed to libforge; the states of a parameter are plain tensors in
optimizer.state[param] under torch.optim's names (exp_avg, exp_avg_sq, ...; int8 adds
<name>_absmax, master weights "master"), so state_dict() holds the raw buffers.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from .. import _lib
from . import distributed

STATE_FORMATS = ("fp32", "bf16", "int8")


class _StatesMixin:
    """State storage and formats of _ForgeOptimizer (see the file header)."""

    @torch.no_grad()
    def state_fp32(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The optimizer states of `param` decoded to fp32 tensors of its shape (bf16
        widened, int8 codes × absmax through forge_state_to_fp32), for inspection."""
        slot = self._slots.get(id(param))
        if slot is None or slot.param is not param:
            raise ValueError("state_fp32: not a parameter of this optimizer")
        st = self.state.get(param)
        if not st or slot.signature is None:
            return {}
        group = self._group_of(slot)
        hp = self._hparams(group, step=max(1, st["step"]), seed=0)
        fp = self._param_struct(slot, st)
        out = {}
        for i, name in enumerate(slot.signature[1]):
            t = torch.empty(slot.local().shape, dtype=torch.float32, device=param.device)
            self._lib.state_to_fp32(fp, hp, i, t.data_ptr(), self._device_struct(param))
            out[name] = distributed.as_state(t, param, tuple(param.shape))
        return out

    def _weight_format(self, slot) -> int:
        if slot.dtype == torch.float32:
            return _lib.WEIGHT_FP32
        if self.master_weights:
            return _lib.WEIGHT_BF16_MASTER
        return _lib.WEIGHT_BF16_STOCHASTIC if self.stochastic_rounding else _lib.WEIGHT_BF16

    def _state_format_code(self) -> int:
        if self.state_format == "fp32":
            return _lib.STATE_FP32
        if self.state_format == "int8":
            return _lib.STATE_INT8_BLOCK64
        return _lib.STATE_BF16_STOCHASTIC if self.stochastic_rounding else _lib.STATE_BF16

    def _layout(self, slot, group: Dict[str, Any]) -> _lib.StateLayout:
        hp = self._hparams(group, step=1, seed=0)
        return self._lib.state_layout(hp, self._state_format_code(), slot.rows, slot.cols)

    def _state_spec(self, slot, group: Dict[str, Any],
                    local: bool = False) -> Dict[str, Tuple[torch.dtype, tuple]]:
        """Every state tensor this parameter keeps: key -> (dtype, shape), the shape of the
        full parameter's state, or (local) of this rank's shard of it."""
        layout = self._layout(slot, group)
        if local:
            shape, rows, cols = tuple(slot.local().shape), slot.rows, slot.cols
        else:
            shape = tuple(slot.param.shape)
            cols = shape[-1] if shape else 1
            rows = slot.param.numel() // cols if cols else 0
        spec = {}
        for i in range(layout.num_states):
            name = layout.names[i].decode()
            if self.state_format == "fp32":
                spec[name] = (torch.float32, shape)
            elif self.state_format == "bf16":
                spec[name] = (torch.bfloat16, shape)
            else:
                spec[name] = (torch.uint8, shape)
                spec[name + "_absmax"] = (torch.float32, (rows, -(-cols // _lib.INT8_BLOCK)))
        if self._weight_format(slot) == _lib.WEIGHT_BF16_MASTER:
            spec["master"] = (torch.float32, shape)
        return spec

    def _layout_key(self, group: Dict[str, Any]) -> tuple:
        """What decides the rule and its states; a change after the states exist is refused."""
        return (self._rule(group),)

    def _signature(self, slot, group: Dict[str, Any]) -> tuple:
        layout = self._layout(slot, group)
        return (self._layout_key(group),
                tuple(layout.names[i].decode() for i in range(layout.num_states)))

    def _allocate_state(self, slot, group: Dict[str, Any], init: bool) -> Dict[str, Any]:
        p = slot.param
        if slot.dtensor and self.state_format == "int8":
            distributed.check_int8_blocks(slot.geometry, slot.name)
        st = self.state[p]
        st.clear()
        full = self._state_spec(slot, group)
        for key, (dtype, shape) in self._state_spec(slot, group, local=True).items():
            t = torch.empty(shape, dtype=dtype, device=p.device)
            if slot.dtensor:  # a DTensor of the parameter's layout (checkpoints reshard it)
                placements = (distributed.absmax_placements(p) if key.endswith("_absmax")
                              else None)
                t = distributed.as_state(t, p, full[key][1], placements)
            st[key] = t
        st["step"] = 0
        slot.signature = self._signature(slot, group)
        if init:
            if "master" in st:
                distributed.local(st["master"]).copy_(slot.local().detach())
            hp = self._hparams(group, step=1, seed=0)
            self._lib.state_init(self._param_struct(slot, st), hp, self._device_struct(p))
        return st

    def _param_struct(self, slot, st: Dict[str, Any]) -> _lib.Param:
        """slot's forge_param: built once and kept while the formats, the weight and every
        state tensor stay the same (a state replaced by load_state_dict, or by hand, has a new
        data pointer, and the struct is rebuilt)."""
        # NOTE: the options the formats derive from (slot.dtype is fixed), not the formats
        # themselves, and a list comprehension with isinstance instead of a generator with
        # torch.is_tensor: 0.86 -> 0.53 µs per update (2-core CPU dev host).
        local = distributed.local
        key = [self.state_format, self.master_weights, self.stochastic_rounding,
               local(slot.param).data_ptr()]
        key += [local(t).data_ptr() for t in st.values() if isinstance(t, torch.Tensor)]
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
        spec = self._state_spec(slot, self._group_of(slot), local=True)
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
        fp.weight_format = self._weight_format(slot)
        fp.weight = slot.local().data_ptr()
        if "master" in st:
            fp.master = _lib.float_ptr(local(st["master"]).data_ptr())
        fp.state_format = self._state_format_code()
        for i, name in enumerate(slot.signature[1]):
            fp.state[i] = local(st[name]).data_ptr()
            if self.state_format == "int8":
                fp.state_absmax[i] = _lib.float_ptr(local(st[name + "_absmax"]).data_ptr())
        geo = slot.geometry
        if geo.full_cols and hasattr(fp, "row_offset"):  # a shard: its elements' full indices
            fp.row_offset, fp.col_offset, fp.full_cols = \
                geo.row_offset, geo.col_offset, geo.full_cols
        return fp
