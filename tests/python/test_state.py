"""test_state.py — state_dict / load_state_dict and observability.

Round trip is exact (raw int8 / fp8 / int4 codes + absmax, bf16 bits, fp32 master, 'step'); a
run resumed from a checkpoint is bit-for-bit the uninterrupted run. After step(): the global
grad norm (a by-product of the update kernels) equals clip_grad_norm_'s total norm of a
plain torch run, and non-finite gradient elements are counted and skipped.
"""
import copy
import io

import pytest
import torch

import forge
from forge.optim import checkpoint
from conftest import DEVICES, format_devices, requires_cuda
from tiny_models import TinyTransformer, lm_loss
from tolerances import GRAD_NORM_RTOL, NADAM_CROSSING_RTOL, STATE_STORE_RTOL

FORMATS = [("float32", "fp32", False), ("float32", "bf16", False), ("float32", "int8", False),
           ("bfloat16", "bf16", False), ("bfloat16", "int8", True), ("bfloat16", "fp32", True),
           ("float32", "fp8", False), ("bfloat16", "fp8", True), ("float32", "int4", False),
           ("bfloat16", "int4", True)]
# (dtype, state_format, master, device)
FORMATS_DEVICES = [(*f, "cpu") for f in FORMATS] + [
    pytest.param(*f, "cuda", marks=requires_cuda) for f in FORMATS]


def train(model, opt, steps, start, device):
    for step in range(start, start + steps):
        lm_loss(model, step, device).backward()
        opt.step()
        opt.zero_grad()


def resume_against_uninterrupted(make_model, make_opt, device, before=3, after=3,
                                 groups_only=False):
    """make_model()'s model trained `before` steps with make_opt(model), saved through torch.save /
    torch.load (a real checkpoint), then trained `after` more steps; and a fresh model and
    optimizer loaded from the checkpoint trained the same `after` steps. groups_only: the
    optimizer's dict saved without its 'forge' entry, as torch.distributed.checkpoint's
    get_optimizer_state_dict keeps it ('state' and 'param_groups'). Returns (model, opt,
    resumed, resumed_opt)."""
    model = make_model()
    opt = make_opt(model)
    train(model, opt, before, 0, device)
    buffer = io.BytesIO()
    sd = opt.state_dict()
    if groups_only:
        sd = {"state": sd["state"], "param_groups": sd["param_groups"]}
    torch.save({"model": model.state_dict(), "opt": sd}, buffer)
    train(model, opt, after, before, device)  # the uninterrupted run

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed = make_model()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = make_opt(resumed)
    resumed_opt.load_state_dict(checkpoint["opt"])
    train(resumed, resumed_opt, after, before, device)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    return model, opt, resumed, resumed_opt


