"""checkpoint.py — a forge optimizer's state_dict() entry and what load_state_dict checks.

state_dict() is torch's layout ('state' by parameter index, 'param_groups') holding the raw
state buffers, plus a 'forge' entry (entry()) with the storage options, each parameter's state
format, the step count and what an auto optimizer learned. load_state_dict checks the whole
dict (check_load: layouts, formats, dtypes, shapes, values no step could have stored, counts)
before anything is written, then writes it (apply_load): a load is all or nothing. A dict
without the 'forge' entry (torch.distributed.checkpoint's, torch.optim's of the same rule with
fp32 states) loads when every state matches. Every saved param group also carries the entry's
run values (group_entry), so a torch.distributed.checkpoint dict, which keeps the groups'
values, resumes the step count, the lagged clip norm and what auto mode learned.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .calls import as_float, fp32, nadam_mu
from .store import BLOCK_FORMATS, STORAGE_KEYS, check_storage_options, requested_format

# format_version 2 added state_formats: {parameter index: format} of every parameter with
# states (version 1: state_format held for all of them). Version 3: int4 second moments (a
# rule's unsigned states) in the zero-free dynamic-exponent map (formats.h); an older dict's
# are linear-map codes, value (c + 1) / 16 · absmax, and load as those values re-encoded
# (apply_load). A dict without the 'forge' entry says no version: its codes load as they are.
FORMAT_VERSION = 3
_INT4_DYNAMIC_EXPONENT_VERSION = 3

# The largest finite bf16, 0x1.FEp127: no step stores a value of larger magnitude (formats.h).
_BF16_MAX = float.fromhex("0x1.FEp127")

# The largest saved step count: the next step's number, one more, must fit the library's int64.
_MAX_SAVED_COUNT = 2 ** 63 - 2

# torch.optim options a saved param group may carry that FORGE does not do (rules.py refuses
# them in the constructors): loading one would drop it without a word.
_UNSUPPORTED_GROUP_OPTIONS = ("amsgrad", "capturable", "differentiable")

# Steps _constant_mu_product multiplies out one by one (a few ms); beyond, the closed form.
_MU_PRODUCT_LOOP_STEPS = 1 << 16


def entry(shared, store, modes, seed: int, lagged_norm: Optional[float]) -> Dict[str, Any]:
    """state_dict()'s 'forge' entry. lagged_norm: the norm immediate mode's next clip
    coefficient comes from (stepping.py), None before any."""
    return {"format_version": FORMAT_VERSION, "state_format": store.state_format,
            "state_formats": store.formats_by_index(),
            "master_weights": store.master_weights,
            "stochastic_rounding": store.stochastic_rounding, "seed": seed,
            "step_id": shared.step_id, "mode": modes.requested_mode,
            "auto_deferring": modes.auto_deferring, "lagged_clip_norm": lagged_norm}


# The key under which every saved param group carries the entry's run values (group_entry):
# torch.distributed.checkpoint's get_optimizer_state_dict keeps only 'state' and
# 'param_groups', each group's values included.
GROUP_KEY = "forge_run"


def group_entry(entry_: Dict[str, Any]) -> Dict[str, Any]:
    """What each saved param group carries of the 'forge' entry: everything but the formats
    (the formats by parameter index, which a dict keyed by parameter names does not match,
    and the constructor's state_format, which version 1 read as every parameter's): such a
    dict's formats come from its groups' own storage keys (_saved_state_formats)."""
    return {k: v for k, v in entry_.items() if k not in ("state_formats", "state_format")}


def group_steps(state: Dict[Any, Any], group: Dict[str, Any]) -> int:
    """The sum of the step counts of a saved group's parameters that have states: what a
    group's GROUP_KEY entry was saved beside ("state_steps")."""
    total = 0
    for index in group.get("params", ()):
        saved = state.get(index)
        step = saved.get("step") if isinstance(saved, dict) else None
        if step is not None:  # (torch.optim's: a tensor)
            total += int(step.item() if torch.is_tensor(step) else step)
    return total


