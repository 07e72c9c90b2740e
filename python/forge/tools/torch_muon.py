"""torch_muon.py — the torch baseline of forge.optim.Muon: torch.optim.Muon over the weights
forge.optim.Muon gives Muon (forge.muon.default_groups) and torch.optim.AdamW over the rest, as
one torch.optim.Optimizer, so that forge-train (--baseline torch) and forge-bench (torch-muon)
drive it as they drive any optimizer: LR schedulers, state_dict(), checkpoints.

Its param_groups are the two inner optimizers' own group dicts (a scheduler's lr reaches them)
and its state is theirs, shared (state_dict() / load_state_dict() see both).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import muon


class TorchMuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon (its keyword names and defaults) for the hidden Linear weights and
    torch.optim.AdamW (adamw_*: torch's defaults) for every other parameter of `model`."""

    def __init__(self, model: nn.Module, lr=1e-3, weight_decay=0.1, momentum=0.95,
                 nesterov=True, *, adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_eps=1e-8,
                 adamw_weight_decay=1e-2, fused=None):
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"torch.optim.Muon needs torch >= 2.9 (this is {torch.__version__})")
        groups = muon.default_groups(model, dict(use_muon=False))
        hidden = [p for g in groups if g["use_muon"] for p in g["params"]]
        rest = [p for g in groups if not g["use_muon"] for p in g["params"]]
        self.inner = []
        if hidden:
            self.inner.append(torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay,
                                               momentum=momentum, nesterov=nesterov))
        if rest:
            self.inner.append(torch.optim.AdamW(rest, lr=adamw_lr, betas=adamw_betas,
                                                eps=adamw_eps, weight_decay=adamw_weight_decay,
                                                fused=fused))
        super().__init__([dict(g) for opt in self.inner for g in opt.param_groups], {})
        self._share()

    def _share(self) -> None:
        """The inner optimizers read this one's group dicts and state (after a load too)."""
        k = 0
        for opt in self.inner:
            n = len(opt.param_groups)
            opt.param_groups = self.param_groups[k:k + n]
            opt.state = self.state
            k += n

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.inner:
            opt.step()
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._share()
