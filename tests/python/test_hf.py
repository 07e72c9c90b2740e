"""test_hf.py — a Hugging Face LlamaForCausalLM built from a tiny config (no download)
trains with forge.optim.AdamW and its loss tracks torch.optim.AdamW(fused=True), also
with gradient_checkpointing_enable() and tied embeddings. Skipped without transformers."""
import copy
import warnings

import pytest
import torch

import forge
from conftest import requires_cuda
from tolerances import HF_LOSS_RTOL

transformers = pytest.importorskip("transformers")

STEPS = 8


def tiny_llama(tie: bool):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def tokens(device):
    """One fixed batch: the model must visibly fit it within STEPS steps."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (2, 16), generator=g).to(device)


def losses(model, opt, device):
    out = []
    model.train()
    ids = tokens(device)
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("device,dtype", [
    ("cpu", "float32"),
    pytest.param("cuda", "float32", marks=requires_cuda),
    pytest.param("cuda", "bfloat16", marks=requires_cuda)])
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_tracks_fused_adamw(tie, checkpointing, device, dtype, record_difference):
    dtype = getattr(torch, dtype)
    base = tiny_llama(tie).to(device=device, dtype=dtype)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    if tie:  # deepcopy keeps the tie: one Parameter under two names
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if checkpointing:
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers 5 renames it; both names work
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    options = {} if dtype == torch.float32 else dict(master_weights=True, state_format="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied-weights notice
        opt = forge.optim.AdamW(model, lr=1e-3, weight_decay=0.1, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    got, want = losses(model, opt, device), losses(ref, ref_opt, device)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    record_difference(f"Llama loss {str(dtype)[6:]} (relative)", worst)
    assert worst <= HF_LOSS_RTOL[str(dtype)[6:]], (got, want)
    assert got[-1] < got[0], "it trains"