def saved_entry(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A state dict's 'forge' entry; without one (a torch.distributed.checkpoint dict), what
    its param groups carry (GROUP_KEY), where every carrying group's "state_steps" still sum
    its parameters' step counts (a dict of another optimizer that loaded a forge dict and
    stepped on carries stale values: it says nothing, as a dict without them); else {}."""
    meta = state_dict.get("forge")
    if meta:
        return meta
    carried = None
    for group in state_dict.get("param_groups") or ():
        entry_ = group.get(GROUP_KEY) if isinstance(group, dict) else None
        if entry_ is None:
            continue
        if not isinstance(entry_, dict):
            raise ValueError(f"load_state_dict: a param group's {GROUP_KEY!r} must be a "
                             f"dict, got {type(entry_).__name__}")
        if entry_.get("state_steps") != group_steps(state_dict.get("state", {}), group):
            return {}
        carried = carried or entry_
    return {k: v for k, v in (carried or {}).items() if k != "state_steps"}


class Loaded(NamedTuple):
    """A checked state dict, ready to write (apply_load)."""
    groups: List[Dict[str, Any]]  # every param group as it will be (the dict's values)
    states: List[Tuple[Any, Dict[str, Any], int, Optional[float]]]  # (slot, state, step, mu)
    step_id: int
    linear_int4: List[Tuple[Any, List[int]]]  # (slot, its states saved in the linear int4 map)
    lagged_norm: Optional[float]  # the 'forge' entry's lagged_clip_norm (None without one)


def check_load(state_dict: Dict[str, Any], meta: Dict[str, Any], shared, store, rules,
               check_group) -> Loaded:
    """Everything load_state_dict will write, checked (nothing is written here). meta: the
    dict's 'forge' entry ({} without one); rules: the optimizer's class (rules.py);
    check_group: the optimizer's check of a param group's values."""
    if "master_weights" in meta and meta["master_weights"] != store.master_weights:
        raise ValueError(f"load_state_dict: saved with master_weights="
                         f"{meta['master_weights']!r}, this optimizer has "
                         f"master_weights={store.master_weights!r}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(shared.param_groups):
        raise ValueError(f"load_state_dict: {len(saved_groups)} param groups saved, "
                         f"{len(shared.param_groups)} here")
    # The groups as they will be (hyper-parameters from the dict, our params).
    new_groups = []
    index_to_param = {}
    for i, (saved, group) in enumerate(zip(saved_groups, shared.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError("load_state_dict: a param group's size differs from the saved one")
        _check_saved_group_options(saved, i)
        index_to_param.update(zip(saved["params"], group["params"]))
        new = dict(group)
        # (a group's storage keys stay this optimizer's: the formats are checked below)
        new.update({k: v for k, v in saved.items()
                    if k not in ("params", "param_names", GROUP_KEY) + STORAGE_KEYS})
        check_group(new)
        new_groups.append(new)
    group_of = {id(p): new for new in new_groups for p in new["params"]}
    # (checked per parameter below)
    saved_formats = _saved_state_formats(meta, saved_groups, index_to_param)
    step_id = _saved_count(meta.get("step_id", shared.step_id), "the 'forge' entry's step_id")
    lagged_norm = meta.get("lagged_clip_norm")
    if lagged_norm is not None and (isinstance(lagged_norm, bool)
                                    or not isinstance(lagged_norm, (int, float))
                                    or not 0.0 <= lagged_norm < math.inf):
        raise ValueError("load_state_dict: the 'forge' entry's lagged_clip_norm must be None "
                         f"or a finite number >= 0, got {lagged_norm!r}")
    keeps_mu_product = rules._keeps_mu_product
    states, linear_int4 = [], []
    linear_map = meta.get("format_version", FORMAT_VERSION) < _INT4_DYNAMIC_EXPONENT_VERSION
    for index, saved_state in state_dict["state"].items():
        if index not in index_to_param:
            raise ValueError(f"load_state_dict: state for unknown parameter index {index}")
        p = index_to_param[index]
        slot = shared.slots[id(p)]
        group = group_of[id(p)]
        fmt = _check_saved_format(store, slot, group, index, saved_formats)
        expected = store.spec(slot, group, fmt=fmt)
        counters = ("step", "mu_product") if keeps_mu_product else ("step",)
        keys = set(saved_state) - set(counters)
        if "step" not in saved_state and not rules._torch_keeps_step and keys == set(expected):
            saved_state = dict(saved_state, step=1)  # (torch.optim.SGD's, stepped)
        if keys != set(expected) or "step" not in saved_state:
            raise ValueError(f"load_state_dict: parameter '{slot.name}': saved states "
                             f"{sorted(saved_state)}, expected {sorted(expected)} + "
                             f"{' + '.join(map(repr, counters))} (rule or state_format "
                             "differs)")
        for key, (dtype, shape) in expected.items():
            t = saved_state[key]
            if not torch.is_tensor(t) or t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                 f"must be {dtype} {list(shape)}, got "
                                 f"{getattr(t, 'dtype', type(t))} "
                                 f"{list(getattr(t, 'shape', []))}")
        _check_loaded_values(store, slot, group, saved_state, fmt)
        step = _saved_count(saved_state["step"], f"parameter '{slot.name}': state 'step'")
        mu_product = _saved_mu_product(slot, group, saved_state, step) \
            if keeps_mu_product else None
        states.append((slot, saved_state, step, mu_product))
        if linear_map and fmt == "int4":
            layout = store.layout(slot, group, fmt)
            linear_int4.append((slot, [i for i in range(layout.num_states)
                                       if not layout.is_signed[i]]))
    return Loaded(new_groups, states, step_id, linear_int4,
                  None if lagged_norm is None else float(lagged_norm))


def apply_load(loaded: Loaded, shared, store) -> None:
    """Writes a checked state dict: the groups' values, every state (copied into buffers of
    the exact dtype; nothing is cast) and the step count."""
    for new, group in zip(loaded.groups, shared.param_groups):
        group.update({k: v for k, v in new.items() if k != "params"})
    shared.state.clear()
    for slot, saved_state, step, mu_product in loaded.states:
        group = shared.group_of(slot)
        st = store.allocate(slot, group, init=False)
        for key in store.spec(slot, group):
            st[key].copy_(saved_state[key])
        st["step"] = step
        if mu_product is not None:
            st["mu_product"] = mu_product
    for slot, unsigned in loaded.linear_int4:
        for i in unsigned:
            store.recode_linear_int4(slot, i)
    shared.step_id = loaded.step_id


def _saved_state_formats(meta: Dict[str, Any], saved_groups, index_to_param):
    """The formats a state dict's states were saved in: {index: format} as its 'forge'
    entry says (version 2), one format for every parameter (version 1: a str), or, without
    a 'forge' entry (torch.distributed.checkpoint's dict, or any tool that keeps only
    'state' and 'param_groups'), what each saved group's own "state_format" and
    "min_8bit_size" gave its parameters (int8 and fp8 states have the same dtypes and
    shapes: only these tell them apart). None where nothing says (torch.optim's dict: the
    states' dtypes decide)."""
    if "state_formats" in meta:
        return {int(k): v for k, v in meta["state_formats"].items()}
    if "state_format" in meta:
        return meta["state_format"]
    formats = {}
    for i, saved in enumerate(saved_groups):
        if "state_format" not in saved:
            continue
        fmt = saved["state_format"]
        # (a group of a forge from before min_8bit_size: its format for every parameter)
        min_size = saved.get("min_8bit_size", 0)
        check_storage_options(fmt, min_size, where=f"load_state_dict: saved param group {i}: ")
        for index in saved["params"]:
            p = index_to_param.get(index)
            if p is not None:
                formats[index] = requested_format(saved, p.numel(), fmt, min_size)
    return formats or None


def _check_saved_format(store, slot, group: Dict[str, Any], index: int, saved) -> str:
    """The format slot's states load into (what its group asks for); a state dict that
    says it saved another one is refused, naming the parameter."""
    fmt = store.requested_format(slot, group)
    was = saved.get(index) if isinstance(saved, dict) else saved
    if was is None or was == fmt:
        return fmt
    hint = ""
    if was in BLOCK_FORMATS and group.get("state_format") == was:
        hint = (f" (it has {slot.param.numel()} elements, fewer than min_8bit_size="
                f"{group.get('min_8bit_size')}; a checkpoint made before min_8bit_size "
                f"existed holds {was} states for every parameter: load it with "
                "min_8bit_size=0)")
    raise ValueError(f"load_state_dict: parameter '{slot.name}': saved with "
                     f"state_format={was!r}, this optimizer keeps {fmt!r} states for it"
                     f"{hint}")


def _check_loaded_values(store, slot, group, saved_state, fmt: str) -> None:
    """Values a step could never have stored are refused: NaN/Inf anywhere (states,
    int8 / fp8 absmax, master weights, fp8 codes), magnitudes above the largest bf16 (the
    bound of every value a step stores: forge.h, "Skipped elements"), a negative second
    moment or absmax."""
    layout = store.layout(slot, group, fmt)
    for i in range(layout.num_states):
        name = layout.names[i].decode()
        unsigned = not layout.is_signed[i]
        if fmt in BLOCK_FORMATS:
            checks = [(name + "_absmax", True)]
        else:
            checks = [(name, unsigned)]
        for key, non_negative in checks:
            t = saved_state[key]
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                 "holds NaN or Inf")
            if bool((t.abs() > _BF16_MAX).any()):
                raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                 "holds values above the largest bf16 (no step stores one)")
            if non_negative and bool((t < 0).any()):
                raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                 "holds negative values (it can only be >= 0)")
        if fmt == "fp8" and _bad_fp8_codes(saved_state[name], unsigned):
            raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{name}' "
                             "holds fp8 codes no step stores (NaN, infinity"
                             f"{', or negative' if unsigned else ''})")
    master = saved_state.get("master")
    if master is not None and not bool((master.abs() <= _BF16_MAX).all()):
        raise ValueError(f"load_state_dict: parameter '{slot.name}': state 'master' holds "
                         "NaN, Inf or values above the largest bf16 (no step stores one)")


