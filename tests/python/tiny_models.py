"""tiny_models.py — the small models the Python tests train (written here, no downloads).

TinyTransformer has every kind of parameter forge.optim routes: an embedding, a learned
position table (a bare nn.Parameter), attention and MLP nn.Linear layers (some with a
bias), RMSNorm weights and an untied (or, tie=True, tied) output head. `checkpoint`
wraps each block in torch.utils.checkpoint ("reentrant" / "non_reentrant").
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

VOCAB, DIM, HEADS, SEQ, BATCH = 48, 32, 4, 12, 3


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=True)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=True)

    def forward(self, x):  # [B, T, D]
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=True)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, heads=HEADS, layers=2, tie=False, checkpoint=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.checkpoint = checkpoint  # None | "reentrant" | "non_reentrant"

    def forward(self, tokens):  # [B, T] -> logits [B, T, vocab]
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                x = tuc.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
        return self.head(self.norm(x))


class TwiceLinear(nn.Module):
    """One nn.Linear applied twice per forward (a shared block)."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.shared = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        h = torch.tanh(self.shared(h))
        return self.out(h)


class OutsideUse(nn.Module):
    """An nn.Linear whose weight is also read directly (F.linear on .weight.t())."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        h = h + F.linear(x, self.lin.weight.t())
        return self.out(h)


def batch(step: int, device="cpu", vocab=VOCAB, seq=SEQ, bsz=BATCH):
    """Deterministic token batch number `step`: (inputs, targets)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (bsz, seq + 1), generator=g)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model, step: int, device="cpu"):
    x, y = batch(step, device)
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


class StridedInputs(nn.Module):
    """Linear layers fed strided views: a column slice (rows ld = 2·dim, offset pointer)
    and a transposed activation (not viewable as rows: copied), with a transposed dY."""

    def __init__(self, dim=DIM, tokens=5):
        super().__init__()
        self.wide = nn.Linear(dim, 2 * dim)
        self.right = nn.Linear(dim, dim)
        self.mix = nn.Linear(tokens, tokens)
        self.out = nn.Linear(dim, 1)

    def forward(self, x):  # [B, tokens, dim]
        h = torch.tanh(self.wide(x))
        h = self.right(h[..., h.shape[-1] // 2:])
        h = self.mix(h.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(h))


class Routed(nn.Module):
    """A router's two experts (nn.Linear each) between an input and an output Linear, as a
    mixture of experts runs them: each token goes to one expert (route[t]), so an expert may
    get no token in a batch (its Linear applied to 0 rows), and `skip` leaves an expert out of
    the forward altogether (no gradient reaches it: its .grad stays as it was)."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.out = nn.Linear(dim, 1)

    def forward(self, x, route, skip=()):  # x: [T, dim], route: [T] expert indices
        h = torch.tanh(self.inp(x))
        mixed = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            if i not in skip:
                rows = (route == i).nonzero().squeeze(1)
                mixed = mixed.index_add(0, rows, torch.tanh(expert(h[rows])))
        return self.out(mixed)


def routed_loss(model, step: int, device="cpu", empty=(), skip=()):
    """Batch number `step` through a Routed model; experts in `empty` get no token."""
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(12, DIM, generator=g)
    route = torch.randint(0, 2, (12,), generator=g)
    for i in empty:
        route[route == i] = 1 - i
    return model(x.to(device), route.to(device), skip).square().mean()


class Convolutional(nn.Module):
    """A convolution whose weight (32·256·3·3 = 73,728 elements) is large enough for the hook
    path, and no nn.Linear: a model none of whose parameters is fused."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 256, 3)

    def forward(self, x):  # x: [B, 32, 5, 5]
        return torch.tanh(self.conv(x)).mean((1, 2, 3))


def conv_loss(model, step: int, device="cpu"):
    g = torch.Generator().manual_seed(3000 + step)
    return model(torch.randn(2, 32, 5, 5, generator=g).to(device)).square().mean()


class Adversarial(nn.Module):
    """A generator and a discriminator (two Linears each), as a GAN or an actor-critic pair is
    trained: two optimizers, and each one's loss reaches the other's weights."""

    def __init__(self, dim=DIM, noise=16):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(noise, 64), nn.Tanh(), nn.Linear(64, dim))
        self.discriminator = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, 1))
        self.noise, self.dim = noise, dim


def adversarial_step(pair, d_opt, g_opt, step: int, detach: bool) -> None:
    """One step of the usual loop: the discriminator's (on generated samples, detached or
    not: the generator's weights get a gradient then, which g_opt.zero_grad() discards), then
    the generator's (its loss reaches the discriminator's weights, whose gradient
    d_opt.zero_grad() discards at the next step)."""
    g = torch.Generator().manual_seed(4000 + step)
    real = torch.randn(12, pair.dim, generator=g)
    z = torch.randn(12, pair.noise, generator=g)
    d, gen = pair.discriminator, pair.generator
    d_opt.zero_grad()
    fake = gen(z)
    (d(fake.detach() if detach else fake) - d(real)).mean().backward()
    d_opt.step()
    g_opt.zero_grad()
    (-d(gen(z))).mean().backward()
    g_opt.step()


class FusedHeadLM(nn.Module):
    """A Linear, then a head whose cross entropy is forge.loss.head_cross_entropy's: the
    head's update runs in that loss's backward, the first callback of a step."""

    def __init__(self, dim=DIM, vocab=VOCAB):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)


class HookLast(nn.Module):
    """A Linear, then a parameter read by F.linear, large enough for the hook path: its hook
    is the first callback of a step."""

    def __init__(self, dim=DIM, wide=320):
        super().__init__()
        self.inp = nn.Linear(dim, wide)
        self.out = nn.Parameter(torch.randn(wide, wide) * wide ** -0.5)


def first_callback_loss(model, step: int, device="cpu"):
    """Batch number `step` through a Routed, FusedHeadLM or HookLast model."""
    g = torch.Generator().manual_seed(5000 + step)
    x = torch.randn(12, DIM, generator=g).to(device)
    if isinstance(model, Routed):
        return routed_loss(model, step, device)
    h = torch.tanh(model.inp(x))
    if isinstance(model, FusedHeadLM):
        import forge.loss
        targets = torch.randint(0, VOCAB, (12,), generator=g).to(device)
        return forge.loss.head_cross_entropy(h, model.head, targets)
    return F.linear(h, model.out).square().mean()
