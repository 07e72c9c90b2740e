"""test_load_checks.py — load_state_dict refuses, naming what and changing nothing, the dicts
that used to load wrong, and loads fast what used to load slowly:

- a dict of another state format whose 'forge' entry is gone (what a generic checkpoint tool
  keeps: 'state' and 'param_groups'): fp8 codes read as int8 ones were off by 8 % (exp_avg)
  and 100 % (exp_avg_sq); the saved param groups still say which format each parameter had;
- a step count past int64 (ctypes wrapped 2^64 to 1, and fused and element-wise parameters
  disagreed on their step);
- a group of torch.optim's asking for what FORGE does not do (an un-stepped AdamW with
  amsgrad=True has no state to tell, and its amsgrad was dropped);
- an int8 / fp8 absmax above the largest bf16 (no step stores one);
- a lagged clip norm no step saves (negative, not finite, not a number);
- a NAdam state without 'mu_product' at step 3·10^6 (its product was multiplied out in a
  Python loop: a second per load).
Constructor edges: Adagrad's initial_accumulator_value above the largest bf16 with bf16
states (every element was skipped forever) and a num_threads above what the library takes
(every step failed) are refused by name.
"""
import copy
import time

import pytest
import torch

import forge
from tolerances import PROMPT_LOAD_SECONDS


def _model():
    torch.manual_seed(0)
    # 8 × 128: min_8bit_size=0 gives every parameter 1-byte states
    return torch.nn.Sequential(torch.nn.Linear(128, 8), torch.nn.Tanh(), torch.nn.Linear(8, 128))


def _train(model, opt, steps=2):
    for step in range(steps):
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _snapshot(opt):
    return {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            for p, st in opt.state.items()}


def _same(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(
            torch.equal(a[i][k], b[i][k]) if torch.is_tensor(a[i][k]) else a[i][k] == b[i][k]
            for k in a[i]) for i in a)


