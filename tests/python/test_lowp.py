"""test_lowp.py — low-precision storage: bf16 / int8 / fp8 optimizer states, bf16 weights
(with stochastic rounding, or an fp32 master copy), measured on the update against fp32
torch.optim.AdamW (metric and bounds: tolerances.py). CPU runs the CPU backend's formats;
the same tests on CUDA check the GPU backend's."""
import copy

import pytest
import torch

import forge
from conftest import DEVICES, format_devices
from tiny_models import TinyTransformer, lm_loss
from tolerances import (AUTOCAST_UPDATE_RTOL, BF16_MASTER_UPDATE_RTOL,
                        BF16_VS_TORCH_BF16_FACTOR, LOWP_STEPS, STATE_FORMAT_UPDATE_RTOL)

HP = dict(lr=1e-2, weight_decay=0.1)
# forge only: int8 / fp8 states on every parameter (the tiny model's tensors are below
# min_8bit_size's default of 4096 elements, which would keep most of them fp32)
EVERY_INT8 = dict(min_8bit_size=0)


def update_error(weights, reference, start) -> float:
    """max over tensors of ‖Δw − Δw_ref‖₂ / ‖Δw_ref‖₂."""
    worst = 0.0
    for w, r, s in zip(weights, reference, start):
        dw = w.detach().double() - s.detach().double()
        dr = r.detach().double() - s.detach().double()
        worst = max(worst, ((dw - dr).norm() / dr.norm()).item())
    return worst


def train(model, opt, device, autocast=False):
    for step in range(LOWP_STEPS):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model, step, device)
        loss.backward()
        opt.step()
        opt.zero_grad()


def fp32_reference(device):
    """The bf16-representable start and the fp32 torch.optim.AdamW run from it."""
    torch.manual_seed(0)
    start = TinyTransformer().to(device).to(torch.bfloat16).float()
    ref = copy.deepcopy(start)
    train(ref, torch.optim.AdamW(ref.parameters(), **HP), device)
    return start, ref


@pytest.mark.parametrize("state_format,device", format_devices(["bf16", "int8", "fp8"]))
def test_low_precision_states_fp32_model(state_format, device, record_difference):
    start, ref = fp32_reference(device)
    model = copy.deepcopy(start)
    opt = forge.optim.AdamW(model, state_format=state_format, **HP, **EVERY_INT8)
    train(model, opt, device)
    err = update_error(model.parameters(), ref.parameters(), start.parameters())
    record_difference(f"fp32 model, {state_format} states (update)", err)
    assert err <= STATE_FORMAT_UPDATE_RTOL[state_format]
    p = model.blocks[0].up.weight
    dtype = {"bf16": torch.bfloat16, "int8": torch.uint8, "fp8": torch.uint8}[state_format]
    assert opt.state[p]["exp_avg"].dtype == dtype and opt.state[p]["exp_avg_sq"].dtype == dtype


@pytest.mark.parametrize("state_format,device", format_devices(["fp32", "bf16", "int8", "fp8"]))
def test_bf16_model_with_master_weights(state_format, device, record_difference):
    start, ref = fp32_reference(device)
    model = copy.deepcopy(start).to(torch.bfloat16)
    opt = forge.optim.AdamW(model, state_format=state_format, master_weights=True, **HP,
                            **EVERY_INT8)
    train(model, opt, device)
    masters = [opt.state[p]["master"] for p in model.parameters()]
    for p, master in zip(model.parameters(), masters):
        assert torch.equal(p, master.to(torch.bfloat16)), "bf16 copy = nearest(master)"
    err = update_error(masters, ref.parameters(), start.parameters())
    record_difference(f"bf16 model + master, {state_format} states", err)
    assert err <= BF16_MASTER_UPDATE_RTOL[state_format]


@pytest.mark.parametrize("state_format,device", format_devices(["fp32", "bf16", "int8", "fp8"]))
def test_bf16_model_stochastic_rounding(state_format, device, record_difference):
    start, ref = fp32_reference(device)
    torch_bf16 = copy.deepcopy(start).to(torch.bfloat16)
    train(torch_bf16, torch.optim.AdamW(torch_bf16.parameters(), **HP), device)
    torch_err = update_error(torch_bf16.parameters(), ref.parameters(), start.parameters())

    model = copy.deepcopy(start).to(torch.bfloat16)
    opt = forge.optim.AdamW(model, state_format=state_format, **HP, **EVERY_INT8)
    train(model, opt, device)
    err = update_error(model.parameters(), ref.parameters(), start.parameters())
    record_difference(f"bf16 model SR, {state_format} states", err)
    record_difference("torch.optim.AdamW on the bf16 model", torch_err)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert err <= BF16_VS_TORCH_BF16_FACTOR * torch_err


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bf16(device, record_difference):
    """fp32 weights, bf16 autocast: the fused step reads bf16 X and dY (torch's own
    autocast casts), dX/db come back in autocast's dtypes; matches torch under autocast."""
    start, _ = fp32_reference(device)
    ref, model = copy.deepcopy(start), copy.deepcopy(start)
    train(ref, torch.optim.AdamW(ref.parameters(), **HP), device, autocast=True)
    train(model, forge.optim.AdamW(model, **HP), device, autocast=True)
    assert all(p.grad is None and p.dtype == torch.float32 for p in model.parameters())
    err = update_error(model.parameters(), ref.parameters(), start.parameters())
    record_difference("autocast bf16 vs torch autocast", err)
    assert err <= AUTOCAST_UPDATE_RTOL


def test_stochastic_rounding_is_seeded():
    """Same seed: identical bits; another seed: different bits (SR draws from the seed)."""
    def run(seed):
        torch.manual_seed(0)
        model = TinyTransformer().to(torch.bfloat16)
        opt = forge.optim.AdamW(model, lr=1e-3, state_format="bf16", seed=seed)
        for step in range(2):
            lm_loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, z) for x, z in zip(a, c))
