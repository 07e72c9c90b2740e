"""test_state_props.py — property-based tests (Hypothesis) of state_dict / load_state_dict and of
the constructors' arguments at their edges: every case either round-trips bit for bit or is
refused, changing nothing.

- Round trip: any rule, state format (fp32, bf16, int8, fp8; min_8bit_size 0 or 4096), weight
  dtype, master weights, stochastic rounding and mode, after 0-3 steps: a new optimizer that
  loads the dict gives it back bit for bit, and its next step is the saver's next step.
- Foreign dicts: another rule's or format's (forge's, with or without its 'forge' entry, which
  a generic checkpoint tool may drop) or torch.optim's, stepped or not, loaded into any forge
  optimizer that may hold states: refused with the optimizer unchanged (states, groups, step
  count), or loaded so that every state decodes to what the saver's decoded to.
- Dicts holding what no step stores (NaN, infinities, values above the largest bf16, negative
  second moments or absmax, fp8 NaN codes, step counts past int64, a 'mu_product' outside
  [0, 1], a group asking for amsgrad / capturable / differentiable): always refused, nothing
  changed.
- Constructor arguments at their edges (0, -0, subnormals, 1e38, 1e39, inf, NaN, negative,
  bools where numbers go, huge ints): refused by a ValueError or TypeError that leaves the model
  as it was (and free for another optimizer), or accepted, and then a step keeps every weight
  finite and the state dict round-trips.

Each run draws new examples (Hypothesis' random seed; nothing is stored between runs): a failure
prints its example and a @reproduce_failure blob, and `pytest --hypothesis-seed=N` replays a
run. The budget (max_examples per property) keeps the file at a few tens of seconds on a 2-core
CPU. Skipped where hypothesis is not installed (the torch-2.4 run installs only torch, numpy and
pytest).
"""
import copy
import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import forge  # noqa: E402

