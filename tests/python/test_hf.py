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


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=16):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 128, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_run(tmp_path, optimizer_factory, precision: str):
    """6 optimizer steps of Trainer with max_grad_norm and 2-step gradient accumulation;
    returns (the logged losses and grad norms, the trained model)."""
    pytest.importorskip("accelerate")
    model = tiny_llama(tie=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=0.5, max_steps=6, learning_rate=1e-3, weight_decay=0.1,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, seed=0,
        save_strategy="no", bf16=precision == "bf16", dataloader_num_workers=0)
    optimizers = (optimizer_factory(model, args), None) if optimizer_factory else (None, None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(),
                                   optimizers=optimizers)
    trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return logs, model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hf_trainer_clipping_accumulation_and_amp(tmp_path, precision, record_difference):
    """The recipe in README: Trainer(..., optimizers=(forge.optim.AdamW(model, ...), None)).
    max_grad_norm, gradient_accumulation_steps and grad_norm logging (and bf16 autocast)
    give what Trainer's own torch AdamW gives."""
    from forge.integrations.hf import trainer_optimizer
    got, model = _trainer_run(tmp_path / "forge", trainer_optimizer, precision)
    want, ref = _trainer_run(tmp_path / "torch", None, precision)
    assert len(got) == len(want) == 6
    worst_loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, want))
    worst_norm = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, want))
    record_difference(f"Trainer {precision}: loss (relative)", worst_loss)
    record_difference(f"Trainer {precision}: grad_norm (relative)", worst_norm)
    rtol = HF_LOSS_RTOL["float32" if precision == "fp32" else "bfloat16"]
    assert worst_loss <= rtol and worst_norm <= rtol, (got, want)
    assert all(b[1] > 0.5 for b in want), "every step clips (max_grad_norm below the norm)"
