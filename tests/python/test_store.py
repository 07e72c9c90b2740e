"""test_store.py — forge/optim/store.py on its own: each parameter's state format, its state
tensors and its forge_param, over slots made by hand (no model, no optimizer).
"""
import collections

import pytest
import torch

import forge
import forge.optim
from forge.optim.calls import Devices, HparamsTable
from forge.optim.shared import Shared
from forge.optim.slot import Slot
from forge.optim.store import Store

_KEYS = ("betas", "eps", "lr", "maximize", "weight_decay")


class _Backward:
    """What a slot holds weakly (backward.py's part): nothing of it is used here (and it may
    be gone)."""


def _store(params, state_format="fp32", min_8bit_size=4096, master_weights=False, **group):
    """A Store over `params` (one param group), their slots, and the shared record."""
    shared = Shared("auto", deferring=True)
    lib = forge.library()
    store = Store(shared, lib, HparamsTable(lib, forge.optim.AdamW, _KEYS), Devices(1),
                  state_format=state_format, min_8bit_size=min_8bit_size,
                  master_weights=master_weights, stochastic_rounding=True,
                  keeps_mu_product=False)
    shared.state = collections.defaultdict(dict)
    shared.param_groups = [dict({"params": list(params), "lr": 1e-3, "betas": (0.9, 0.999),
                                 "eps": 1e-8, "weight_decay": 0.0, "maximize": False}, **group)]
    backward = _Backward()
    slots = []
    for i, p in enumerate(params):
        slot = Slot(backward, p, i, [f"p{i}"], "hook")
        shared.slots[id(p)] = slot
        slots.append(slot)
    return store, shared, slots


def test_8bit_formats_keep_small_parameters_fp32():
    big, small = torch.zeros(64, 64), torch.zeros(16)
    store, shared, (s_big, s_small) = _store([big, small], state_format="int8")
    group = shared.param_groups[0]
    assert store.requested_format(s_big, group) == "int8"
    assert store.requested_format(s_small, group) == "fp32"  # (below min_8bit_size)
    group["min_8bit_size"] = 0
    assert store.requested_format(s_small, group) == "int8"


def test_a_format_is_fixed_once_the_states_exist():
    p = torch.zeros(64, 64)
    store, shared, (slot,) = _store([p], state_format="int8")
    group = shared.param_groups[0]
    store.allocate(slot, group, init=True)
    assert slot.state_format == "int8" and store.format_of(slot, group) == "int8"
    group["state_format"] = "bf16"
    assert store.format_of(slot, group) == "int8"
    with pytest.raises(RuntimeError, match="state format is fixed once its states exist"):
        store.check_storage(slot, group)


@pytest.mark.parametrize("fmt,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                       ("int8", torch.uint8), ("fp8", torch.uint8)])
def test_spec_has_the_formats_tensors(fmt, dtype):
    p = torch.zeros(8, 130, dtype=torch.bfloat16)
    store, shared, (slot,) = _store([p], state_format=fmt, min_8bit_size=0,
                                    master_weights=True)
    spec = store.spec(slot, shared.param_groups[0])
    assert spec["exp_avg"] == (dtype, (8, 130)) and spec["exp_avg_sq"] == (dtype, (8, 130))
    assert spec["master"] == (torch.float32, (8, 130))
    if fmt in ("int8", "fp8"):
        assert spec["exp_avg_absmax"] == (torch.float32, (8, 3))  # (a block of 64 per row)
    else:
        assert "exp_avg_absmax" not in spec


def test_allocate_makes_the_rules_initial_states():
    p = torch.randn(4, 4, dtype=torch.bfloat16)
    store, shared, (slot,) = _store([p], master_weights=True)
    st = store.allocate(slot, shared.param_groups[0], init=True)
    assert st["step"] == 0 and slot.signature[1] == ("exp_avg", "exp_avg_sq")
    assert torch.equal(st["exp_avg"], torch.zeros(4, 4))
    assert torch.equal(st["master"], p.float())  # (the bf16 weight's fp32 master copy)
    assert shared.state[p] is st


def test_param_struct_is_kept_until_a_state_tensor_is_replaced():
    p = torch.zeros(4, 4)
    store, shared, (slot,) = _store([p])
    st = store.allocate(slot, shared.param_groups[0], init=True)
    fp = store.param_struct(slot, st)
    assert store.param_struct(slot, st) is fp and fp.state[0] == st["exp_avg"].data_ptr()
    old = st["exp_avg"]
    st["exp_avg"] = old.clone()
    fp2 = store.param_struct(slot, st)
    assert fp2 is not fp and fp2.state[0] == st["exp_avg"].data_ptr()
    st["exp_avg"] = old.double()
    with pytest.raises(RuntimeError, match="state 'exp_avg' must be a contiguous"):
        store.param_struct(slot, st)


def test_state_fp32_decodes_8bit_states():
    p = torch.zeros(64, 64)
    store, shared, (slot,) = _store([p], state_format="int8")
    st = store.allocate(slot, shared.param_groups[0], init=True)
    assert store.state_fp32(p)["exp_avg"].abs().max() == 0  # (zeros: AdamW's initial moments)
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        store.state_fp32(torch.zeros(2))
    assert st["exp_avg"].dtype == torch.uint8