SETTINGS = dict(deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BF16_MAX = float.fromhex("0x1.FEp127")

# ---- configurations --------------------------------------------------------------------------

# Each rule's torch.optim keyword arguments, drawn around their defaults.
RULE_KWARGS = {
    "AdamW": lambda d: dict(lr=d(st.sampled_from([1e-3, 1e-2])), weight_decay=d(st.sampled_from([0.0, 0.1])),
                            betas=d(st.sampled_from([(0.9, 0.999), (0.5, 0.9)]))),
    "Adam": lambda d: dict(lr=d(st.sampled_from([1e-3, 1e-2])), weight_decay=d(st.sampled_from([0.0, 0.1]))),
    "NAdam": lambda d: dict(lr=d(st.sampled_from([2e-3, 1e-2])),
                            decoupled_weight_decay=d(st.booleans()),
                            betas=d(st.sampled_from([(0.9, 0.999), (0.99, 0.999)]))),
    "RAdam": lambda d: dict(lr=d(st.sampled_from([1e-3, 1e-2])), weight_decay=d(st.sampled_from([0.0, 0.1]))),
    "Lion": lambda d: dict(lr=d(st.sampled_from([1e-4, 1e-3])), weight_decay=d(st.sampled_from([0.0, 0.1]))),
    "RMSprop": lambda d: dict(lr=d(st.sampled_from([1e-3, 1e-2])), centered=d(st.booleans()),
                              momentum=d(st.sampled_from([0.0, 0.9]))),
    "Adagrad": lambda d: dict(lr=d(st.sampled_from([1e-2, 1e-1])), lr_decay=d(st.sampled_from([0.0, 0.01])),
                              initial_accumulator_value=d(st.sampled_from([0.0, 0.1]))),
    "SGD": lambda d: dict(lr=d(st.sampled_from([1e-2, 0.1])), momentum=d(st.sampled_from([0.0, 0.9])),
                          weight_decay=d(st.sampled_from([0.0, 0.01]))),
}
TORCH_RULES = [r for r in RULE_KWARGS if r != "Lion"]


def draw_config(draw, rules=tuple(RULE_KWARGS)):
    rule = draw(st.sampled_from(sorted(rules)))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return dict(rule=rule, kwargs=RULE_KWARGS[rule](draw), dtype=dtype,
                state_format=draw(st.sampled_from(["fp32", "bf16", "int8", "fp8"])),
                min_8bit_size=draw(st.sampled_from([0, 4096])),
                master_weights=dtype == "bfloat16" and draw(st.booleans()),
                stochastic_rounding=draw(st.booleans()),
                mode=draw(st.sampled_from(["auto", "immediate", "deferred"])),
                steps=draw(st.integers(0, 3)))


def make_model(dtype: str) -> torch.nn.Module:
    """Two Linear layers (fused weights, element-wise biases) and a bare parameter; 64 columns
    make whole int8 / fp8 blocks, 16 a partial one. The same weights for every call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 64))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(64)))
    return model.to(getattr(torch, dtype))


def loss_of(model, step: int) -> torch.Tensor:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1000 + step))
    x = x.to(next(model.parameters()).dtype)
    return (model(x) * model.scale).float().square().mean()


def train(model, opt, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


def forge_optimizer(model, config):
    return getattr(forge.optim, config["rule"])(
        model, **config["kwargs"], state_format=config["state_format"],
        min_8bit_size=config["min_8bit_size"], master_weights=config["master_weights"],
        stochastic_rounding=config["stochastic_rounding"], mode=config["mode"], seed=3)


def torch_optimizer(model, config, **extra):
    kwargs = dict(config["kwargs"], **extra)
    return getattr(torch.optim, config["rule"])(model.parameters(), **kwargs)


# ---- comparing -------------------------------------------------------------------------------

def snapshot(opt):
    """Everything load_state_dict may change: states, groups (their keys and values), step
    count."""
    states = {id(p): {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in s.items()}
              for p, s in opt.state.items()}
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return states, groups, getattr(opt, "_step_id", None)


def same_value(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.numel() else a,
                                               b.view(torch.uint8) if b.numel() else b)
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def same_snapshot(a, b) -> bool:
    (sa, ga, ia), (sb, gb, ib) = a, b
    return ia == ib and ga == gb and sa.keys() == sb.keys() and all(
        sa[p].keys() == sb[p].keys() and all(same_value(sa[p][k], sb[p][k]) for k in sa[p]) for p in sa)


def same_state_dict(a, b) -> bool:
    """Bit for bit: every state tensor (dtype and bytes), every counter, the groups."""
    if a["param_groups"] != b["param_groups"] or a.get("forge") != b.get("forge"):
        return False
    if a["state"].keys() != b["state"].keys():
        return False
    return all(a["state"][i].keys() == b["state"][i].keys() and
               all(same_value(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])
               for i in a["state"])


def decoded_states(opt, model):
    """{parameter index: {state name: fp32 tensor}}: forge's through state_fp32, torch's as
    they are (its states are of the parameter's dtype)."""
    out = {}
    for i, p in enumerate(model.parameters()):
        if hasattr(opt, "state_fp32"):  # a forge optimizer
            out[i] = {k: v.float() for k, v in opt.state_fp32(p).items()}
        else:
            out[i] = {k: v.float() for k, v in opt.state.get(p, {}).items()
                      if torch.is_tensor(v) and v.shape == p.shape}
    return out


def expect_refused_unchanged(opt, model, sd):
    before = snapshot(opt)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((ValueError, TypeError)):
        opt.load_state_dict(sd)
    assert same_snapshot(before, snapshot(opt)), "a refused load changed the optimizer"
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


# ---- round trip ----------------------------------------------------------------------------------

@settings(max_examples=30, **SETTINGS)
@given(st.data())
def test_state_dict_round_trips_and_resumes_bit_exactly(data):
    config = draw_config(data.draw)
    model = make_model(config["dtype"])
    opt = forge_optimizer(model, config)
    train(model, opt, 0, config["steps"])
    sd = copy.deepcopy(opt.state_dict())
    resumed = copy.deepcopy(model)
    other = forge_optimizer(resumed, config)
    other.load_state_dict(copy.deepcopy(sd))
    assert same_state_dict(sd, other.state_dict())
    train(model, opt, config["steps"], 1)
    train(resumed, other, config["steps"], 1)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert same_state_dict(opt.state_dict(), other.state_dict())


# ---- foreign dicts -------------------------------------------------------------------------------

def foreign_dict(draw):
    """(state dict, saver, saver's model, saver's configuration): a forge optimizer's of any
    configuration (its 'forge' entry kept or dropped), or torch.optim's (stepped or not)."""
    kind = draw(st.sampled_from(["forge", "forge-stripped", "torch"]))
    if kind == "torch":
        config = draw_config(draw, TORCH_RULES)
        config.update(dtype="float32", state_format="fp32", master_weights=False)
        model = make_model("float32")
        saver = torch_optimizer(model, config)
    else:
        config = draw_config(draw)
        model = make_model(config["dtype"])
        saver = forge_optimizer(model, config)
    train(model, saver, 0, config["steps"])
    sd = copy.deepcopy(saver.state_dict())
    if kind == "forge-stripped":
        del sd["forge"]
    return sd, saver, model, config


def neighbour(draw, config):
    """The saver's configuration with one thing changed (where a wrong load is likeliest to
    look right): the rule, the state format, min_8bit_size, the master weights, the step."""
    other = copy.deepcopy(config)
    what = draw(st.sampled_from(["rule", "state_format", "min_8bit_size", "master_weights", "steps"]))
    if what == "rule":
        other["rule"] = draw(st.sampled_from(sorted(RULE_KWARGS)))
        other["kwargs"] = RULE_KWARGS[other["rule"]](draw)
    elif what == "state_format":
        other["state_format"] = draw(st.sampled_from(["fp32", "bf16", "int8", "fp8"]))
    elif what == "min_8bit_size":
        other["min_8bit_size"] = 4096 - other["min_8bit_size"]
    elif what == "master_weights":
        other["master_weights"] = other["dtype"] == "bfloat16" and not other["master_weights"]
    else:
        other["steps"] = draw(st.integers(0, 3))
    return other


@settings(max_examples=50, **SETTINGS)
@given(st.data())
def test_foreign_dicts_load_exactly_or_are_refused(data):
    sd, saver, saver_model, saver_config = foreign_dict(data.draw)
    config = neighbour(data.draw, saver_config) if data.draw(st.booleans()) else draw_config(data.draw)
    model = make_model(config["dtype"])
    opt = forge_optimizer(model, config)
    train(model, opt, 0, config["steps"])
    before = snapshot(opt)
    try:
        opt.load_state_dict(copy.deepcopy(sd))
    except (ValueError, TypeError):
        assert same_snapshot(before, snapshot(opt)), "a refused load changed the optimizer"
        train(model, opt, config["steps"], 1)  # and it still steps
        return
    # Accepted: every state the dict holds came in as it was, and decodes as it did for the saver.
    want, got = decoded_states(saver, saver_model), decoded_states(opt, model)
    for i, states in want.items():
        for name, value in states.items():
            if name in got.get(i, {}):
                assert torch.equal(got[i][name], value), (i, name)
    loaded = opt.state_dict()
    for i, state in sd["state"].items():
        for key, value in state.items():
            mine = loaded["state"][i].get(key)
            if torch.is_tensor(value) and value.numel() > 1:
                assert mine is not None and torch.equal(mine, value), (i, key)
            elif key == "step":
                assert int(mine) == int(value)
    train(model, opt, config["steps"], 1)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ---- what no step stores ---------------------------------------------------------------------------

CORRUPTIONS = ["state NaN", "state inf", "state above bf16", "second moment negative",
               "absmax NaN", "absmax negative", "absmax above bf16", "fp8 code NaN",
               "step 2**64", "step -1", "step 2**63", "step 1.5", "step_id 2**64",
               "mu_product 1.5", "mu_product NaN", "amsgrad", "capturable", "differentiable",
               "state wrong dtype", "state wrong shape", "state missing", "unknown index"]


def corrupt(sd, how, rng):
    """Applies `how` to a forge or torch state dict; False where it does not apply."""
    states = [s for s in sd["state"].values() if any(torch.is_tensor(v) and v.numel() > 1 for v in s.values())]
    group = sd["param_groups"][0]
    if how in ("amsgrad", "capturable", "differentiable"):
        group[how] = True
        return True
    if how.startswith("step_id"):
        if "forge" not in sd:
            return False
        sd["forge"]["step_id"] = 2 ** 64
        return True
    if how == "unknown index":
        sd["state"][10 ** 6] = copy.deepcopy(next(iter(sd["state"].values()), {"step": 1}))
        return True
    if not states:
        return False
    st_ = states[rng.randrange(len(states))]
    if how.startswith("step"):
        st_["step"] = {"step 2**64": 2 ** 64, "step -1": -1, "step 2**63": 2 ** 63, "step 1.5": 1.5}[how]
        return True
    if how.startswith("mu_product"):
        if "mu_product" not in st_:
            return False
        st_["mu_product"] = 1.5 if how.endswith("1.5") else float("nan")
        return True
    tensors = {k: v for k, v in st_.items() if torch.is_tensor(v) and v.numel() > 1}
    absmax = {k: v for k, v in tensors.items() if k.endswith("_absmax")}
    codes = {k: v for k, v in tensors.items() if v.dtype == torch.uint8}
    floats = {k: v for k, v in tensors.items() if v.is_floating_point() and not k.endswith("_absmax")
              and k != "master"}
    if how.startswith("absmax"):
        if not absmax:
            return False
        t = absmax[rng.choice(sorted(absmax))]
        t.view(-1)[rng.randrange(t.numel())] = {"absmax NaN": float("nan"), "absmax negative": -1.0,
                                                "absmax above bf16": 3.4e38}[how]
        return True
    if how == "fp8 code NaN":
        signed = [k for k in codes if k in ("exp_avg", "momentum_buffer", "grad_avg")]
        if not signed or "forge" not in sd or sd["forge"].get("state_format") != "fp8":
            return False
        t = codes[signed[0]]
        t.view(-1)[rng.randrange(t.numel())] = 0x7F
        return True
    if how == "second moment negative":
        second = [k for k in floats if k in ("exp_avg_sq", "square_avg", "sum")]
        if not second:
            return False
        floats[second[0]].view(-1)[0] = -1.0
        return True
    if how.startswith("state "):
        if how in ("state wrong dtype", "state wrong shape", "state missing"):
            key = rng.choice(sorted(tensors))
            if how == "state missing":
                del st_[key]
            elif how == "state wrong dtype":
                st_[key] = st_[key].double()
            else:
                st_[key] = st_[key].reshape(-1)[:-1].clone()
            return True
        if not floats:
            return False
        t = floats[rng.choice(sorted(floats))]
        value = {"state NaN": float("nan"), "state inf": float("inf"), "state above bf16": 3.4e38}[how]
        if t.dtype == torch.bfloat16 and how == "state above bf16":
            return False  # (bf16 holds nothing above its largest value)
        t.view(-1)[rng.randrange(t.numel())] = value
        return True
    return False


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_what_no_step_stores_is_refused_and_changes_nothing(data):
    import random
    config = draw_config(data.draw)
    config["steps"] = data.draw(st.integers(1, 2))
    source = data.draw(st.sampled_from(["forge", "torch"] if config["rule"] != "Lion" else ["forge"]))
    how = data.draw(st.sampled_from(CORRUPTIONS))
    rng = random.Random(data.draw(st.integers(0, 2 ** 32)))
    if source == "torch":
        config.update(dtype="float32", state_format="fp32", master_weights=False)
        saver_model = make_model("float32")
        saver = torch_optimizer(saver_model, config)
    else:
        saver_model = make_model(config["dtype"])
        saver = forge_optimizer(saver_model, config)
    train(saver_model, saver, 0, config["steps"])
    sd = copy.deepcopy(saver.state_dict())
    hypothesis.assume(corrupt(sd, how, rng))
    model = copy.deepcopy(saver_model)
    opt = forge_optimizer(model, config)
    train(model, opt, 0, data.draw(st.integers(0, 1)))
    expect_refused_unchanged(opt, model, sd)


# ---- constructor arguments at their edges ----------------------------------------------------------

EDGE_NUMBERS = [0.0, -0.0, 5e-324, 1e-45, 1e-38, 1e-8, 0.5, 0.999, 1.0 - 1e-16, 1.0, 2.0, 1e38,
                3.3e38, 3.39e38, 3.4e38, 1e39, float("inf"), -float("inf"), float("nan"), -1.0,
                -1e-8, True, False, 2 ** 70, -(2 ** 70), "0.1", None]
CTOR_KEYS = {"lr", "weight_decay", "eps", "betas", "momentum", "dampening", "alpha", "lr_decay",
             "initial_accumulator_value", "momentum_decay", "nesterov", "centered", "maximize",
             "decoupled_weight_decay", "state_format", "min_8bit_size", "seed", "num_threads",
             "max_grad_norm", "mode", "master_weights", "stochastic_rounding", "amsgrad"}


def accepts(rule: str, key: str) -> bool:
    import inspect
    cls = getattr(forge.optim, rule)
    params = inspect.signature(cls.__init__).parameters
    return key in params or key in ("state_format", "min_8bit_size", "seed", "num_threads",
                                    "max_grad_norm", "mode", "master_weights",
                                    "stochastic_rounding")


@settings(max_examples=60, **SETTINGS)
@given(st.data())
def test_constructor_edges_are_refused_cleanly_or_train_finitely(data):
    rule = data.draw(st.sampled_from(sorted(RULE_KWARGS)))
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    keys = [k for k in sorted(CTOR_KEYS) if accepts(rule, k)]
    kwargs = {}
    for key in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        if key == "betas":
            kwargs[key] = (data.draw(st.sampled_from(EDGE_NUMBERS)), data.draw(st.sampled_from([0.999] + EDGE_NUMBERS)))
        elif key == "state_format":
            kwargs[key] = data.draw(st.sampled_from(["fp32", "bf16", "int8", "fp8", "int4", "", None, 8]))
        elif key == "mode":
            kwargs[key] = data.draw(st.sampled_from(["auto", "immediate", "deferred", "eager", None]))
        elif key in ("seed", "num_threads", "min_8bit_size"):
            kwargs[key] = data.draw(st.sampled_from([0, 1, 2 ** 63 - 1, 2 ** 63, -1, True, 1.5, 4096]))
        else:
            kwargs[key] = data.draw(st.sampled_from(EDGE_NUMBERS))
    model = make_model(dtype)
    weights = [p.detach().clone() for p in model.parameters()]
    try:
        opt = getattr(forge.optim, rule)(model, **kwargs)
    except (ValueError, TypeError):
        # refused: the model is as it was and no forge optimizer holds it
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        another = forge.optim.SGD(model, lr=0.1)
        train(model, another, 0, 1)
        return
    train(model, opt, 0, 2)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), kwargs
    sd = copy.deepcopy(opt.state_dict())
    resumed = copy.deepcopy(model)
    other = getattr(forge.optim, rule)(resumed, **kwargs)
    other.load_state_dict(copy.deepcopy(sd))
    assert same_state_dict(sd, other.state_dict())
