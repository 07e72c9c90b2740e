"""test_layers.py — the linear layers users have, beyond nn.Linear.

- transformers' Conv1D (GPT-2: y = x·W + b, W [in, out]) is fused, its dW = XᵀdY: exact
  against torch.optim on the token-ordered dW (reference.py) for several rules, odd shapes
  with biases, under activation checkpointing, in deferred mode with clip_grad_norm_ and
  accumulation (FactoredGrad holds its operands swapped), and used twice (the materialized
  fp32 sum of XᵀdY).
- F.linear on a Parameter inside a custom module, and an nn.Linear subclass with its own
  forward: not interceptable; they take the element-wise path (autograd's gradient, applied
  by a hook), exact against torch.optim, and opt.summary() says why.
- examples/gpt2.py: the tiny GPT-2's loss tracks torch.optim.AdamW, its Conv1D layers fused.
- examples/qlora_peft.py: PEFT LoRA adapters over a frozen base (bitsandbytes NF4 where
  bitsandbytes runs, else plain nn.Linear): the adapters are fused and track torch.optim, the
  base never changes; a bitsandbytes Linear8bitLt base likewise. bitsandbytes cases skip with
  the reason where it does not run; their CUDA variants (DEVICES) carry requires_cuda.
Bounds: tolerances.py.
"""
import copy
import importlib.util
import logging
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import forge
from conftest import DEVICES
from reference import (PerturbedByOneUlp, assert_contract, max_normwise, ordered_concat,
                       trajectories)
from tolerances import GRAD_NORM_RTOL, HF_LOSS_RTOL, LOOP_RTOL, ULP_SENSITIVITY_FACTOR

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
DIM, HIDDEN = 17, 129  # odd: neither a multiple of the CPU tile nor of an int8 block


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Conv1DNet(nn.Module):
    """An nn.Linear, then Conv1D layers of odd shapes with biases (17 -> 129 -> 17, and a
    square 17 x 17 one, whose dW taken the wrong way round would be its transpose), then an
    nn.Linear head. `checkpoint` wraps the Conv1D block in torch.utils.checkpoint; `twice`
    applies the square one twice."""

    def __init__(self, checkpoint=None, twice=False):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.up = Conv1D(HIDDEN, DIM)    # W [17, 129]
        self.down = Conv1D(DIM, HIDDEN)  # W [129, 17]
        self.mix = Conv1D(DIM, DIM)      # W [17, 17]
        for conv in (self.up, self.down, self.mix):
            nn.init.normal_(conv.weight, std=0.2)
            nn.init.normal_(conv.bias, std=0.1)
        self.head = nn.Linear(DIM, 1)
        self.checkpoint, self.twice = checkpoint, twice

    def block(self, h):
        h = self.down(F.gelu(self.up(h)))
        h = torch.tanh(self.mix(h))
        return torch.tanh(self.mix(h)) if self.twice else h

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.checkpoint is None:
            h = self.block(h)
        else:
            h = tuc.checkpoint(self.block, h, use_reentrant=self.checkpoint == "reentrant")
        return self.head(h)


def regression_loss(model, step, device):
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(3, 7, DIM, generator=g).to(device)
    y = torch.randn(3, 7, 1, generator=g).to(device)
    return F.mse_loss(model(x), y)


RULES = [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
         ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
         ("RMSprop", dict(lr=1e-3, centered=True, momentum=0.9, weight_decay=0.01))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,kwargs", RULES, ids=[r[0] for r in RULES])
def test_conv1d_matches_torch_optim(name, kwargs, device, record_difference):
    errors = trajectories(Conv1DNet, name, kwargs, device, steps=6, loss_fn=regression_loss)
    record_difference(f"{name} Conv1D vs torch (same sum order)", errors["forge_vs_ordered"])
    assert_contract(errors, device)


def test_conv1d_weights_are_fused(monkeypatch):
    """The Conv1D weights take the fused path: one forge_wgrad_step per fused weight in
    backward, and no Conv1D weight ever holds a gradient (only the ConsumedGrad sentinel)."""
    model = Conv1DNet()
    opt = forge.optim.AdamW(model, mode="immediate")
    fused = {p.name for p in opt.inspect() if p.path == "fused"}
    assert fused == {"inp.weight", "up.weight", "down.weight", "mix.weight", "head.weight"}
    calls = []
    real = forge._lib.Library.wgrad_step
    monkeypatch.setattr(forge._lib.Library, "wgrad_step",
                        lambda self, args: (calls.append(args.param.rows), real(self, args))[1])
    held = {}
    for name in ("up", "down", "mix"):
        getattr(model, name).weight.register_post_accumulate_grad_hook(
            lambda q, name=name: held.__setitem__(
                name, q.grad is not None and not isinstance(q.grad, forge.optim.ConsumedGrad)))
    regression_loss(model, 0, "cpu").backward()
    assert not any(held.values()), held
    # [rows, cols] as the fused step sees them: a Conv1D weight [in, out] as it is stored
    assert sorted(calls) == sorted([DIM, DIM, HIDDEN, DIM, 1])
    opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_conv1d_under_activation_checkpointing(mode, device, record_difference):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="forge:")  # no use counted twice
        errors = trajectories(lambda: Conv1DNet(checkpoint=mode), "AdamW",
                              dict(lr=1e-2, weight_decay=0.1), device, steps=5,
                              loss_fn=regression_loss)
    record_difference(f"AdamW Conv1D checkpoint {mode}", errors["forge_vs_ordered"])
    assert_contract(errors, device)


