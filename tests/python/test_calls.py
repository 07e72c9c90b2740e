"""test_calls.py — forge/optim/calls.py on its own: the C structs of a libforge call.

HparamsTable turns a param group into forge_hparams through a rule's class (no optimizer
needed: the rules' knowledge is in classmethods) and caches on the group's values; Devices
makes one forge_device per device and stream; kept_args writes one call's structs and scalars
into a parameter's kept args, copying a struct only when it changed; write_operands and
row_block place the operands and a block of rows.
"""
import pytest
import torch

import forge
import forge.optim
from forge import _lib, _linear
from forge.optim import calls


def _table(rules=forge.optim.AdamW, keys=("betas", "eps", "lr", "maximize", "weight_decay")):
    return calls.HparamsTable(forge.library(), rules, keys)


def _group(**values):
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "maximize": False}
    group.update(values)
    return group


def test_hparams_of_a_group_are_the_rules_and_cached_on_its_values():
    table = _table()
    group = _group()
    hp, key = table.of(group)
    assert (hp.rule, hp.lr, hp.beta1, hp.decoupled_weight_decay) == (
        _lib.RULE_ADAMW, 1e-3, 0.9, 1)
    assert key == (_lib.RULE_ADAMW,)
    assert table.of(dict(group))[0] is hp  # (equal values: the cached struct)
    group["lr"] = 5e-4  # a scheduler's new lr is honoured at the next call
    assert table.of(group)[0].lr == 5e-4 and table.of(group)[0] is not hp


def test_values_that_change_in_place_are_never_cached():
    table = _table()
    group = _group(betas=[0.9, 0.999])  # (a list: it may change without the key changing)
    first = table.of(group)[0]
    group["betas"][0] = 0.5
    assert table.of(group)[0].beta1 == 0.5 and first.beta1 == 0.9


def test_for_call_copies_with_step_and_seed():
    table = _table()
    group = _group()
    shared = table.of(group)[0]
    before = (shared.step, shared.seed)
    hp = table.for_call(group, step=7, seed=3)
    assert (hp.step, hp.seed) == (7, 3) and hp.lr == shared.lr
    assert (shared.step, shared.seed) == before  # (the shared struct is not changed)


def test_layout_key_is_the_rules():
    table = _table(forge.optim.RMSprop, ("alpha", "centered", "eps", "lr", "maximize",
                                         "momentum", "weight_decay"))
    group = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.9,
             "centered": True, "maximize": False}
    assert table.layout_key(group) == (_lib.RULE_RMSPROP, True, True)


@pytest.mark.parametrize("bad,match", [(dict(lr=-1.0), "Invalid learning rate"),
                                       (dict(betas=(0.9, 1.0)), "beta parameter at index 1"),
                                       (dict(eps=0.0), "Invalid epsilon"),
                                       (dict(lr="x"), "lr: must be a number")])
def test_check_refuses_a_group_as_torch_does(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _table().check(_group(**bad))


def test_devices_makes_one_struct_per_cpu_thread_count():
    devices = calls.Devices(num_threads=3)
    t = torch.zeros(2)
    d = devices.of(t)
    assert (d.kind, d.num_threads) == (_lib.DEVICE_CPU, 3) and devices.of(t) is d
    assert calls.Devices(0).of(t).num_threads == torch.get_num_threads()


class _Slot:
    """What kept_args reads of a slot."""

    def __init__(self):
        self.kept_args = {}


def test_kept_args_copy_a_struct_only_when_it_changed():
    table, devices = _table(), calls.Devices(1)
    slot = _Slot()
    hparams = table.of(_group())[0]
    device = devices.of(torch.zeros(1))
    param = _lib.Param()
    args = calls.kept_args(slot, "elementwise", device, param, hparams, calls.NO_OUTPUTS,
                           step=4, seed=9, scale=0.5, mu_product=None, capturing=False,
                           region=None)
    _, held, hp = slot.kept_args["elementwise"]
    assert isinstance(args, _lib.ElementwiseArgs) and args.abi_version == _lib.ABI_VERSION
    assert (hp.step, hp.seed, hp.grad_scale) == (4, 9, 0.5) and held[2] is hparams
    again = calls.kept_args(slot, "elementwise", device, param, hparams, None, step=5, seed=9,
                            scale=0.5, mu_product=None, capturing=True, region=4096)
    assert again is args and (hp.step, hp.run_scalars) == (5, 4096) and held[4]
    calls.kept_args(slot, "elementwise", device, param, hparams, None, step=6, seed=9,
                    scale=1.0, mu_product=None, capturing=False, region=None)
    assert hp.run_scalars is None and not held[4] and hp.grad_scale == 1.0


def test_kept_args_carry_nadams_product():
    table = calls.HparamsTable(forge.library(), forge.optim.NAdam,
                               ("betas", "decoupled_weight_decay", "eps", "lr", "maximize",
                                "momentum_decay", "weight_decay"))
    group = _group(momentum_decay=4e-3, decoupled_weight_decay=False)
    hparams = table.of(group)[0]
    slot = _Slot()
    calls.kept_args(slot, "wgrad", calls.Devices(1).of(torch.zeros(1)), _lib.Param(), hparams,
                    calls.NO_OUTPUTS, step=3, seed=0, scale=1.0, mu_product=0.25,
                    capturing=False, region=None)
    hp = slot.kept_args["wgrad"][2]
    assert hp.mu_product == calls.mu_product_through(0.25, hp, 3)


def test_write_operands_refuses_a_dtype_the_library_does_not_read():
    args = _lib.WgradArgs()
    x, dy = torch.zeros(3, 4), torch.zeros(3, 2)
    _linear.forge_dtype(x)  # (the dtype codes are read from the library at first use)
    assert calls.write_operands(args, x, 4, dy, 2, 3)
    assert (args.tokens, args.x, args.ldx, args.dy, args.lddy) == (
        3, x.data_ptr(), 4, dy.data_ptr(), 2)
    assert not calls.write_operands(_lib.WgradArgs(), x.double(), 4, dy, 2, 3)


def test_row_block_moves_every_pointer_by_whole_rows():
    weight = torch.zeros(6, 5)
    state = torch.zeros(6, 5)
    param = _lib.Param()
    param.rows, param.cols = 6, 5
    param.weight_format = _lib.WEIGHT_FP32
    param.state_format = _lib.STATE_FP32
    param.weight = weight.data_ptr()
    param.state[0] = state.data_ptr()
    block = calls.row_block(param, (2, 5))
    assert (block.rows, block.cols) == (3, 5)
    assert block.weight == weight[2].data_ptr() and block.state[0] == state[2].data_ptr()
    if hasattr(block, "row_offset"):
        assert (block.row_offset, block.full_cols) == (2, 5)


def test_as_operand_detaches_and_makes_contiguous():
    p = torch.zeros(4, 3)
    grad = torch.randn(3, 4, requires_grad=True).t()
    t, code = calls.as_operand(grad, p)
    assert not t.requires_grad and t.is_contiguous() and code == _lib.DTYPE_FP32
    assert torch.equal(t, grad.detach())
