"""test_int4.py — int4 optimizer states through forge.optim, on the CPU and CUDA backends.

- The stored bytes are what formats.h documents: two 4-bit codes per byte (column 2j low, 2j + 1
  high), each row ceil(cols / 2) bytes (an odd row's last high nibble 0), an fp32 absmax per 64
  columns, value = map[code] · absmax with the signed (first moment) and unsigned (second
  moment) maps written out here from their definitions: state_fp32 decodes exactly that.
- AdamW with int4 states trains (the loss falls as with fp32 states, within the share the C++
  least-squares test measures), on either device.
- A CUDA step stores the CPU's bytes: the same gradients on both devices give the same weights,
  codes and absmax bit for bit (the fused kernels' cases: tests/cpp/gpu).
- A state dict from before the current second-moment map (format_version 2: linear codes)
  loads as its values re-encoded.
State-dict round trips and resumed runs: test_state.py's int4 cases.
"""
import copy

import pytest
import torch

import forge
from conftest import DEVICES, requires_cuda
from tolerances import STATE_STORE_RTOL

# The 4-bit dynamic-exponent values: decades 10^-2, 10^-1, 1 with 1, 2, 4 midpoints of equal bins
# of [0.1, 1]; signed codes 0 (zero), 1..8 positive up to 1, 9..15 negative from -0.8875.
# Unsigned, without zero: decades 10^-3 .. 1 with 1, 2, 4, 8 midpoints, then 1; code c the c-th.
def _decades(counts):
    return [v * 10.0 ** (i - len(counts) + 1) for i, n in enumerate(counts) for v in
            [0.1 + (k + 0.5) * 0.9 / n for k in range(n)]]


_POSITIVE = _decades([1, 2, 4])
SIGNED_MAP = torch.tensor([0.0] + _POSITIVE + [1.0] + [-v for v in reversed(_POSITIVE)],
                          dtype=torch.float32)
UNSIGNED_MAP = torch.tensor(_decades([1, 2, 4, 8]) + [1.0], dtype=torch.float32)


def _decode(codes: torch.Tensor, absmax: torch.Tensor, cols: int, table: torch.Tensor):
    """[rows, ceil(cols / 2)] packed codes + [rows, ceil(cols / 64)] absmax -> [rows, cols]."""
    low, high = codes & 15, codes >> 4
    unpacked = torch.stack([low, high], dim=-1).reshape(codes.shape[0], -1)[:, :cols]
    scale = absmax.repeat_interleave(64, dim=1)[:, :cols]
    return table[unpacked.long()] * scale


def test_maps_are_the_documented_values():
    assert SIGNED_MAP[:9].tolist() == pytest.approx(
        [0, 0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0])
    assert SIGNED_MAP[9:].tolist() == pytest.approx(
        [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055])
    assert UNSIGNED_MAP.tolist() == pytest.approx(
        [0.00055, 0.00325, 0.00775, 0.02125, 0.04375, 0.06625, 0.08875, 0.15625, 0.26875,
         0.38125, 0.49375, 0.60625, 0.71875, 0.83125, 0.94375, 1.0])