@pytest.mark.parametrize("device", DEVICES)
def test_conv1d_used_twice(device, record_difference):
    """The square Conv1D applied twice: its two (dY, X) pairs are summed as XᵀdY in fp32 and
    applied once, with one warning naming it."""
    with pytest.warns(UserWarning, match=r"mix\.weight") as caught:
        errors = trajectories(lambda: Conv1DNet(twice=True), "AdamW",
                              dict(lr=1e-2, weight_decay=0.1), device, steps=5,
                              loss_fn=regression_loss)
    assert len([w for w in caught if "uses in one backward" in str(w.message)]) == 1
    record_difference("AdamW Conv1D used twice", errors["forge_vs_ordered"])
    assert_contract(errors, device)


def _clip_exact(model, fused_weights, max_norm):
    """clip_grad_norm_ with each fused weight's norm in fp64, as forge computes it from
    its factors (test_loop.clip_with_exact_linear_norms)."""
    from test_loop import clip_with_exact_linear_norms
    for p in model.parameters():
        if id(p) in fused_weights and p.grad is not None:
            p.grad._linear = True
    return clip_with_exact_linear_norms(list(model.parameters()), max_norm)


def test_conv1d_deferred_clip_and_accumulation(record_difference):
    """Deferred mode with FactoredGrad (Conv1D's pair stored swapped), two micro-batches per
    step and clip_grad_norm_ every step: torch.optim's weights, with dW summed in forge's
    order over the concatenated tokens."""
    steps, micro, max_norm = 8, 2, 0.05
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    base = Conv1DNet()
    model = copy.deepcopy(base)
    refs = {k: ordered_concat(copy.deepcopy(base)) for k in ("ref", "ulp")}
    opts = {"forge": forge.optim.AdamW(model, mode="deferred", deferred_store="factors",
                                       **kwargs),
            "ref": torch.optim.AdamW(refs["ref"].parameters(), **kwargs),
            "ulp": PerturbedByOneUlp(torch.optim.AdamW(refs["ulp"].parameters(), **kwargs))}
    models = {"forge": model, **refs}
    norms = {k: [] for k in models}
    for step in range(steps):
        for key, m in models.items():
            for k in range(micro):
                (regression_loss(m, step * micro + k, "cpu") / micro).backward()
            if key == "forge":
                if step == 0:
                    assert isinstance(m.mix.weight.grad, forge.optim.FactoredGrad)
                    assert len(m.up.weight.grad.parts) == micro
                norms[key].append(float(torch.nn.utils.clip_grad_norm_(m.parameters(),
                                                                       max_norm)))
            else:
                m.move_ordered_grads()
                fused = {id(mod.weight) for mod in m.modules()
                         if isinstance(mod, (nn.Linear, Conv1D))}
                norms[key].append(float(_clip_exact(m, fused, max_norm)))
            opts[key].step()
            opts[key].zero_grad()
    assert all(n > max_norm for n in norms["ref"]), "every step clips"
    error = max_normwise(model, refs["ref"])
    bound = max(LOOP_RTOL, ULP_SENSITIVITY_FACTOR * max_normwise(refs["ulp"], refs["ref"]))
    record_difference("AdamW Conv1D deferred clip + accumulation", error)
    assert error <= bound, (error, bound)
    assert norms["forge"] == pytest.approx(norms["ref"], rel=GRAD_NORM_RTOL)


