"""loss.py — forge.loss: a causal LM's head and its cross entropy in one, without the logits.

    loss = forge.loss.head_cross_entropy(hidden, model.lm_head, labels)   # labels shifted
    forge.loss.enable_fused_head(model)     # a Hugging Face *ForCausalLM: its forward uses it

The full logits of a step are [tokens, vocab] (Llama-3's 128256-entry vocabulary: 1 GiB of
bf16 at 4096 tokens, 2 GiB more in fp32 for the loss), the largest activation of a long
sequence. Here they never exist whole:

  forward    the vocabulary in blocks of rows of W: logits of a block (hidden · W_blockᵀ), an
             online log-sum-exp per token and the target's logit; keeps hidden and the
             log-sum-exp (4 bytes per token).
  backward   each block again: dlogits = softmax − one-hot (× the loss's gradient / count),
             dX += dlogits · W_block with the block's weights as the forward saw them, then
             the block's own update: forge.optim's fused step on rows of W with X = hidden and
             dY = dlogits (the step counted once for the weight). No dW exists either.

In a forge optimizer's deferred step the head keeps what a deferred Linear keeps: hidden and
the whole dlogits (a FactoredGrad) where those take fewer bytes than dW (Llama-3's head below
~4000 tokens), else dW. Without a forge optimizer driving the head (or with a weight tied to
an embedding) backward returns dW like any Linear, computed block by block. The loss is the
mean over the tokens whose label is not ignore_index, as F.cross_entropy's; it equals the
unfused head + cross entropy to fp32 rounding (the log-sum-exp is summed in another order).
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn

from . import _linear
from .optim import distributed
from .optim.backward import RowUpdate
from .optim.deferred import product

# NOTE: vocabulary rows per block: the block's fp32 logits are tokens × this × 4 bytes (64 MiB
# at 8192 tokens); larger blocks only add memory, the products are GEMMs either way.
_BLOCK_ROWS = 2048


class _HeadCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, block: int):
        # hidden: [N, D] (compute dtype), weight: [V, D], targets: [N] int64
        n, vocab = hidden.shape[0], weight.shape[0]
        w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        running_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
        running_sum = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for v0 in range(0, vocab, block):
            v1 = min(vocab, v0 + block)
            logits = hidden.matmul(w[v0:v1].t()).float()                  # [N, v1 - v0]
            block_max = logits.max(dim=1).values
            new_max = torch.maximum(running_max, block_max)
            running_sum = running_sum * torch.exp(running_max - new_max) + \
                torch.exp(logits - new_max[:, None]).sum(dim=1)
            running_max = new_max
            inside = (safe >= v0) & (safe < v1)
            picked = logits.gather(1, (safe - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
            target_logit = torch.where(inside, picked, target_logit)
        lse = running_max + torch.log(running_sum)                          # [N]
        count = valid.sum()
        loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum() / count
        ctx.save_for_backward(hidden, weight, lse, targets)
        ctx.ignore_index, ctx.block = ignore_index, block
        ctx.count = count
        return loss

    @staticmethod
    def backward(ctx, grad):
        _linear.refuse_create_graph(
            "head_cross_entropy", "Compute such a loss as F.cross_entropy(F.linear(hidden, "
            "weight), targets)")
        hidden, weight, lse, targets = ctx.saved_tensors
        vocab = weight.shape[0]
        # W's update runs here only where this backward accumulates W's gradient; one that
        # returns it (torch.autograd.grad naming W) gets dW, one that does not reach W nothing
        if ctx.needs_input_grad[1]:
            _linear.refuse_compiled_autograd()
        use = _linear.weight_grad_use(weight, ctx) if ctx.needs_input_grad[1] \
            else _linear.GRAD_DROPPED
        # (the update inside this backward, where a forge optimizer runs W's there; a hook on
        # W sees its whole dW)
        update = RowUpdate.begin(weight) if use == _linear.GRAD_ACCUMULATED \
            and not weight._backward_hooks else None
        w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        valid = targets != ctx.ignore_index
        scale = (grad.float() / ctx.count) * valid.float()                   # [N]
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        dw = None
        # A deferred step keeps X and the whole dY (a FactoredGrad, as for any fused Linear)
        # where they take fewer bytes than dW: its update then runs at step() from them.
        factored = None
        if use == _linear.GRAD_ACCUMULATED and update is None:
            n, d = hidden.shape
            factored = RowUpdate.deferred_factors(weight, n * (d + vocab) * hidden.element_size())
        dy_all = None
        if factored is not None:
            dy_all = torch.empty((hidden.shape[0], vocab), dtype=hidden.dtype,
                                 device=hidden.device)                      # [N, V]
        elif use != _linear.GRAD_DROPPED and update is None:
            # (W's gradient as torch's head would return it: in W's dtype, block by block)
            dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        x2 = hidden.detach()
        blocks = list(range(0, vocab, ctx.block))
        for i, v0 in enumerate(blocks):
            v1 = min(vocab, v0 + ctx.block)
            logits = x2.matmul(w[v0:v1].t()).float()
            dlogits = torch.exp(logits - lse[:, None])                      # softmax block
            inside = valid & (targets >= v0) & (targets < v1)
            rows = inside.nonzero().squeeze(1)
            dlogits[rows, targets[rows] - v0] -= 1.0
            dlogits = (dlogits * scale[:, None]).to(hidden.dtype)           # [N, v1 - v0]
            dh += dlogits.matmul(w[v0:v1]).float()  # with the block's weights before its update
            if update is not None:
                update.update(x2, dlogits, rows=(v0, v1), last=i == len(blocks) - 1)
            elif dy_all is not None:
                dy_all[:, v0:v1] = dlogits
            elif dw is not None:
                dw[v0:v1] = product(x2, dlogits, weight.dtype)
        if update is not None:
            update.finish()
        if factored is not None:
            dw = factored.linear_backward(x2, dy_all, weight, ctx)
        return dh.to(hidden.dtype), dw, None, None, None


def head_cross_entropy(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor,
                       ignore_index: int = -100, block: int = _BLOCK_ROWS) -> torch.Tensor:
    """Mean cross entropy of head(hidden) against targets, without the logits (see the file
    header). hidden: [..., D], targets: [...] (already aligned with hidden: for a causal LM,
    hidden[:, :-1] against labels[:, 1:]). head: an nn.Linear without bias."""
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError("head_cross_entropy: head must be an nn.Linear without bias")
    _refuse_sharded_head(head.weight, "head_cross_entropy")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"head_cross_entropy: hidden {list(hidden.shape)} and targets "
                         f"{list(targets.shape)} do not match")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"head_cross_entropy: block must be an int >= 1, got {block!r}")
    dtype = _linear.autocast_dtype(hidden.device.type)
    h = hidden.reshape(-1, hidden.shape[-1])
    if dtype is not None:
        h = h.to(dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        return _HeadCrossEntropy.apply(h, head.weight, targets.reshape(-1), ignore_index, block)


def _refuse_sharded_head(weight: torch.Tensor, what: str) -> None:
    """A head whose weight is a DTensor when the loss runs (tensor parallel) is refused. Under
    FSDP2 alone the loss sees the unsharded weight, a plain tensor: its dW, formed block by
    block, is what FSDP2 reduce-scatters."""
    if distributed.is_dtensor(weight):
        raise ValueError(
            f"{what}: the head's weight is a DTensor (tensor parallel), whose vocabulary blocks "
            "this loss does not shard. Compute the logits with the head and the loss with "
            "torch.distributed.tensor.parallel.loss_parallel")


def _fused_head_forward(self, input_ids=None, labels=None, **kwargs):
    """A Hugging Face *ForCausalLM forward whose loss is head_cross_entropy (no logits are
    returned when labels are given: none were formed)."""
    if labels is None:
        return self._forge_dense_forward(input_ids=input_ids, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("num_items_in_batch", None)
    out = self.model(input_ids=input_ids, **kwargs)
    hidden = out.last_hidden_state[:, :-1]
    loss = head_cross_entropy(hidden, self.lm_head, labels[:, 1:])
    return CausalLMOutputWithPast(loss=loss, logits=None)


# A bound method pickles as getattr(model, its function's __name__): named "forward", a model
# saved whole (torch.save) loads with its class's forward, the logits formed as without this
# file, and enable_fused_head on it fuses the head again. (A partial would survive pickling
# but is no method: wrappers such as accelerate's rebind model.forward.__func__.)
_fused_head_forward.__name__ = "forward"


def enable_fused_head(model: nn.Module) -> nn.Module:
    """Makes a Hugging Face *ForCausalLM (a .model and an .lm_head nn.Linear without bias)
    compute its training loss with head_cross_entropy: model(input_ids=..., labels=...).loss
    as before, the logits never formed. Calls without labels are unchanged. Returns model.
    A model saved whole (torch.save(model)) loads with its class's forward: call this again."""
    head = getattr(model, "lm_head", None)
    if getattr(model, "model", None) is None or not isinstance(head, nn.Linear) \
            or head.bias is not None:
        raise ValueError(f"enable_fused_head: {type(model).__name__} has no .model and bias-free "
                         ".lm_head nn.Linear (a Hugging Face *ForCausalLM)")
    if not distributed.is_fsdp_module(model):  # (FSDP2 swaps in a plain weight for forward)
        _refuse_sharded_head(head.weight, "enable_fused_head")
    # Already made (this file's forward, or a wrapper's around it, stays) unless the model was
    # saved whole and loaded: its forward is then its class's again
    loaded = getattr(model.__dict__.get("forward"), "__func__", None) is type(model).forward
    if "_forge_dense_forward" not in model.__dict__ or loaded:
        model._forge_dense_forward = model.forward
        model.forward = types.MethodType(_fused_head_forward, model)
    return model
