"""test_contract.py — the contract: after loss.backward(); opt.step(), every parameter of an
fp32 model with fp32 states equals what torch.optim.<Same>(model.parameters(), same
hyper-parameters) gives (Lion: the paper's update), for every step, on the tiny
transformer (embedding, attention, MLP, RMSNorm, untied head). Bounds: tolerances.py.
"""
import ctypes

import pytest
import torch

import forge.optim
import forge.optim.routing as routing

from conftest import DEVICES
from reference import assert_contract, trajectories
from tiny_models import TinyTransformer

STEPS = 8  # RAdam's rectification switches on at step 6

CONFIGS = [
    ("AdamW", {}),
    ("AdamW", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1, momentum_decay=8e-3, decoupled_weight_decay=True)),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1)),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    ("Lion", dict(lr=1e-3, weight_decay=0.1)),
    ("RMSprop", dict(lr=1e-3, weight_decay=0.01)),
    ("RMSprop", dict(lr=1e-3, alpha=0.9, centered=True, momentum=0.9, weight_decay=0.01)),
    ("Adagrad", dict(lr=1e-2, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
]


def config_id(config):
    name, kwargs = config
    return name + ("-" + "-".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "-defaults")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("mode", ["default", "immediate"])
def test_matches_torch_optim(config, device, mode, record_difference):
    """The default (its first step deferred: where X and dY outweigh dW it forms dW with
    torch's GEMM, which sums as stock torch does) and immediate mode (the fused step at every
    step: on the CPU the ordered reference's sums, held to its one-ulp bound)."""
    name, kwargs = config
    options = {"mode": "immediate"} if mode == "immediate" else None
    errors = trajectories(TinyTransformer, name, kwargs, device, steps=STEPS,
                          forge_options=options)
    if mode == "immediate":
        assert not errors["forge_formed_dw"]
    record_difference(f"{name} vs torch (same sum order)", errors["forge_vs_ordered"])
    record_difference(f"{name} vs stock torch.optim", errors["forge_vs_stock"])
    record_difference(f"{name}: torch itself, 1-ulp grads", errors["ulp_vs_ordered"])
    assert_contract(errors, device)


@pytest.mark.parametrize("device", DEVICES)
def test_no_decay_groups_and_scheduler(device, record_difference):
    """param_groups_no_decay + an LR scheduler: per-group lr/weight_decay are read when each
    update runs, so the schedule and the groups give torch.optim's trajectory."""
    import forge

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [1.0, 0.5, 0.25, 2.0, 0.0][s % 5])

    errors = trajectories(TinyTransformer, "AdamW", dict(lr=1e-2, weight_decay=0.1), device,
                          steps=6, make_schedule=schedule,
                          params_fn=lambda m: forge.optim.param_groups_no_decay(m, 0.1))
    record_difference("AdamW groups + LambdaLR", errors["forge_vs_ordered"])
    assert_contract(errors, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["immediate", "deferred", "auto"])
@pytest.mark.parametrize("name", ["NAdam", "AdamW", "RAdam"])
def test_one_cycle_schedule_cycling_beta1(name, mode, device, record_difference):
    """OneCycleLR moves lr and, with cycle_momentum (its default), betas[0] every step. NAdam
    weighs each step's momentum factor with that step's beta1 through its running
    state['mu_product'], as torch.optim.NAdam does."""
    def schedule(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS,
                                                   base_momentum=0.6, max_momentum=0.95)

    errors = trajectories(TinyTransformer, name, dict(lr=1e-2, weight_decay=0.1), device,
                          steps=STEPS, make_schedule=schedule, forge_options=dict(mode=mode))
    record_difference(f"{name} OneCycleLR ({mode})", errors["forge_vs_ordered"])
    assert_contract(errors, device)


