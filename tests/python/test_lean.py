"""test_lean.py — forge.lean's memory-lean activations: the same loss and gradients as the
unwrapped model (bit for bit in bf16), fewer saved bytes by exactly the intermediates it
recomputes, and it composes with forge.optim, activation checkpointing, forge-train and
forge-bench."""
import copy

import pytest
import torch
import torch.nn as nn

import forge
from forge import lean
from forge.tools import models
from forge.tools.train import lm_loss
import torch.nn.functional as F

from tolerances import LEAN_CE_RTOL, LEAN_FP32_GRAD_RTOL


def forge_tiny(dtype):
    torch.manual_seed(0)
    model, _, _ = models.build_model("tiny", torch.device("cpu"), dtype)
    return model


def hf_tiny(family: str, dtype):
    transformers = pytest.importorskip("transformers")
    if family == "qwen3" and not hasattr(transformers, "Qwen3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3")
    kwargs = dict(vocab_size=97, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  use_cache=False, attn_implementation="sdpa")
    config = (transformers.LlamaConfig(**kwargs) if family == "llama"
              else transformers.Qwen3Config(head_dim=16, **kwargs))
    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    return cls(config).to(dtype)


def batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (2, 33), generator=g)


def loss_of(model, tokens):
    if isinstance(model, models.CausalLM):
        return lm_loss(model, tokens)
    return model(input_ids=tokens, labels=tokens).loss