class FunctionalLinear(nn.Module):
    """A custom module calling F.linear on its own Parameters: no nn.Linear forward to
    reroute, so FORGE cannot intercept it (short of patching torch)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.2)
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class HalvedLinear(nn.Linear):
    """An nn.Linear subclass with its own forward (as quantized, LoRA or fake-quant layers
    have): FORGE leaves its forward alone."""

    def forward(self, x):
        return F.linear(x, self.weight * 0.5, self.bias)


class CustomLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, 33)
        self.functional = FunctionalLinear(33, DIM)
        self.halved = HalvedLinear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.halved(torch.tanh(self.functional(
            torch.tanh(self.inp(x)))))))


@pytest.mark.parametrize("device", DEVICES)
def test_functional_linear_and_own_forward_take_the_elementwise_path(device,
                                                                     record_difference):
    model = CustomLayers()
    opt = forge.optim.AdamW(model)
    modes = {p.name: p.path for p in opt.inspect()}
    assert modes["inp.weight"] == modes["head.weight"] == "fused"
    assert modes["functional.weight"] == modes["halved.weight"] == "batched"  # (small)
    text = opt.summary()
    assert "F.linear" in text and "functional.weight" in text
    assert "HalvedLinear replaces Linear.forward" in text and "halved.weight" in text
    errors = trajectories(CustomLayers, "AdamW", dict(lr=1e-2, weight_decay=0.1), device,
                          steps=6, loss_fn=regression_loss)
    record_difference("AdamW F.linear / own forward", errors["forge_vs_ordered"])
    assert_contract(errors, device)


class Attention(nn.Module):
    """nn.MultiheadAttention: F.linear on in_proj_weight, and out_proj an nn.Linear whose
    weight it reads directly, never calling its forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(self.attn(h, h, h, need_weights=False)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_multihead_attention_weights_take_the_elementwise_path(device, record_difference):
    model = Attention()
    opt = forge.optim.AdamW(model)
    modes = {p.name: (p.path, p.reason) for p in opt.inspect()}
    assert modes["inp.weight"][0] == modes["head.weight"][0] == "fused"
    assert modes["attn.in_proj_weight"][0] == "batched" and "F.linear" in modes[
        "attn.in_proj_weight"][1]
    assert modes["attn.out_proj.weight"][0] == "batched" and "MultiheadAttention's out_proj" in \
        modes["attn.out_proj.weight"][1]
    # (SGD: the key bias's gradient is rounding noise, its true value 0; Adam would turn
    # that noise into full-size steps and the comparison into one of noise)
    errors = trajectories(Attention, "SGD", dict(lr=0.05, momentum=0.9), device, steps=5,
                          loss_fn=regression_loss)
    record_difference("SGD nn.MultiheadAttention", errors["forge_vs_ordered"])
    assert_contract(errors, device)


class Parametrized(nn.Module):
    """nn.Linear layers whose weight torch.nn.utils.parametrize computes in each forward:
    spectral_norm (a power iteration on buffers at each training forward) and weight_norm."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrizations
        self.inp = nn.Linear(DIM, 32)
        self.spectral = parametrizations.spectral_norm(nn.Linear(32, 32))
        self.normed = parametrizations.weight_norm(nn.Linear(32, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.spectral(torch.tanh(self.inp(x))))
        return self.head(torch.tanh(self.normed(h)))


@pytest.mark.parametrize("device", DEVICES)
def test_parametrized_weights_take_the_elementwise_path(device, record_difference):
    """A parametrized Linear's weight is read, never fused (its layer computes it from the
    parametrization's own parameters in each forward); building the optimizer reads no such
    weight, so spectral_norm's buffers stay as they were and training matches torch.optim."""
    torch.manual_seed(0)
    model = Parametrized()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    opt = forge.optim.SGD(model, lr=0.05, momentum=0.9)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    modes = {p.name: (p.path, p.reason) for p in opt.inspect()}
    assert modes["inp.weight"][0] == modes["head.weight"][0] == "fused"
    assert modes["spectral.parametrizations.weight.original"][0] == "batched"
    assert "parametrized" in modes["normed.parametrizations.weight.original1"][1]
    errors = trajectories(Parametrized, "SGD", dict(lr=0.05, momentum=0.9), device, steps=5,
                          loss_fn=regression_loss)
    record_difference("SGD parametrized Linears", errors["forge_vs_ordered"])
    assert_contract(errors, device)


def test_summary_and_construction_log(caplog):
    """summary(): fused / element-wise / deferred / frozen, with bytes; one INFO line."""
    model = Conv1DNet()
    model.inp.weight.requires_grad_(False)
    model.inp.bias.requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="forge"):
        opt = forge.optim.SGD(model, lr=0.1, params=[
            {"params": [model.up.weight, model.down.weight, model.mix.weight, model.head.weight,
                        model.up.bias, model.inp.weight]},
            {"params": [model.down.bias, model.mix.bias, model.head.bias]}])
    lines = [r.getMessage() for r in caplog.records if r.name == "forge"]
    assert len(lines) == 1
    assert lines[0].startswith("forge: SGD: 4 weights fused") and "4 element-wise" in lines[0]
    text = opt.summary()
    fused_bytes = 4 * (DIM * HIDDEN * 2 + DIM * DIM + DIM)
    assert f"gradient bytes never allocated: {fused_bytes / 1024:.2f} KiB" in text
    assert "frozen (requires_grad=False) in the param groups: never stepped: 1 parameter" \
        in text and "inp.weight" in text
    assert "frozen, in the model only: 1 parameter" in text  # inp.bias
    assert "optimizer states (made at each parameter's first update): none" in text  # (SGD)
    assert "inp.bias" in opt.summary(verbose=True)


