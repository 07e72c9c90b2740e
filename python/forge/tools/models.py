"""models.py — the small Llama-style causal LM that forge-train trains by default.

Plain torch, no dependencies: token embedding, N blocks of (RMSNorm → rotary
attention through F.scaled_dot_product_attention → RMSNorm → SwiGLU MLP), a final
RMSNorm and an untied output head. Every projection is an nn.Linear without bias,
the layer FORGE fuses; embeddings and norm weights take FORGE's element-wise path.
The head is untied on purpose: a tied weight has two consumers per step and would
take FORGE's slower materialized-gradient path.

Presets are named sizes ("tiny" trains in a couple of minutes on 2 CPU cores,
"100m" is the GPU parity-report model). build_model() also accepts a Hugging Face
config.json or checkpoint directory when `transformers` is installed.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256          # byte-level tokenizer
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4            # < n_heads: grouped-query attention
    ffn_dim: int = 352             # SwiGLU hidden size
    max_seq_len: int = 512         # length of the rotary table: the longest sequence allowed
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


PRESETS = {
    # ~0.9 M parameters: the default, a couple of minutes on 2 CPU cores.
    "tiny": ModelConfig(),
    # ~11 M parameters: a quick GPU run or a long CPU one.
    "small": ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=6, ffn_dim=1024,
                         max_seq_len=1024),
    # ~103 M parameters: the GPU convergence-parity report.
    "100m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2688,
                        max_seq_len=2048),
}


class RMSNorm(nn.Module):
    forge_lean_role = "rms_norm"  # forge.lean may recompute it (its formula, self.eps)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 models too), then scale in the input's dtype.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float):
    """cos, sin: [max_seq_len, head_dim] fp32, in the rotate-half layout Llama uses."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, head_dim]; cos, sin: [T, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # (-1 heads: under tensor parallel this rank holds a slice of the heads)
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, head_dim]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    forge_lean_role = "swiglu_mlp"  # forge.lean may recompute its product (F.silu, no act_fn)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    """forward(tokens [B, T]) -> logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"dim {cfg.dim}, n_heads {cfg.n_heads}, n_kv_heads "
                             f"{cfg.n_kv_heads} do not divide")
        self.config = cfg
        self.max_seq_len = cfg.max_seq_len
        self.activation_checkpointing = False
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        # GPT-2 style: N(0, 0.02), residual-output projections scaled by 1/sqrt(2·layers).
        out_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights stay 1
            std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's "
                             f"max_seq_len {self.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        for block in self.blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.head(self.norm(x))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def is_hf_model_path(name: str) -> bool:
    """True for a config.json file or a directory that holds one."""
    return (os.path.isfile(name) and name.endswith(".json")) or \
        os.path.isfile(os.path.join(name, "config.json"))


def build_model(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                vocab_size: Optional[int] = None):
    """A preset name, or a Hugging Face config.json / checkpoint directory.

    Returns (model, kind, max_seq_len) with kind "preset" or "hf". Raises ValueError
    with a user-facing message on an unknown name or a missing dependency.
    """
    if name in PRESETS:
        cfg = PRESETS[name]
        if vocab_size is not None and vocab_size != cfg.vocab_size:
            cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
        with torch.device(device):
            model = CausalLM(cfg)
        return model.to(dtype), "preset", cfg.max_seq_len
    if not is_hf_model_path(name):
        raise ValueError(f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}) or "
                         "a Hugging Face config.json / checkpoint directory")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model {name!r} is a Hugging Face config; install `transformers` "
                         "to use it") from None
    model_dir = os.path.dirname(name) if name.endswith(".json") else name
    config = transformers.AutoConfig.from_pretrained(name if os.path.isdir(name) else model_dir)
    has_weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(model_dir or "."))
    # transformers < 4.56 calls the dtype argument torch_dtype.
    version = tuple(int(v) for v in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if version >= (4, 56) else "torch_dtype"
    if has_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **{dtype_kw: dtype})
        model = model.to(device)
    else:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_kw: dtype})
    max_seq = getattr(config, "max_position_embeddings", None) or 1 << 30
    return model, "hf", max_seq


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits for our CausalLM and for Hugging Face causal LMs alike."""
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def enable_activation_checkpointing(model: nn.Module) -> None:
    if isinstance(model, CausalLM):
        model.activation_checkpointing = True
    elif hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError("this model does not support activation checkpointing")
