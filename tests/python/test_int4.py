"""test_int4.py — int4 optimizer states through forge.optim, on the CPU backend.

- The stored bytes are what formats.h documents: two 4-bit codes per byte (column 2j low, 2j + 1
  high), each row ceil(cols / 2) bytes, an fp32 absmax per 64 columns, value = map[code] ·
  absmax with the signed (first moment) and unsigned (second moment) maps written out here
  from their definitions: state_fp32 decodes exactly that.
- AdamW with int4 states trains (the loss falls as with fp32 states, within the share the C++
  least-squares test measures).
- CUDA parameters are refused by name when int4 is asked for them, at construction, before
  anything is made (libforge's CUDA backend has no int4 kernels; the C ABI refuses them too).
State-dict round trips and resumed runs: test_state.py's int4 cases.
"""
import pytest
import torch

import forge
from conftest import requires_cuda

# The 4-bit dynamic-exponent values: decades 10^-2, 10^-1, 1 with 1, 2, 4 midpoints of equal bins
# of [0.1, 1]; signed codes 0 (zero), 1..8 positive up to 1, 9..15 negative from -0.8875.
_POSITIVE = [v * 10.0 ** (i - 2) for i in range(3) for v in
             [0.1 + (k + 0.5) * 0.9 / 2 ** i for k in range(2 ** i)]]
SIGNED_MAP = torch.tensor([0.0] + _POSITIVE + [1.0] + [-v for v in reversed(_POSITIVE)],
                          dtype=torch.float32)
UNSIGNED_MAP = torch.arange(1, 17, dtype=torch.float32) / 16


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


def test_adamw_with_int4_states_trains():
    torch.manual_seed(1)
    x, w_star = torch.randn(256, 128), 0.3 * torch.randn(8, 128)
    y = x @ w_star.T
    losses = {}
    for fmt in ("fp32", "int4"):
        torch.manual_seed(2)
        model = torch.nn.Linear(128, 8, bias=False)
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
def test_int4_is_refused_for_a_cuda_parameter():
    model = torch.nn.Linear(128, 64, device="cuda")
    with pytest.raises(ValueError, match=r"state_format: 'int4' states run on the CPU backend "
                                         r"only .* on cuda"):
        forge.optim.AdamW(model, lr=1e-3, state_format="int4", min_8bit_size=0)
    # a param group asking for it later: refused where the group is checked, by name
    opt = forge.optim.AdamW(model, lr=1e-3)
    with pytest.raises(ValueError, match=r"state_format: 'int4' states run on the CPU backend "
                                         r"only .* param group 1: holds a parameter on cuda"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(64, 128, device="cuda"))],
                             "state_format": "int4", "min_8bit_size": 0})
    # below min_8bit_size a parameter keeps fp32 states: nothing to refuse
    forge.optim.AdamW(torch.nn.Linear(4, 4, device="cuda"), lr=1e-3, state_format="int4")


@requires_cuda
def test_int4_asked_later_for_a_cuda_parameter_is_refused_before_any_update():
    """A group switched to int4 after construction, before its parameters' states exist: the
    step's first callback refuses it, by name, before any weight of the step changes."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64)).cuda()
    opt = forge.optim.AdamW(model, lr=1e-3, min_8bit_size=0)
    opt.param_groups[0]["state_format"] = "int4"
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"state_format: 'int4' states run on the CPU backend "
                                         r"only .* is on cuda"):
        model(torch.randn(8, 128, device="cuda")).square().mean().backward()
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