def saved_bytes(model, tokens):
    """The loss, and the bytes of the distinct non-parameter storages autograd saved."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, tokens)
    return loss, sum(b for ptr, b in seen.items() if ptr not in params)


def saved_bytes_plain_and_lean(plain, wrapped):
    """saved_bytes of both tiny HF Llamas on one batch, and from the plain one the input shape
    of every RMSNorm and the element count of every gate_proj output, in forward order."""
    tokens = batch(97)
    norm_shapes, gate_elems = [], []
    hooks = [m.register_forward_hook(lambda m, i, o: norm_shapes.append(i[0].shape))
             for m in plain.modules() if type(m).__name__.endswith("RMSNorm")]
    hooks += [m.gate_proj.register_forward_hook(lambda m, i, o: gate_elems.append(o.numel()))
              for m in plain.modules() if hasattr(m, "gate_proj")]
    before = saved_bytes(plain, tokens)
    for h in hooks:
        h.remove()
    return before, saved_bytes(wrapped, tokens), norm_shapes, gate_elems


# (name, builder, RMSNorms, SwiGLU MLPs): forge.models' tiny has 4 layers and a final norm.
MODELS = [
    ("forge-tiny", forge_tiny, 9, 4),
    ("hf-llama", lambda dtype: hf_tiny("llama", dtype), 5, 2),
    # Qwen3 also normalizes q and k per head: two more RMSNorms per layer.
    ("hf-qwen3", lambda dtype: hf_tiny("qwen3", dtype), 9, 2),
]


@pytest.mark.parametrize("name,build,norms,mlps", MODELS, ids=[m[0] for m in MODELS])
def test_bf16_loss_and_gradients_are_bit_identical(name, build, norms, mlps):
    plain = build(torch.bfloat16)
    wrapped = copy.deepcopy(plain)
    assert lean.enable_lean_activations(wrapped) == {"rms_norm": norms, "swiglu_mlp": mlps}
    tokens = batch(plain.config.vocab_size if hasattr(plain, "config") else 256)
    a, b = loss_of(plain, tokens), loss_of(wrapped, tokens)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert p.grad is not None and q.grad is not None, n
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("name,build,norms,mlps", MODELS[:2], ids=[m[0] for m in MODELS[:2]])
def test_fp32_gradients_agree_to_rounding(name, build, norms, mlps):
    plain = build(torch.float32)
    wrapped = copy.deepcopy(plain)
    lean.enable_lean_activations(wrapped)
    tokens = batch(plain.config.vocab_size if hasattr(plain, "config") else 256)
    a, b = loss_of(plain, tokens), loss_of(wrapped, tokens)
    a.backward()
    b.backward()
    assert torch.equal(a, b)  # the forward is the same code
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        scale = p.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= LEAN_FP32_GRAD_RTOL * scale, n


def test_saved_bytes_drop_by_exactly_the_recomputed_intermediates():
    """bf16 Llama: each RMSNorm kept an fp32 copy of its input and the bf16 normalized tensor
    (6 bytes per element) besides its fp32 rsqrt per row, and now keeps its bf16 input (2
    bytes per element) besides that rsqrt; each SwiGLU product kept silu's output besides gate
    and up (2 bytes per element of gate)."""
    plain = hf_tiny("llama", torch.bfloat16)
    wrapped = copy.deepcopy(plain)
    lean.enable_lean_activations(wrapped)
    (_, before), (_, after), norm_elems, gate_elems = saved_bytes_plain_and_lean(plain, wrapped)
    assert len(norm_elems) == 5 and len(gate_elems) == 2
    norm_bytes = sum(4 * s.numel() for s in norm_elems)
    assert before - after == norm_bytes + 2 * sum(gate_elems)


def test_with_forge_optim_the_linears_keep_recomputable_inputs_too():
    """With forge.optim, the Linears reading a norm's output (q/k/v, gate/up) and down_proj
    (reading the SwiGLU product) keep what those are recomputed from instead: on top of the
    test above, those norm outputs and every product (2 bytes per element) go too."""
    plain = hf_tiny("llama", torch.bfloat16)
    wrapped = copy.deepcopy(plain)
    lean.enable_lean_activations(wrapped)
    opts = [forge.optim.AdamW(m, lr=1e-3) for m in (plain, wrapped)]
    (a, before), (b, after), norm_shapes, gate_elems = saved_bytes_plain_and_lean(plain, wrapped)
    norm_bytes = sum(4 * s.numel() for s in norm_shapes)
    # The head reads a slice of the final norm's output (HF's logits_to_keep), a view without
    # the recompute marker: that one output is kept, as before.
    outputs = sum(2 * s.numel() for s in norm_shapes[:-1]) + 2 * sum(gate_elems)
    assert before - after == norm_bytes + 2 * sum(gate_elems) + outputs
    a.backward()
    b.backward()
    for opt in opts:
        opt.step()
    assert torch.equal(a, b)
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_training_with_forge_optim_is_bit_identical_in_bf16(checkpointing):
    plain = forge_tiny(torch.bfloat16)
    wrapped = copy.deepcopy(plain)
    lean.enable_lean_activations(wrapped)
    if checkpointing:
        models.enable_activation_checkpointing(plain)
        models.enable_activation_checkpointing(wrapped)
    opts = [forge.optim.AdamW(m, lr=1e-3) for m in (plain, wrapped)]
    tokens = batch(256)
    for _ in range(3):
        losses = []
        for m, opt in zip((plain, wrapped), opts):
            loss = loss_of(m, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert torch.equal(losses[0], losses[1])
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q)


def test_inference_and_repeated_calls():
    assert forge.lean is lean
    model = forge_tiny(torch.float32)
    ref = copy.deepcopy(model)
    first = lean.enable_lean_activations(model)
    assert lean.enable_lean_activations(model) == first  # already wrapped: nothing changes
    tokens = batch(256)
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))


def test_a_model_without_norms_or_swiglu_is_left_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert lean.enable_lean_activations(model) == {"rms_norm": 0, "swiglu_mlp": 0}
    assert "forward" not in model[0].__dict__


def test_forge_train_lean_activations_runs_and_resume_keeps_it(tmp_path, capsys):
    from forge.tools import train
    common = ["--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--no-plot",
              "--out", str(tmp_path)]
    assert train.main(["--steps", "3", "--save-every", "3", "--lean-activations"] + common) == 0
    capsys.readouterr()
    # In fp32 (forge-train's default) lean changes the gradients' last bits: a resumed run
    # cannot drop it and continue bit-exactly, so it keeps the checkpoint's setting.
    assert train.main(["--steps", "5", "--resume", "--no-lean-activations"] + common) == 2
    assert "differs from the checkpoint" in capsys.readouterr().err
    assert train.main(["--steps", "5", "--resume"] + common) == 0


def test_forge_bench_lean_modes_on_cpu(tmp_path):
    from forge.tools import bench
    assert bench.main(["--models", "tiny", "--device", "cpu", "--seqs", "32", "--ckpt", "off",
                       "--modes", "forge-bf16", "forge-bf16-lean", "--out", str(tmp_path)]) == 0
    import json
    import os
    path = next(f for f in os.listdir(tmp_path) if f.endswith(".json") and "bench" in f)
    rows = json.load(open(tmp_path / path))["results"]
    assert [r["mode"] for r in rows] == ["forge-bf16", "forge-bf16-lean"]
    assert all(r["status"] == "ok" for r in rows)


def test_bench_lean_loss_is_the_models_loss():
    """forge-bench's lean modes take the loss through the head on the positions with a next
    token and forge.lean.cross_entropy: the same value as the model's own loss."""
    from forge.tools import bench
    model = hf_tiny("llama", torch.float32)
    tokens = batch(97)
    with torch.no_grad():
        ours, ref = bench.model_loss(model, tokens, lean=True), bench.model_loss(model, tokens)
    assert abs(ours.item() - ref.item()) <= LEAN_CE_RTOL * ref.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_torch(dtype, monkeypatch):
    monkeypatch.setattr(lean, "_CE_CHUNK_BYTES", 4 * 1000 * 7)  # chunks of 7 rows: 22 of them
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 50, 1000, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 1000, (3, 50), generator=g)
    targets[0, :5] = -100  # ignored rows count neither in the sum nor in the mean
    ours = lean.cross_entropy(logits, targets)
    ours.backward()
    grad, logits.grad = logits.grad.clone(), None
    ref = F.cross_entropy(logits.float().reshape(-1, 1000), targets.reshape(-1))
    ref.backward()
    assert ours.dtype == torch.float32 and grad.dtype == dtype
    assert abs(ours.item() - ref.item()) <= LEAN_CE_RTOL * ref.item()
    scale = logits.grad.float().abs().max()
    # bf16 gradients: the fp32 values agree to rounding, so their bf16 roundings may differ by
    # one bf16 ulp (2^-8 relative) where they straddle a rounding boundary.
    limit = LEAN_CE_RTOL * scale if dtype == torch.float32 else 2 ** -8 * scale
    assert (grad.float() - logits.grad.float()).abs().max() <= limit
    assert grad[0, :5].abs().max() == 0