def _bad_fp8_codes(codes: torch.Tensor, unsigned: bool) -> bool:
    """Whether fp8 state codes (uint8) hold what no step stores: e4m3's NaN (S.1111.111) for a
    signed state; for an unsigned one (e5m2) an infinity or NaN (exponent 11111) or a negative
    value (-0, 0x80, is stored)."""
    c = codes.to(torch.int16)
    if not unsigned:
        return bool(((c & 0x7F) == 0x7F).any())
    return bool((((c & 0x7C) == 0x7C) | (c > 0x80)).any())


def _saved_count(value, what: str) -> int:
    """A saved step count: an int (or a one-element integral tensor) in [0, 2**63 - 2]."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"load_state_dict: {what} must be one integer, got a tensor of "
                             f"shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SAVED_COUNT:
        raise ValueError(f"load_state_dict: {what} must be an integer in [0, 2**63 - 2] (the "
                         f"next step's number must fit int64), got {value!r}")
    return value


def _check_saved_group_options(saved: Dict[str, Any], index: int) -> None:
    for key in _UNSUPPORTED_GROUP_OPTIONS:
        if saved.get(key):
            raise ValueError(f"load_state_dict: saved param group {index}: {key}=True, which "
                             f"FORGE does not do (its constructors refuse it too)")


def _saved_mu_product(slot, group, saved_state, step: int) -> float:
    """NAdam's saved 'mu_product' (torch.optim.NAdam's: a one-element tensor; forge's: a
    float), as the fp32 value it holds, in [0, 1]. A state without one (saved by a forge
    that computed it from the step) gets the product a constant beta1 gives, as torch's
    fp32 state multiplies it."""
    what = f"load_state_dict: parameter '{slot.name}': state 'mu_product'"
    value = saved_state.get("mu_product")
    if value is None:
        return _constant_mu_product(as_float(group["betas"][0], "betas"),
                                    as_float(group["momentum_decay"], "momentum_decay"),
                                    step)
    if torch.is_tensor(value):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{what} must be one float, got a {value.dtype} tensor of "
                             f"shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be a number in [0, 1] (a product of momentum "
                         f"factors), got {value!r}")
    return fp32(float(value))


@functools.lru_cache(maxsize=64)
def _constant_mu_product(beta1: float, momentum_decay: float, step: int) -> float:
    """NAdam's fp32 state['mu_product'] after `step` steps with these constant
    hyper-parameters: through 2^16 steps as torch.optim.NAdam's state multiplies it, step by
    step in fp32 (calls.mu_product_through), and beyond, where that loop would cost a second
    at step 3·10^6, the library's closed form (forge_hparams.mu_product = -1's, in double)
    rounded to fp32. The loop also ends where the product stops changing: at 0, or where
    multiplying by the momentum factor, which only grows with the step, rounds back to it."""
    if step > _MU_PRODUCT_LOOP_STEPS:
        return fp32(_nadam_mu_product_closed(beta1, momentum_decay, step))
    product = 1.0
    for t in range(1, step + 1):
        before = product
        product = fp32(product * fp32(nadam_mu(beta1, momentum_decay, t)))
        if product == before and t > 1:
            break
    return product


def _nadam_mu_product_closed(beta1: float, momentum_decay: float, t: int) -> float:
    """Π_{i=1..t} β1 (1 − ½ q^i), q = 0.96^ψ, in constant time: src/core/hparams.h's
    nadam_mu_product, the same series in the same order."""
    ln_q = momentum_decay * math.log(0.96)
    one_minus_q = -math.expm1(ln_q)
    if not one_minus_q > 0.0:
        return (0.5 * beta1) ** t
    q, q_t, one_minus_q_t = math.exp(ln_q), math.exp(t * ln_q), -math.expm1(t * ln_q)
    a, b, q_k, q_kt, total, half_k = one_minus_q, one_minus_q_t, q, q_t, 0.0, 1.0
    for k in range(1, 65):
        half_k *= 0.5
        term = half_k / k * q_k * (b / a)
        total += term
        if term <= total * 2.0 ** -54:
            break
        a += q_k * one_minus_q
        b += q_kt * one_minus_q_t
        q_k *= q
        q_kt *= q_t
    return beta1 ** t * math.exp(-total)