def test_gpt2_example_tracks_torch_adamw(record_difference):
    """examples/gpt2.py: forge.optim.AdamW on GPT-2 (its Conv1D layers fused) against
    torch.optim.AdamW, fp32, CPU: the loss at every step within HF_LOSS_RTOL."""
    gpt2 = load_example("gpt2")
    model, ref = gpt2.tiny_gpt2(), gpt2.tiny_gpt2()
    opt = gpt2.make_optimizer(model)
    fused = [p for p in opt.inspect() if p.path == "fused"]
    assert len(fused) == 4 * model.config.n_layer and all(p.layer == "Conv1D" for p in fused)
    text = opt.summary()
    assert f"{len(fused)}  transformers Conv1D weight" in text
    assert "transformer.wte.weight = lm_head.weight" in text
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    steps = 8
    got, want = gpt2.train(model, opt, steps), gpt2.train(ref, ref_opt, steps)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    record_difference("GPT-2 example loss fp32 (relative)", worst)
    assert worst <= HF_LOSS_RTOL["float32"], (got, want)
    assert got[-1] < got[0], "it trains"


# ----------------------------------------------------------------- PEFT LoRA, bitsandbytes

def _base_case(base, device):
    """Skips (with the reason) what cannot run here: PEFT missing, bitsandbytes' 4-bit not
    running on `device`."""
    pytest.importorskip("peft")
    qlora = load_example("qlora_peft")
    if base == "4bit":
        ok, why = qlora.bitsandbytes_4bit(device)
        if not ok:
            pytest.skip(why)
    return qlora


def _frozen_snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base", ["plain", "4bit"])
def test_qlora_example_trains_adapters_only(base, device, record_difference):
    """examples/qlora_peft.py: LoRA on q/v over a frozen base. forge fuses the adapters' A
    and B, matches torch.optim.AdamW on them (loss within HF_LOSS_RTOL), and never changes
    a base weight (bitsandbytes' 4-bit storage included)."""
    qlora = _base_case(base, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model, four_bit = qlora.lora_model(device, four_bit=base == "4bit")
        ref, _ = qlora.lora_model(device, four_bit=base == "4bit")
    assert four_bit == (base == "4bit")
    if four_bit:
        import bitsandbytes as bnb
        assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer,
                          bnb.nn.Linear4bit)
    frozen = _frozen_snapshot(model)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    opt = forge.optim.AdamW(model, lr=1e-2, weight_decay=0.0)
    params = opt.inspect().params
    assert len(params) == len(adapters) and all(p.path == "fused" for p in params)
    text = opt.summary()
    assert f"{len(adapters)}  nn.Linear weight" in text
    assert f"frozen, in the model only: {len(frozen)} parameter" in text
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                weight_decay=0.0)
    probe = qlora.batch(1000, device)
    with torch.no_grad():
        before = model(input_ids=probe, labels=probe).loss.item()
    steps = 8
    got = qlora.train(model, opt, steps, device)
    want = qlora.train(ref, ref_opt, steps, device)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    record_difference(f"LoRA adapters, {base} base: loss fp32 (relative)", worst)
    assert worst <= HF_LOSS_RTOL["float32"], (got, want)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"base weight {n} changed"
        else:
            assert not torch.equal(p, adapters[n]), f"adapter {n} did not train"
    with torch.no_grad():
        after = model(input_ids=probe, labels=probe).loss.item()
    assert after < before, "the adapters learn"


