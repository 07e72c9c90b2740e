"""QLoRA-style fine-tuning with PEFT and forge.optim.AdamW.

A frozen base model (a tiny Hugging Face Llama; its q/k/v/o and MLP layers 4-bit NF4
bitsandbytes layers where bitsandbytes runs, else plain frozen nn.Linear) with LoRA adapters
on q_proj and v_proj (peft.LoraConfig / get_peft_model). The adapters' A and B are nn.Linear
layers: FORGE fuses their update into the weight-gradient GEMM of backward. The base is
frozen (requires_grad=False) and not forwarded through nn.Linear.forward (a bitsandbytes
Linear4bit has its own): FORGE leaves it untouched, and its layers keep their own forward.

    python examples/qlora_peft.py          # CPU or GPU; bitsandbytes 4-bit where it runs
"""
import logging
import warnings
from typing import Optional, Tuple

import torch
import torch.nn as nn
import transformers

import forge

VOCAB, SEQ = 256, 32


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """A 2-layer Llama from a config (no download)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def bitsandbytes_4bit(device: str) -> Tuple[bool, str]:
    """(whether bitsandbytes' 4-bit layers run on `device` here, why not): a tiny
    Linear4bit is quantized, run forward and backward."""
    try:
        import bitsandbytes as bnb
        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32,
                                  quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False,
                                         quant_type="nf4")
        layer = layer.to(device)  # quantizes
        x = torch.randn(2, 64, device=device, requires_grad=True)
        layer(x).sum().backward()
        return True, ""
    except Exception as e:  # not installed, no backend for this device, ...
        return False, f"bitsandbytes 4-bit does not run on {device}: {type(e).__name__}: {e}"


def quantize_base_4bit(model: nn.Module, device: str) -> None:
    """Replaces every nn.Linear of the decoder layers (not lm_head) by a bitsandbytes NF4
    Linear4bit holding the same weight, quantized on `device` (what from_pretrained does
    with BitsAndBytesConfig(load_in_4bit=True), here without a checkpoint to load)."""
    import bitsandbytes as bnb
    for module in list(model.model.layers.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                      bias=child.bias is not None,
                                      compute_dtype=torch.float32, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False,
                                             quant_type="nf4")
                setattr(module, name, q.to(device))
    model.is_loaded_in_4bit = True  # PEFT then wraps these layers with its bitsandbytes LoRA


def lora_model(device: str = "cpu", four_bit: Optional[bool] = None, seed: int = 0):
    """(the PEFT model, whether its base is 4-bit): a tiny Llama on `device`, base frozen,
    LoRA (r=8) on q_proj and v_proj. four_bit None: where bitsandbytes 4-bit runs."""
    import peft
    model = tiny_llama(seed).to(device)
    if four_bit is None:
        four_bit = bitsandbytes_4bit(device)[0]
    if four_bit:
        quantize_base_4bit(model, device)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj"])
    torch.manual_seed(seed + 1)  # the adapters' initialization
    model = peft.get_peft_model(model, config)  # freezes every base parameter
    return model, four_bit


def batch(step: int, device: str = "cpu", batch_size: int = 4) -> torch.Tensor:
    """Token ids [batch, SEQ] that count up from a random start (mod VOCAB): learnable."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    return ((start + torch.arange(SEQ)) % VOCAB).to(device)


def train(model, opt, steps: int, device: str = "cpu", log=None) -> list:
    model.train()
    losses = []
    for step in range(steps):
        ids = batch(step, device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()       # the LoRA A/B weights are updated here, tile by tile
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if log is not None:
            log(step, loss.item())
    return losses


def main(steps: int = 20) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # forge's INFO line
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = "cuda" if torch.cuda.is_available() and forge.has_cuda() else "cpu"
    ok, why = bitsandbytes_4bit(device)
    print("base: bitsandbytes NF4 (4-bit)" if ok else f"base: plain frozen nn.Linear ({why})")
    model, _ = lora_model(device, four_bit=ok)
    # params default to the trainable ones: the adapters (the frozen base is left out)
    opt = forge.optim.AdamW(model, lr=1e-2, weight_decay=0.0)
    print(opt.summary())
    train(model, opt, steps, device,
          log=lambda step, loss: print(f"step {step:3d}  loss {loss:.4f}"))


if __name__ == "__main__":
    main()