@pytest.mark.parametrize("dtype,state_format,master,device", FORMATS_DEVICES)
def test_resume_is_bit_exact(dtype, state_format, master, device, deterministic):
    dtype = getattr(torch, dtype)
    # (min_8bit_size=0: int8 on every parameter of the tiny model, not only the large ones)
    options = dict(state_format=state_format, master_weights=master, seed=7, min_8bit_size=0)
    _, opt, _, opt2 = resume_against_uninterrupted(
        lambda: TinyTransformer().to(device=device, dtype=dtype),
        lambda m: forge.optim.AdamW(m, lr=1e-2, weight_decay=0.1, **options), device)
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    for index, state in sd["state"].items():
        for key, value in state.items():
            other = sd2["state"][index][key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and torch.equal(value, other), key
            else:
                assert value == other, key


def test_state_dict_hooks_run_as_on_torch_optim():
    """torch.optim's state-dict hooks on a forge optimizer, as on torch.optim.AdamW: a
    state_dict post-hook sees the whole dict (forge's entry too) and may replace it; a load
    pre-hook sees a copy and may rewrite it (here every group's lr); a load post-hook runs
    after the load."""
    for make in (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                 lambda m: forge.optim.AdamW(m, lr=1e-3)):
        model = TinyTransformer()
        opt = make(model)
        train(model, opt, 1, 0, "cpu")
        calls = []
        opt.register_state_dict_post_hook(lambda o, sd: dict(sd, seen=sorted(sd)))
        opt.register_load_state_dict_pre_hook(lambda o, sd: dict(sd, param_groups=[
            dict(g, lr=0.5) for g in sd["param_groups"]]))
        opt.register_load_state_dict_post_hook(lambda o: calls.append(o.param_groups[0]["lr"]))
        saved = opt.state_dict()
        forge_entry = ["forge"] if isinstance(opt, forge.optim.AdamW) else []
        assert saved["seen"] == sorted(["state", "param_groups"] + forge_entry)
        opt.load_state_dict(saved)
        assert calls == [0.5] and all(g["lr"] == 0.5 for g in opt.param_groups)
        assert all(g["lr"] == 1e-3 for g in saved["param_groups"])  # (the caller's dict)


@pytest.mark.parametrize("state_format", ["fp32", "bf16", "int8", "fp8", "int4"])
def test_state_dict_round_trip(state_format):
    model = TinyTransformer()
    opt = forge.optim.RMSprop(model, lr=1e-3, centered=True, momentum=0.9,
                              state_format=state_format, min_8bit_size=0)
    train(model, opt, 2, 0, "cpu")
    saved = copy.deepcopy(opt.state_dict())
    p = model.blocks[0].attn.q.weight
    expected = {"fp32": {"square_avg", "grad_avg", "momentum_buffer"},
                "bf16": {"square_avg", "grad_avg", "momentum_buffer"},
                "int8": {"square_avg", "grad_avg", "momentum_buffer", "square_avg_absmax",
                         "grad_avg_absmax", "momentum_buffer_absmax"}}
    expected["fp8"] = expected["int4"] = expected["int8"]
    expected = expected[state_format]
    assert set(opt.state[p]) == expected | {"step"}
    assert opt.state[p]["step"] == 2
    if state_format in ("int8", "fp8", "int4"):
        codes = opt.state[p]["square_avg"]
        assert codes.dtype == torch.uint8
        cols = p.shape[1] // 2 if state_format == "int4" else p.shape[1]
        assert codes.shape == (p.shape[0], cols)
        assert opt.state[p]["square_avg_absmax"].shape == (p.shape[0], -(-p.shape[1] // 64))

    other = forge.optim.RMSprop(copy.deepcopy(model), lr=1e-3, centered=True, momentum=0.9,
                                state_format=state_format, min_8bit_size=0)
    other.load_state_dict(saved)
    again = other.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    for index, state in saved["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(value, again["state"][index][key]), key
            else:
                assert value == again["state"][index][key]


def test_load_refuses_other_format_and_layout():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, state_format="int8")
    train(model, opt, 1, 0, "cpu")
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="state_format"):
        forge.optim.AdamW(copy.deepcopy(model)).load_state_dict(saved)
    with pytest.raises(ValueError, match="expected"):
        forge.optim.Lion(copy.deepcopy(model), state_format="int8").load_state_dict(saved)
    torch_model = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(torch_model.parameters())
    lm_loss(torch_model, 0).backward()
    torch_opt.step()
    with pytest.raises(ValueError, match="state_format differs"):  # fp32 states, int8 here
        forge.optim.AdamW(copy.deepcopy(model), state_format="int8").load_state_dict(
            torch_opt.state_dict())
    # torch.optim's own AdamW state (same rule, fp32 states) loads into fp32 forge states
    forge.optim.AdamW(copy.deepcopy(model)).load_state_dict(torch_opt.state_dict())


def _states_snapshot(opt):
    return {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            for p, st in opt.state.items()}


def _same_states(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(
            torch.equal(a[i][k], b[i][k]) if torch.is_tensor(a[i][k]) else a[i][k] == b[i][k]
            for k in a[i]) for i in a)


_CORRUPTIONS = ["step None", "step pair", "step -5", "step 1.5", "exp_avg_sq NaN",
                "exp_avg_sq negative", "absmax Inf", "step_id -1"]


@pytest.mark.parametrize("state_format,corrupt",
                         [(f, c) for f in ("fp32", "int8", "fp8") for c in _CORRUPTIONS] +
                         [("fp8", "code NaN"), ("fp8", "code negative")])
def test_load_is_all_or_nothing(state_format, corrupt):
    """A state dict with one bad value, in the last parameter's state: refused with a message
    naming it, and the optimizer keeps every state it had (nothing was cleared or loaded)."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, state_format=state_format, min_8bit_size=0)  # (int8: all)
    train(model, opt, 2, 0, "cpu")
    saved = copy.deepcopy(opt.state_dict())
    last = saved["state"][max(saved["state"])]
    what, how = corrupt.split(" ")
    if what == "step":
        last["step"] = {"None": None, "pair": torch.tensor([1, 2]), "-5": -5, "1.5": 1.5}[how]
    elif what == "step_id":
        saved["forge"]["step_id"] = -1
    elif what == "code":
        # fp8 codes no step stores: e4m3's NaN in a first moment, a negative e5m2 second
        # moment (int8 codes are any byte: nothing to corrupt there)
        if how == "NaN":
            last["exp_avg"].view(-1)[0] = 0x7F
        else:
            last["exp_avg_sq"].view(-1)[0] = 0x81
    else:
        # (int8 / fp8: the absmax is what can hold a bad float)
        key = "exp_avg_sq_absmax" if state_format in ("int8", "fp8") else "exp_avg_sq"
        t = last[key]
        t.view(-1)[0] = {"NaN": float("nan"), "negative": -1.0, "Inf": float("inf")}[how]
    before = _states_snapshot(opt)
    with pytest.raises(ValueError, match="load_state_dict"):
        opt.load_state_dict(saved)
    assert _same_states(before, _states_snapshot(opt))
    train(model, opt, 1, 2, "cpu")  # and it still trains


def test_replaced_state_tensor_of_the_wrong_shape_is_refused_before_any_update():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, mode="immediate")
    train(model, opt, 1, 0, "cpu")
    last = list(model.parameters())[-1]
    opt.state[last]["exp_avg"] = torch.zeros(3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="exp_avg"):
        lm_loss(model, 1).backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("groups_only", [False, True], ids=["whole", "groups-only"])
@pytest.mark.parametrize("mode", ["auto", "immediate", "deferred"])
def test_resume_with_max_grad_norm_is_bit_exact(mode, groups_only):
    """max_grad_norm in immediate mode clips a step with the previous step's norm: the
    checkpoint carries it, so the resumed run's first step clips as the uninterrupted run's
    does, not unclipped (auto, deferred here with max_grad_norm, and deferred clip exactly).
    groups-only: the dict as torch.distributed.checkpoint keeps it, without the 'forge'
    entry: its param groups carry the norm, the step count and auto's decision."""
    def make_model():
        torch.manual_seed(0)
        return TinyTransformer()
    # (max_grad_norm below every step's norm: every step clips)
    _, opt, _, opt2 = resume_against_uninterrupted(
        make_model, lambda m: forge.optim.AdamW(m, lr=1e-2, mode=mode, max_grad_norm=0.05),
        "cpu", after=2, groups_only=groups_only)
    assert opt2.grad_norm == opt.grad_norm
    assert opt2.mode == opt.mode
    # (what the groups carry is not a hyper-parameter: a live group's stays None)
    assert [g[checkpoint.GROUP_KEY] for g in opt2.param_groups] == [None] * len(opt2.param_groups)


def test_group_carried_values_of_a_dict_another_optimizer_stepped_on_say_nothing():
    """A forge dict loaded into torch.optim.AdamW keeps its groups' forge_run in torch's
    groups; once torch steps on, the values (the lagged clip norm among them) are stale: a
    forge optimizer loading torch's dict then reads none of them, as from a dict without
    them. Before torch steps, they still hold."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, state_format="fp32", mode="immediate",
                            max_grad_norm=0.05)
    train(model, opt, 2, 0, "cpu")
    sd = opt.state_dict()
    groups_only = {"state": sd["state"], "param_groups": sd["param_groups"]}
    carried = checkpoint.saved_entry(groups_only)
    assert carried["lagged_clip_norm"] == sd["forge"]["lagged_clip_norm"] is not None
    assert carried["step_id"] == sd["forge"]["step_id"] and "state_steps" not in carried
    plain = TinyTransformer()
    plain.load_state_dict(model.state_dict())
    other = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    other.load_state_dict(copy.deepcopy(groups_only))
    assert checkpoint.saved_entry(other.state_dict())["lagged_clip_norm"] == \
        sd["forge"]["lagged_clip_norm"]
    lm_loss(plain, 2).backward()
    other.step()
    assert checkpoint.saved_entry(other.state_dict()) == {}
    resumed = forge.optim.AdamW(plain, lr=1e-2, state_format="fp32", mode="immediate",
                                max_grad_norm=0.05)
    resumed.load_state_dict(other.state_dict())
    assert resumed.state_dict()["forge"]["lagged_clip_norm"] is None


def test_load_into_a_used_optimizer_resumes_exactly():
    """An optimizer that already stepped loads a checkpoint of an earlier step in which a
    parameter had no states yet: that parameter's next update makes and uses new states (none
    of the tensors it had before the load, which stay untouched)."""
    def two_layers():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)

    def step(model, opt, both=True):
        (model(x) if both else model[0](x)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    used, saved = two_layers(), two_layers()
    opt = forge.optim.AdamW(used, lr=1e-2, mode="immediate")
    for _ in range(2):
        step(used, opt)
    opt_saved = forge.optim.AdamW(saved, lr=1e-2, mode="immediate")
    step(saved, opt_saved, both=False)  # (the second layer: no gradient, no states yet)
    checkpoint = {"model": copy.deepcopy(saved.state_dict()), "opt": opt_saved.state_dict()}
    assert len(checkpoint["opt"]["state"]) == 2

    held = [t.clone() for t in opt.state[used[1].weight].values() if torch.is_tensor(t)]
    old = [t for t in opt.state[used[1].weight].values() if torch.is_tensor(t)]  # kept alive
    used.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    step(used, opt)

    fresh = two_layers()
    fresh.load_state_dict(checkpoint["model"])
    opt_fresh = forge.optim.AdamW(fresh, lr=1e-2, mode="immediate")
    opt_fresh.load_state_dict(checkpoint["opt"])
    step(fresh, opt_fresh)
    for (name, a), b in zip(used.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    assert all(torch.equal(a, b) for a, b in zip(old, held))


def test_frozen_parameter_in_params_is_never_stepped():
    """torch.optim accepts a parameter with requires_grad=False in its groups and leaves it
    alone; so does forge.optim (a frozen nn.Linear keeps its plain forward)."""
    model = TinyTransformer()
    model.blocks[0].up.weight.requires_grad_(False)
    frozen = model.blocks[0].up.weight.detach().clone()
    opt = forge.optim.AdamW(model, params=list(model.parameters()))
    train(model, opt, 3, 0, "cpu")
    assert torch.equal(frozen, model.blocks[0].up.weight)


def test_frozen_parameter_of_any_dtype_is_accepted_and_never_stepped():
    """A frozen parameter FORGE could not update (a quantized layer's uint8 storage, an fp16
    copy) is accepted in params= as torch.optim accepts it, and never stepped; one unfrozen
    later and given a gradient is refused at step(), naming it, before any weight changes."""
    model = TinyTransformer()
    model.codes = torch.nn.Parameter(torch.arange(6, dtype=torch.uint8), requires_grad=False)
    model.half_copy = torch.nn.Parameter(torch.ones(3, dtype=torch.float16), requires_grad=False)
    codes, before = model.codes.detach().clone(), model.half_copy.detach().clone()
    opt = forge.optim.AdamW(model, params=list(model.parameters()), mode="deferred")
    train(model, opt, 2, 0, "cpu")
    assert torch.equal(model.codes, codes) and torch.equal(model.half_copy, before)
    assert model.codes not in opt.state and model.half_copy not in opt.state
    model.half_copy.requires_grad_(True)
    lm_loss(model, 2).backward()
    model.half_copy.grad = torch.ones_like(model.half_copy)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"'half_copy' \(torch.float16\) got a gradient"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))


@pytest.mark.parametrize("device", DEVICES)
def test_grad_norm_matches_clip_grad_norm(device):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    plain = copy.deepcopy(model)
    opt = forge.optim.AdamW(model, lr=1e-3)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    assert opt.grad_norm is None
    for step in range(4):
        lm_loss(model, step, device).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(plain, step, device).backward()
        total = torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf")).item()
        ref.step()
        ref.zero_grad()
        assert opt.grad_norm == pytest.approx(total, rel=GRAD_NORM_RTOL)
        assert opt.nonfinite_count == 0


def test_nonfinite_gradients_are_counted_and_skipped():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = forge.optim.SGD(model, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 4)
    x[2, 1] = float("nan")  # poisons column 1 of the first weight's dW, and more
    model(x).sum().backward()
    opt.step()
    assert opt.nonfinite_count > 0
    for a, b in zip(before, model.parameters()):
        assert torch.isfinite(b).all(), "a NaN never reaches a weight"
    w0 = model[0].weight
    assert torch.equal(w0[:, 1], before[0][:, 1]), "skipped elements are left as they were"


@pytest.mark.parametrize("state_format,device",
                         format_devices(["fp32", "bf16", "int8", "fp8", "int4"]))
def test_state_fp32_decodes_states(state_format, device):
    """state_fp32() decodes through libforge; against an fp32-state run of the same step
    (bounds: STATE_STORE_RTOL)."""
    torch.manual_seed(0)
    base = TinyTransformer().to(device)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = forge.optim.AdamW(model, state_format=state_format)
    ref_opt = forge.optim.AdamW(ref)
    for m, o in ((model, opt), (ref, ref_opt)):
        lm_loss(m, 0, device).backward()
        o.step()
    p, q = model.blocks[0].up.weight, ref.blocks[0].up.weight
    got, want = opt.state_fp32(p), ref_opt.state_fp32(q)
    assert set(got) == {"exp_avg", "exp_avg_sq"}
    for key in got:
        assert torch.equal(want[key], ref_opt.state[q][key])
        err = ((got[key] - want[key]).abs().max() / want[key].abs().max()).item()
        rtol = STATE_STORE_RTOL[state_format]
        assert err <= (rtol[key] if isinstance(rtol, dict) else rtol), (key, err)


# ----------------------------------------------------------------- state format per parameter

def _formats(opt, model):
    """{name: the format of its stored states} read from the tensors themselves."""
    dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}
    return {n: dtypes[opt.state[p]["exp_avg"].dtype] for n, p in model.named_parameters()
            if p in opt.state}


def test_min_8bit_size_keeps_small_parameters_fp32():
    """state_format="int8": a parameter of fewer than min_8bit_size elements (default 4096,
    bitsandbytes') keeps fp32 states; 0 makes every parameter int8."""
    for min_size in (None, 0, 10 ** 9):
        model = TinyTransformer()
        kwargs = {} if min_size is None else {"min_8bit_size": min_size}
        opt = forge.optim.AdamW(model, state_format="int8", **kwargs)
        train(model, opt, 1, 0, "cpu")
        threshold = 4096 if min_size is None else min_size
        want = {n: "int8" if p.numel() >= threshold else "fp32"
                for n, p in model.named_parameters()}
        assert _formats(opt, model) == want, min_size
        if min_size is None:  # the MLP weights (32 x 128) are int8, the rest fp32
            assert sorted(n for n, f in want.items() if f == "int8") == [
                "blocks.0.down.weight", "blocks.0.up.weight", "blocks.1.down.weight",
                "blocks.1.up.weight"]


def _groups(model, small_format="fp32", **big):
    """Two param groups: the MLP weights (4096 elements each) int8, everything else
    `small_format`."""
    mlp = [p for n, p in model.named_parameters() if n.endswith(("up.weight", "down.weight"))]
    rest = [p for n, p in model.named_parameters() if not n.endswith(("up.weight",
                                                                      "down.weight"))]
    return [dict({"params": mlp, "state_format": "int8"}, **big),
            {"params": rest, "state_format": small_format}]


def test_per_group_state_format_equals_separate_optimizers():
    """A group's "state_format" is that group's: one optimizer with an int8 and a bf16 group
    gives the bits two optimizers, one per format over the same parameters, give (bf16
    stores round to nearest here: stochastic rounding draws from seed + parameter index,
    and the indices differ between one optimizer and two)."""
    torch.manual_seed(0)
    base = TinyTransformer()
    mixed, split = copy.deepcopy(base), copy.deepcopy(base)
    opt = forge.optim.AdamW(mixed, lr=1e-2, params=_groups(mixed, "bf16"),
                            stochastic_rounding=False)
    groups = _groups(split, "bf16")
    opts = [forge.optim.AdamW(split, lr=1e-2, params=g["params"], stochastic_rounding=False,
                              state_format=g["state_format"]) for g in groups]
    for step in range(4):
        lm_loss(mixed, step).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(split, step).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    formats = _formats(opt, mixed)
    assert formats["blocks.0.up.weight"] == "int8" and formats["head.weight"] == "bf16"
    assert set(formats.values()) == {"int8", "bf16"}
    for (name, a), b in zip(mixed.named_parameters(), split.parameters()):
        assert torch.equal(a, b), name
    assert "bf16" in opt.summary() and "int8" in opt.summary()


@pytest.mark.parametrize("change", ["state_format", "min_8bit_size"])
def test_state_format_is_fixed_once_states_exist(change):
    """Before the first step a group's format may change; after, a change is refused at the
    next step, before any weight changes, naming the parameter."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, params=_groups(model), mode="immediate")
    opt.param_groups[1]["state_format"] = "bf16"  # no states yet: taken
    train(model, opt, 1, 0, "cpu")
    assert _formats(opt, model)["head.weight"] == "bf16"
    if change == "state_format":
        opt.param_groups[0]["state_format"] = "fp32"
    else:
        opt.param_groups[0]["min_8bit_size"] = 10 ** 6  # the int8 group's weights: fp32 now
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"blocks\.0\.up\.weight.*fixed once"):
        lm_loss(model, 1).backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.param_groups[0].update(state_format="int8", min_8bit_size=4096)  # restored: it runs
    opt.zero_grad()
    train(model, opt, 1, 2, "cpu")


def test_bad_group_storage_options_are_refused():
    model = TinyTransformer()
    with pytest.raises(ValueError, match=r"param group 1: state_format: unknown value 'int3'"):
        forge.optim.AdamW(model, params=_groups(model, "int3"))
    with pytest.raises(ValueError, match=r"param group 0: min_8bit_size: must be an int >= 0"):
        forge.optim.AdamW(model, params=_groups(model, min_8bit_size=-1))
    with pytest.raises(ValueError, match=r"^min_8bit_size: must be an int >= 0, got True"):
        forge.optim.AdamW(model, min_8bit_size=True)
    opt = forge.optim.AdamW(model)
    with pytest.raises(ValueError, match=r"param group 1: state_format"):
        opt.add_param_group({"params": [], "state_format": "fp4"})
    assert len(opt.param_groups) == 1


def test_mixed_formats_round_trip_and_resume_bit_exact():
    """state_dict() records each parameter's format ('forge': state_formats); a resumed run
    is the uninterrupted one bit for bit; an optimizer whose groups ask for other formats is
    refused, naming the parameter, and keeps what it had."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, params=_groups(model, "bf16"), seed=5)
    train(model, opt, 3, 0, "cpu")
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train(model, opt, 2, 3, "cpu")

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    saved = checkpoint["opt"]
    assert saved["forge"]["format_version"] == 3
    assert sorted(set(saved["forge"]["state_formats"].values())) == ["bf16", "int8"]
    resumed = TinyTransformer()
    resumed.load_state_dict(checkpoint["model"])
    other = forge.optim.AdamW(resumed, lr=1e-2, params=_groups(resumed, "fp32"), seed=5)
    train_once = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"parameter '[a-z0-9.]+': saved with "
                                         r"state_format='bf16', this optimizer keeps 'fp32'"):
        other.load_state_dict(saved)
    assert other.state_dict()["state"] == train_once["state"] == {}, "nothing was loaded"
    other.detach()  # (gives the model back for the next optimizer)
    opt2 = forge.optim.AdamW(resumed, lr=1e-2, params=_groups(resumed, "bf16"), seed=5)
    opt2.load_state_dict(saved)
    train(resumed, opt2, 2, 3, "cpu")
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert _formats(opt2, resumed) == _formats(opt, model)


def test_version_1_state_dict_loads_with_min_8bit_size_0():
    """A state dict from before per-parameter formats (format_version 1: one state_format,
    int8 on every parameter) loads where min_8bit_size=0 asks for that, and is refused with
    the way out where min_8bit_size would keep small parameters fp32."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, state_format="int8", min_8bit_size=0)
    train(model, opt, 1, 0, "cpu")
    saved = opt.state_dict()
    saved["forge"] = {k: v for k, v in saved["forge"].items() if k != "state_formats"}
    saved["forge"]["format_version"] = 1
    with pytest.raises(ValueError, match=r"saved with state_format='int8'.*min_8bit_size=0"):
        forge.optim.AdamW(copy.deepcopy(model), state_format="int8").load_state_dict(saved)
    copied = copy.deepcopy(model)
    again = forge.optim.AdamW(copied, state_format="int8", min_8bit_size=0)
    again.load_state_dict(saved)
    assert set(_formats(again, copied).values()) == {"int8"}


def _nadam_run(make_opt, model, steps, start=0):
    """`steps` NAdam steps of a two-layer model under a beta1 that changes every step."""
    opt = make_opt(model)
    for step in range(start, start + steps):
        opt.param_groups[0]["betas"] = (0.6 + 0.07 * (step % 5), 0.999)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _two_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


@pytest.mark.parametrize("saved_by", ["torch", "forge"])
def test_nadam_state_dict_crosses_to_and_from_torch(saved_by):
    """NAdam's state holds 'mu_product' as torch.optim.NAdam's does (the running product of
    its momentum factors, bit for bit torch's fp32 value), so a checkpoint of either loads
    into the other and the run goes on as torch's would, under a changing beta1 too."""
    nadam = dict(lr=1e-2, weight_decay=0.1)

    def torch_nadam(model):
        return torch.optim.NAdam(model.parameters(), **nadam)

    def forge_nadam(model):
        return forge.optim.NAdam(model, **nadam)

    first, then = (torch_nadam, forge_nadam) if saved_by == "torch" else (forge_nadam, torch_nadam)
    reference = _two_layers()
    torch_opt = _nadam_run(torch_nadam, reference, 3)
    saved = _two_layers()
    saved_opt = _nadam_run(first, saved, 3)
    for p, q in zip(saved_opt.param_groups[0]["params"], torch_opt.param_groups[0]["params"]):
        assert float(saved_opt.state[p]["mu_product"]) == float(torch_opt.state[q]["mu_product"])
    checkpoint = copy.deepcopy({"model": saved.state_dict(), "opt": saved_opt.state_dict()})
    resumed = _two_layers()
    resumed.load_state_dict(checkpoint["model"])
    opt = then(resumed)
    opt.load_state_dict(checkpoint["opt"])
    # (the loaded optimizer goes on: its own steps 3..5, as the reference's)
    for step in range(3, 6):
        for o, m in ((opt, resumed), (torch_opt, reference)):
            o.param_groups[0]["betas"] = (0.6 + 0.07 * (step % 5), 0.999)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for (name, a), b in zip(resumed.named_parameters(), reference.parameters()):
        assert (a - b).abs().max() <= NADAM_CROSSING_RTOL * b.abs().max(), name


def test_nadam_state_dict_mu_product_checked_or_derived():
    """A NAdam state without 'mu_product' (written before forge kept one) loads with the
    product a constant beta1 gives; one outside [0, 1] is refused by name, nothing loaded."""
    model = _two_layers()
    opt = forge.optim.NAdam(model, lr=1e-2)
    for step in range(3):
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    kept = opt.state[model[0].weight]["mu_product"]
    for st in sd["state"].values():
        del st["mu_product"]
    opt.load_state_dict(sd)
    assert opt.state[model[0].weight]["mu_product"] == kept  # (beta1 was constant)
    bad = copy.deepcopy(sd)
    bad["state"][0]["mu_product"] = torch.tensor(1.5)
    before = {k: (v.clone() if torch.is_tensor(v) else v)
              for k, v in opt.state[model[0].weight].items()}
    with pytest.raises(ValueError, match="parameter '0.weight': state 'mu_product' must be"):
        opt.load_state_dict(bad)
    after = opt.state[model[0].weight]
    assert all(torch.equal(v, after[k]) if torch.is_tensor(v) else v == after[k]
               for k, v in before.items())


TORCH_RULES = [("SGD", dict(lr=0.1)), ("SGD", dict(lr=0.1, momentum=0.9)),
               ("AdamW", dict(lr=1e-2)), ("Adam", dict(lr=1e-2, weight_decay=0.1)),
               ("NAdam", dict(lr=1e-2)), ("RAdam", dict(lr=1e-2)),
               ("RMSprop", dict(lr=1e-2, momentum=0.9, centered=True)),
               ("Adagrad", dict(lr=1e-2, lr_decay=0.01))]


@pytest.mark.parametrize("saved_by", ["torch", "forge"])
@pytest.mark.parametrize("rule", TORCH_RULES,
                         ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in TORCH_RULES])
def test_checkpoints_cross_between_torch_and_forge(rule, saved_by):
    """A checkpoint of torch.optim.<Rule> loads into forge.optim.<Rule> and one of forge's
    into torch's (fp32 states: torch's layout, names and counters; torch.optim.SGD keeps no
    'step'), and the next step from it is the step the saving kind would take from it."""
    from tolerances import CONTRACT_RTOL
    name, kwargs = rule
    kinds = {"torch": lambda m: getattr(torch.optim, name)(m.parameters(), **kwargs),
             "forge": lambda m: getattr(forge.optim, name)(m, **kwargs)}
    loaded_by = "forge" if saved_by == "torch" else "torch"
    model = _two_layers()
    opt = kinds[saved_by](model)
    for step in range(3):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum() \
            .backward()
        opt.step()
        opt.zero_grad()
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed = {}
    for kind in (saved_by, loaded_by):
        resumed[kind] = _two_layers()
        resumed[kind].load_state_dict(checkpoint["model"])
        o = kinds[kind](resumed[kind])
        o.load_state_dict(copy.deepcopy(checkpoint["opt"]))  # (torch's steps its tensors)
        resumed[kind](torch.randn(4, 8, generator=torch.Generator().manual_seed(3))).square() \
            .sum().backward()
        o.step()
    for (p_name, a), b in zip(resumed[loaded_by].named_parameters(),
                              resumed[saved_by].parameters()):
        assert (a - b).abs().max() <= CONTRACT_RTOL * b.abs().max(), p_name