@pytest.mark.parametrize("cols", [129, 200])
def test_stored_bytes_decode_as_documented(cols):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(cols, 17, bias=False))
    opt = forge.optim.AdamW(model, lr=1e-2, state_format="int4", min_8bit_size=0)
    x = torch.randn(9, cols)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    w = model[0].weight
    st, decoded = opt.state[w], opt.state_fp32(w)
    assert st["exp_avg"].shape == (17, -(-cols // 2)) and st["exp_avg"].dtype == torch.uint8
    for name, table in (("exp_avg", SIGNED_MAP), ("exp_avg_sq", UNSIGNED_MAP)):
        want = _decode(st[name], st[name + "_absmax"], cols, table)
        assert torch.equal(decoded[name], want), name
        assert decoded[name].abs().max() > 0
        if cols % 2:  # an odd row's padding nibble is stored 0, whatever the allocation held
            assert not (st[name][:, -1] >> 4).any(), name


LINEAR_MAP = torch.arange(1, 17, dtype=torch.float32) / 16  # format_version 2's second moments


@pytest.mark.parametrize("device", DEVICES)
def test_a_dict_of_the_linear_second_moment_map_loads_reencoded(device):
    """A format_version 2 dict's int4 second moments are linear-map codes, (c + 1) / 16 ·
    absmax: they load as those values in the current map (within its half gap of the block's
    absmax, STATE_STORE_RTOL), the first moments and the step as saved; a current dict loads
    bit for bit."""
    cols = 200

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(cols, 17, bias=False).to(device)
        return model, forge.optim.AdamW(model, lr=1e-2, state_format="int4", min_8bit_size=0)

    model, opt = build()
    x = torch.randn(9, cols, device=device)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    old = copy.deepcopy(saved)
    old["forge"]["format_version"] = 2
    g = torch.Generator().manual_seed(1)
    linear_codes = torch.randint(0, 256, saved["state"][0]["exp_avg_sq"].shape, generator=g,
                                 dtype=torch.uint8).to(device)
    old["state"][0]["exp_avg_sq"] = linear_codes
    absmax = saved["state"][0]["exp_avg_sq_absmax"]
    values = _decode(linear_codes, absmax, cols, LINEAR_MAP.to(device))

    model2, opt2 = build()
    opt2.load_state_dict(old)
    st, w2 = opt2.state[model2.weight], model2.weight
    got = opt2.state_fp32(w2)["exp_avg_sq"]
    bound = STATE_STORE_RTOL["int4"]["exp_avg_sq"] * absmax.repeat_interleave(64, 1)[:, :cols]
    assert ((got - values).abs() <= bound).all()
    assert not torch.equal(st["exp_avg_sq"], linear_codes)  # (other maps: other codes)
    assert torch.equal(st["exp_avg"], saved["state"][0]["exp_avg"])
    assert st["step"] == saved["state"][0]["step"]

    model3, opt3 = build()
    opt3.load_state_dict(saved)
    for name in ("exp_avg", "exp_avg_sq", "exp_avg_sq_absmax"):
        assert torch.equal(opt3.state[model3.weight][name], saved["state"][0][name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_with_int4_states_trains(device):
    torch.manual_seed(1)
    x, w_star = torch.randn(256, 128), 0.3 * torch.randn(8, 128)
    x, y = x.to(device), (x @ w_star.T).to(device)
    losses = {}
    for fmt in ("fp32", "int4"):
        torch.manual_seed(2)
        model = torch.nn.Linear(128, 8, bias=False).to(device)
        opt = forge.optim.AdamW(model, lr=1e-2, weight_decay=0.0, state_format=fmt,
                                min_8bit_size=0)
        first = None
        for _ in range(200):
            loss = 0.5 * (model(x) - y).square().sum(1).mean()
            first = first or loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[fmt] = (first, loss.item())
    (first32, last32), (first4, last4) = losses["fp32"], losses["int4"]
    assert last4 < first4 / 10, losses
    # (the C++ least-squares test's floor: int4 makes at least half fp32's log-progress)
    import math
    assert math.log(first4 / last4) >= 0.5 * math.log(first32 / last32), losses


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [129, 200])
def test_a_cuda_step_stores_the_cpu_bytes(dtype, cols):
    """An embedding's rows, each looked up once, get the loss's weights as their gradient
    exactly on both devices; its update (the element-wise kernel on CUDA) must then give the
    same weights, int4 codes and absmax bit for bit, over steps whose states build up."""
    torch.manual_seed(3)
    rows = 37
    base = torch.nn.Embedding(rows, cols).to(dtype)
    models = {d: torch.nn.Embedding(rows, cols).to(dtype).to(d) for d in ("cpu", "cuda")}
    opts = {}
    for d, m in models.items():
        m.load_state_dict(base.state_dict())
        opts[d] = forge.optim.AdamW(m, lr=1e-2, state_format="int4", min_8bit_size=0, seed=5)
    ids = torch.randperm(rows)
    for step in range(4):
        target = torch.randn(rows, cols, generator=torch.Generator().manual_seed(step))
        target[:, ::7] *= 1e-3  # blocks of mixed magnitudes: small codes too
        for d, m in models.items():
            (m(ids.to(d)).float() * target.to(d)).sum().backward()
            opts[d].step()
            opts[d].zero_grad()
    w_cpu, w_cuda = models["cpu"].weight, models["cuda"].weight
    assert torch.equal(w_cpu.detach(), w_cuda.detach().cpu())
    st_cpu, st_cuda = opts["cpu"].state[w_cpu], opts["cuda"].state[w_cuda]
    for name in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        assert torch.equal(st_cpu[name], st_cuda[name].cpu()), name
    assert st_cpu["exp_avg"].shape == (rows, -(-cols // 2))