def test_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="logits .* and targets"):
        lean.cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


class _TinyRMSNorm(nn.Module):
    forge_lean_role = "rms_norm"

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.mark.parametrize("where", ["recomputation", "cross_entropy"])
def test_create_graph_through_a_lean_backward_is_refused(where):
    """A lean backward hands its gradients on without a graph of their own, so under
    create_graph=True (a penalty differentiated through the gradients) the second-order terms
    would be lost: refused by name, as torch refuses what it cannot differentiate twice."""
    torch.manual_seed(0)
    model = nn.Sequential(_TinyRMSNorm(16), nn.Linear(16, 10))
    x, targets = torch.randn(5, 16), torch.randint(0, 10, (5,))
    if where == "recomputation":
        assert lean.enable_lean_activations(model)["rms_norm"] == 1
        loss = F.cross_entropy(model(x), targets)
    else:
        loss = lean.cross_entropy(model(x), targets)
    with pytest.raises(RuntimeError, match="not itself differentiable"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    loss.backward()  # (without create_graph: as usual)
    assert all(p.grad is not None for p in model.parameters())


def test_an_activation_that_is_f_silu_gets_the_written_out_backward():
    """transformers 5's SiLUActivation (its forward calls F.silu) and nn.SiLU take _SiluProduct
    (no nested autograd call in backward); an x · sigmoid(x), which rounds differently, and a
    module with parameters take the generic recomputation."""
    class Swish(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    class ScaledSiLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return F.silu(x) * self.scale

    assert lean._acts_as_silu(nn.SiLU())
    assert not lean._acts_as_silu(Swish())
    assert not lean._acts_as_silu(ScaledSiLU())
    plain = hf_tiny("llama", torch.bfloat16)
    lean.enable_lean_activations(plain)
    mlps = [m for m in plain.modules() if hasattr(m, "gate_proj")]
    assert mlps and all(m._forge_product_fn is lean._silu_product for m in mlps)


class SiLU(nn.Module):
    """x · sigmoid(x) under a name lean accepts for an MLP's activation: not F.silu's bits, so
    its MLP takes the generic recomputation. (Module level: a saved model pickles it.)"""
    def forward(self, x):
        return x * torch.sigmoid(x)


def test_a_wrapped_model_saved_whole_loads_wrapped(tmp_path):
    """torch.save(model) of a wrapped model loads wrapped, the generic product included: the
    same loss and gradients bit for bit, and what autograd keeps is the wrapped model's."""
    plain = hf_tiny("llama", torch.bfloat16)
    plain.model.layers[0].mlp.act_fn = SiLU()
    wrapped = copy.deepcopy(plain)
    counts = lean.enable_lean_activations(wrapped)
    assert wrapped.model.layers[0].mlp._forge_product_fn is not lean._silu_product
    torch.save(wrapped, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert lean.enable_lean_activations(loaded) == counts  # already wrapped: nothing changes
    tokens = batch(97)
    (a, kept_a), (b, kept_b) = saved_bytes(wrapped, tokens), saved_bytes(loaded, tokens)
    assert kept_b == kept_a < saved_bytes(plain, tokens)[1]
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for (n, p), q in zip(wrapped.named_parameters(), loaded.parameters()):
        assert torch.equal(p.grad, q.grad), n