@pytest.mark.parametrize("base", ["plain", "4bit"])
def test_frozen_base_in_params_is_accepted_and_never_stepped(base):
    """optimizer(params=model.parameters()), the torch.optim habit: the frozen base
    (bitsandbytes' uint8 4-bit storage too) is accepted, never stepped, left as it was."""
    qlora = _base_case(base, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model, _ = qlora.lora_model("cpu", four_bit=base == "4bit")
    frozen = _frozen_snapshot(model)
    opt = forge.optim.AdamW(model, lr=1e-2, params=list(model.parameters()))
    assert sum(p.path == "fused" for p in opt.inspect()) == 8
    assert "frozen (requires_grad=False) in the param groups" in opt.summary()
    qlora.train(model, opt, 2)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all(p not in opt.state for p in model.parameters() if not p.requires_grad)


def _bnb_8bit(device):
    bnb = pytest.importorskip("bitsandbytes")
    try:
        layer = bnb.nn.Linear8bitLt(DIM, DIM, bias=False, has_fp16_weights=False).to(device)
        x = torch.randn(2, DIM, device=device, requires_grad=True)
        layer(x).sum().backward()
    except Exception as e:
        pytest.skip(f"bitsandbytes 8-bit does not run on {device}: {type(e).__name__}: {e}")
    return bnb


class Int8BaseWithAdapter(nn.Module):
    """A frozen bitsandbytes Linear8bitLt base plus a trainable low-rank nn.Linear pair."""

    def __init__(self, bnb, device):
        super().__init__()
        dense = nn.Linear(DIM, DIM, bias=False)
        self.base = bnb.nn.Linear8bitLt(DIM, DIM, bias=False, has_fp16_weights=False)
        self.base.weight = bnb.nn.Int8Params(dense.weight.data.clone(), requires_grad=False,
                                             has_fp16_weights=False)
        self.base = self.base.to(device)  # quantizes to int8
        self.a = nn.Linear(DIM, 4, bias=False).to(device)
        self.b = nn.Linear(4, DIM, bias=False).to(device)
        self.head = nn.Linear(DIM, 1).to(device)

    def forward(self, x):
        return self.head(torch.tanh(self.base(x) + self.b(self.a(x))))


@pytest.mark.parametrize("device", DEVICES)
def test_bitsandbytes_int8_base_is_left_alone(device, record_difference):
    """A frozen Linear8bitLt base (an nn.Linear subclass with its own forward) beside
    trainable nn.Linear layers: those are fused and exact against torch.optim, the int8 base
    stays as it was."""
    bnb = _bnb_8bit(device)
    model = Int8BaseWithAdapter(bnb, device)
    frozen = _frozen_snapshot(model)
    assert frozen["base.weight"].dtype == torch.int8
    opt = forge.optim.AdamW(model, lr=1e-2)
    assert {p.name: p.path for p in opt.inspect()} == {
        "a.weight": "fused", "b.weight": "fused", "head.weight": "fused", "head.bias": "batched"}
    regression_loss(model, 0, device).backward()
    opt.step()
    assert torch.equal(model.base.weight, frozen["base.weight"])
    errors = trajectories(lambda: Int8BaseWithAdapter(bnb, device), "AdamW", dict(lr=1e-2),
                          device, steps=5, loss_fn=regression_loss,
                          params_fn=lambda m: [p for p in m.parameters() if p.requires_grad])
    record_difference("AdamW adapters over a bitsandbytes int8 base", errors["forge_vs_ordered"])
    assert_contract(errors, device)


@pytest.mark.parametrize("device", DEVICES)
def test_conv1d_under_bf16_autocast(device, record_difference):
    """fp32 Conv1D weights under bf16 autocast: the fused step reads the bf16 X and dY that
    torch.addmm under autocast makes, dX / db come back in autocast's dtypes, and the update
    tracks torch.optim.AdamW under the same autocast (metric and bound: tolerances.py)."""
    from tolerances import AUTOCAST_UPDATE_RTOL
    torch.manual_seed(0)
    base = Conv1DNet().to(device)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = forge.optim.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(6):
        for m, o in ((model, opt), (ref, ref_opt)):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = regression_loss(m, step, device)
            loss.backward()
            o.step()
            o.zero_grad()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    worst = 0.0
    for w, r, s in zip(model.parameters(), ref.parameters(), base.parameters()):
        dw, dr = (w - s).double(), (r - s).double()
        worst = max(worst, ((dw - dr).norm() / dr.norm()).item())
    record_difference("Conv1D autocast bf16 vs torch autocast", worst)
    assert worst <= AUTOCAST_UPDATE_RTOL