@pytest.mark.parametrize("mode", ["deferred", "auto"])
@pytest.mark.parametrize("name", ["AdamW", "NAdam"])
def test_a_schedule_stepped_between_backward_and_step(name, mode, record_difference):
    """A loop that steps its scheduler after backward and before opt.step() (OneCycleLR: lr
    and beta1): torch.optim applies the new values. So does deferred mode, at opt.step(), and
    auto stays deferred for such a loop (immediate mode refuses it: test_loop.py)."""
    def schedule(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 1,
                                                   base_momentum=0.6, max_momentum=0.95)

    errors = trajectories(TinyTransformer, name, dict(lr=1e-2, weight_decay=0.1), "cpu",
                          steps=STEPS, make_schedule=schedule, forge_options=dict(mode=mode),
                          schedule_before_step=True)
    record_difference(f"{name} schedule before step ({mode})", errors["forge_vs_ordered"])
    assert_contract(errors, "cpu")


def test_scheduler_changes_lr():
    import forge
    model = TinyTransformer()
    opt = forge.optim.SGD(model, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    from tiny_models import lm_loss
    for step in range(3):
        lm_loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    # lr 0: the next backward leaves every weight as it is (plain SGD, no decay)
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    lm_loss(model, 3).backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_param_groups_no_decay_split():
    import forge
    model = TinyTransformer()
    decay, keep = forge.optim.param_groups_no_decay(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert {names[id(p)] for p in keep["params"]} >= {"blocks.0.attn.q.bias", "norm.weight"}
    assert "blocks.0.attn.q.weight" in {names[id(p)] for p in decay["params"]}



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["batched", "hook"])
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[9], CONFIGS[12]], ids=config_id)
def test_both_elementwise_paths_match_torch_optim(config, path, device, monkeypatch,
                                                  record_difference):
    """The tiny transformer's element-wise parameters (embedding, norms, biases) batched into
    one library call at step() (the default for parameters this small), or each applied by
    its own hook inside backward (what parameters above BATCHED_MAX_ELEMENTS take)."""
    if path == "hook":
        monkeypatch.setattr(routing, "BATCHED_MAX_ELEMENTS", 0)
    name, kwargs = config
    opt = getattr(forge.optim, name)(TinyTransformer(), **kwargs)
    assert {p.path for p in opt.inspect()} == {"fused", path}
    errors = trajectories(TinyTransformer, name, kwargs, device, steps=STEPS)
    record_difference(f"{name} vs torch, element-wise by {path}", errors["forge_vs_ordered"])
    assert_contract(errors, device)


def test_wgrad_operand_writer_matches_the_struct_fields():
    """_lib.WGRAD_OPERANDS (the fused update's one-call write of its operands) writes the same
    bytes as assigning forge_wgrad_args' fields one by one, and nothing beside them."""
    from forge import _lib
    packer, offset = _lib.WGRAD_OPERANDS
    values = (4097, 0x7F0012345670, _lib.DTYPE_BF16, 1 << 33, 0x7F00ABCDEF00, _lib.DTYPE_FP16,
              129)
    by_fields, packed = _lib.WgradArgs(), _lib.WgradArgs()
    for struct in (by_fields, packed):  # (every other byte non-zero: a stray write shows)
        ctypes_bytes = (ctypes.c_ubyte * ctypes.sizeof(struct)).from_buffer(struct)
        ctypes_bytes[:] = [0xA5] * len(ctypes_bytes)
    (by_fields.tokens, by_fields.x, by_fields.x_dtype, by_fields.ldx, by_fields.dy,
     by_fields.dy_dtype, by_fields.lddy) = values
    packer.pack_into(packed, offset, *values)
    assert bytes(packed)[:offset] == bytes(by_fields)[:offset]
    end = _lib.WgradArgs.lddy.offset + _lib.WgradArgs.lddy.size
    assert bytes(packed)[end:] == bytes(by_fields)[end:]
    # field by field (the padding between them is the struct's own business)
    for name, value in zip(("tokens", "x", "x_dtype", "ldx", "dy", "dy_dtype", "lddy"), values):
        assert getattr(packed, name) == value, name
