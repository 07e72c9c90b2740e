"""muon.py — Muon's whole-matrix part, which needs no libforge: which weights take Muon
(default_groups), and what Muon does to a weight once its direction is made.

libforge's Muon rule is the element-wise part alone: from each dW element (in the fused GEMM's
tile, or a gradient tensor) it advances the momentum buffer and writes the direction
u = lerp(g, m, momentum) (nesterov) or m into a bf16 matrix the size of the weight, rounded to
nearest as torch.optim.Muon's own conversion to bf16 rounds it (updater.py passes that matrix
in the weight's place). What remains needs the whole matrix: the Newton–Schulz orthogonalization
and the weight update, here, as torch.optim.Muon computes them (bf16 matmuls, then
w ← w·(1 − lr·wd) − adjusted_lr·O in the weight's dtype).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

# torch.optim.Muon's defaults
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


def newton_schulz(u: torch.Tensor, coefficients: Tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """The quintic Newton–Schulz iteration on u ([rows, cols], bf16; overwritten), as
    torch.optim.Muon runs it: on the wide orientation, after scaling by the Frobenius norm."""
    a, b, c = coefficients
    x = u.T if u.size(0) > u.size(1) else u  # [min, max]
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T                                          # [min, min]
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)   # b·A + c·A²
        x = torch.addmm(x, poly, x, beta=a)                     # a·X + (b·A + c·A²)·X
    return x.T if u.size(0) > u.size(1) else x


def adjusted_lr(lr: float, adjust_lr_fn, shape) -> float:
    """torch.optim.Muon's learning rate for a [A, B] weight."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(rows / cols)  # "spectral_unclamped"


def apply_direction(param: torch.Tensor, direction: torch.Tensor, group: Dict[str, Any],
                    lr: float, block: Optional[Tuple[int, int, int, int]] = None,
                    shape: Optional[Tuple[int, int]] = None) -> None:
    """param's Muon update from its direction ([rows, cols] bf16, consumed): orthogonalized,
    then decoupled weight decay and the step, in param's dtype as torch.optim.Muon does.

    A shard: `direction` is the whole matrix's ([shape], gathered), `param` this rank's block
    of the weight, rows [r0, r0 + rows) and columns [c0, c0 + cols) of it (block = (r0, rows,
    c0, cols)); it takes that block of the orthogonalized matrix, with the whole matrix's
    learning-rate adjustment."""
    with torch.no_grad():
        ortho = newton_schulz(direction, tuple(group["ns_coefficients"]),
                              int(group["ns_steps"]), float(group["eps"]))
        if block is not None:
            r0, rows, c0, cols = block
            ortho = ortho[r0:r0 + rows, c0:c0 + cols]               # [rows, cols] of [shape]
        param.mul_(1 - lr * float(group["weight_decay"]))
        param.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"],
                                             param.shape if shape is None else shape))


def default_groups(model: nn.Module, adamw: dict) -> list:
    """Muon's default param groups: the hidden Linear / Conv1D weights (the model's output head
    left out) with Muon, every other trainable parameter with `adamw` (its group keys)."""
    head = getattr(model, "get_output_embeddings", None)
    head = head() if callable(head) else None
    # (the head's weight, and any Linear's tied to an embedding, stay with AdamW)
    seen = {id(getattr(head, "weight", None))} | {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden = []
    for module in model.modules():
        if module is head or type(module).__name__ not in ("Linear", "Conv1D") \
                and not isinstance(module, nn.Linear):
            continue
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter) and w.requires_grad and w.dim() == 2 \
                and id(w) not in seen:
            seen.add(id(w))
            hidden.append(w)
    rest, taken = [], {id(w) for w in hidden}
    for p in model.parameters():
        if p.requires_grad and id(p) not in taken:
            taken.add(id(p))
            rest.append(p)
    groups = [dict(params=hidden, use_muon=True), dict(adamw, params=rest)]
    return [g for g in groups if g["params"]]