def _expect_refused(opt, sd, match):
    before = _snapshot(opt)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                            for g in opt.param_groups])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert _same(before, _snapshot(opt))
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("saved,loaded", [("fp8", "int8"), ("int8", "fp8")])
def test_other_block_format_without_forge_entry_is_refused(saved, loaded):
    model = _model()
    opt = forge.optim.AdamW(model, state_format=saved, min_8bit_size=0)
    _train(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    del sd["forge"]
    other_model = copy.deepcopy(model)
    other = forge.optim.AdamW(other_model, state_format=loaded, min_8bit_size=0)
    _train(other_model, other, 1)  # (states of its own, which the refusal must leave)
    _expect_refused(other, sd, f"parameter '0.weight': saved with state_format='{saved}'")
    # the same optimizer kind loads it, bit for bit
    same = forge.optim.AdamW(copy.deepcopy(model), state_format=saved, min_8bit_size=0)
    same.load_state_dict(sd)
    again = same.state_dict()
    for index, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(value, again["state"][index][key]), key


def test_min_8bit_size_of_the_saved_groups_decides_without_forge_entry():
    """The saved group's min_8bit_size says which parameters had fp32 states: 8 × 128 = 1024
    elements is below 4096, so a default int8 optimizer kept fp32 states for all of them, and
    an int8 optimizer with min_8bit_size=0 (int8 for all) refuses that dict by name."""
    model = _model()
    opt = forge.optim.AdamW(model, state_format="int8")  # (min_8bit_size 4096: fp32 states)
    _train(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    del sd["forge"]
    other = forge.optim.AdamW(copy.deepcopy(model), state_format="int8", min_8bit_size=0)
    _expect_refused(other, sd, "saved with state_format='fp32'")
    forge.optim.AdamW(copy.deepcopy(model), state_format="int8").load_state_dict(sd)


@pytest.mark.parametrize("step", [2 ** 63 - 1, 2 ** 64, 2 ** 64 + 1, 10 ** 30,
                                  float(2 ** 70)])
@pytest.mark.parametrize("where", ["state", "step_id"])
def test_step_past_int64_is_refused(step, where):
    model = _model()
    opt = forge.optim.AdamW(model)
    _train(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    if where == "state":
        sd["state"][1]["step"] = step if not isinstance(step, float) else torch.tensor(step)
    else:
        sd["forge"]["step_id"] = step
    _expect_refused(opt, sd, "2\\*\\*63 - 2")


@pytest.mark.parametrize("norm", [-1.0, float("inf"), float("nan"), "1.0", True])
def test_bad_lagged_clip_norm_is_refused(norm):
    """The 'forge' entry's lagged_clip_norm sets immediate mode's next clip coefficient: a
    value no step saves (negative, not finite, not a number) is refused, nothing changed."""
    model = _model()
    opt = forge.optim.AdamW(model, mode="immediate", max_grad_norm=1.0)
    _train(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["forge"]["lagged_clip_norm"] > 0
    sd["forge"]["lagged_clip_norm"] = norm
    _expect_refused(opt, sd, "lagged_clip_norm")


def test_largest_step_loads_and_steps():
    model = _model()
    opt = forge.optim.AdamW(model)
    _train(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = 2 ** 63 - 2
    opt.load_state_dict(sd)
    _train(model, opt, 1)
    assert all(st["step"] == 2 ** 63 - 1 for st in opt.state.values())


@pytest.mark.parametrize("flag", ["amsgrad", "capturable", "differentiable"])
def test_torch_group_asking_for_what_forge_does_not_do_is_refused(flag):
    """An un-stepped torch.optim.AdamW dict has no state, only its groups: amsgrad=True there
    was loaded into the group and silently not done."""
    model = _model()
    kwargs = {flag: True}
    if flag == "capturable":
        kwargs["foreach"] = False
    sd = torch.optim.AdamW(copy.deepcopy(model).parameters(), **kwargs).state_dict()
    assert sd["state"] == {}
    opt = forge.optim.AdamW(model)
    _expect_refused(opt, sd, f"param group 0: {flag}=True")
    # the same dict with the flag off loads
    sd["param_groups"][0][flag] = False
    opt.load_state_dict(sd)


@pytest.mark.parametrize("state_format", ["int8", "fp8"])
def test_absmax_above_the_largest_bf16_is_refused(state_format):
    model = _model()
    opt = forge.optim.AdamW(model, state_format=state_format, min_8bit_size=0)
    _train(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["exp_avg_absmax"].view(-1)[0] = 3.4e38  # finite in fp32, above bf16's max
    _expect_refused(opt, sd, "state 'exp_avg_absmax' holds values above the largest bf16")


def test_nadam_without_mu_product_loads_promptly_at_a_large_step():
    model = _model()
    opt = forge.optim.NAdam(model, lr=1e-3, betas=(0.9999, 0.999))
    _train(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = 3 * 10 ** 6
        del st["mu_product"]
    start = time.perf_counter()
    opt.load_state_dict(sd)
    assert time.perf_counter() - start < PROMPT_LOAD_SECONDS
    product = opt.state[model[0].weight]["mu_product"]
    assert 0.0 <= product < 1e-30  # (0.9999^(3·10^6) underflows to 0 in fp32)
    _train(model, opt, 1)


def test_adagrad_accumulator_above_bf16_is_refused_by_name():
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        forge.optim.Adagrad(_model(), initial_accumulator_value=3.39e38, state_format="bf16")
    forge.optim.Adagrad(_model(), initial_accumulator_value=3.3e38, state_format="bf16")


@pytest.mark.parametrize("num_threads", [1025, 4096, True, -1, 1.5])
def test_num_threads_the_library_refuses_is_refused_at_construction(num_threads):
    """(found by test_state_props.py: 4096 was accepted here, and every step then failed in the
    library, which takes at most FORGE_MAX_CPU_THREADS = 1024)"""
    model = _model()
    with pytest.raises(ValueError, match="num_threads"):
        forge.optim.AdamW(model, num_threads=num_threads)
    opt = forge.optim.AdamW(model, num_threads=1024)  # (the model is free, the largest is fine)
    _train(model, opt, 1)


@pytest.mark.parametrize("max_grad_norm", [5e-324, 1e-45, 1e-39])
def test_max_grad_norm_whose_clip_underflows_is_refused_at_construction(max_grad_norm):
    """(found by test_state_props.py: 5e-324 was accepted here, is 0 in fp32, and every step's
    clip coefficient, hence its grad_scale, was 0, which the library refuses)"""
    model = _model()
    with pytest.raises(ValueError, match="max_grad_norm"):
        forge.optim.AdamW(model, max_grad_norm=max_grad_norm)
    opt = forge.optim.AdamW(model, max_grad_norm=2.0 ** -126)
    _train(model, opt, 1)
