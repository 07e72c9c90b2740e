"""test_inspect.py — opt.inspect() (forge/optim/summary.py): what opt.summary() reports, as data.

A snapshot of every parameter of the param groups, in their order, indexable by name (any of a
shared parameter's) or by the parameter; read-only; the text summary is rendered from it.
"""
import dataclasses

import pytest
import torch
import torch.nn as nn

import forge.optim

from tiny_models import TinyTransformer, lm_loss


def test_every_parameter_in_param_groups_order():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, mode="immediate",
                            params=forge.optim.param_groups_no_decay(model, 0.1))
    info = opt.inspect()
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(info) == len(params) and [p.param for p in info] == params
    assert [p.index for p in info] == list(range(len(params)))
    assert (info.optimizer, info.model, info.mode, info.requested_mode, info.step) == (
        "AdamW", "TinyTransformer", "immediate", "immediate", 0)


def test_indexed_by_name_or_by_parameter():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = forge.optim.SGD(model, lr=0.1)
    info = opt.inspect()
    assert info["0.weight"] is info[model[0].weight]
    assert (info["0.weight"].path, info["0.weight"].layer) == ("fused", "Linear")
    assert (info["0.bias"].path, info["0.bias"].layer) == ("batched", None)
    with pytest.raises(KeyError):
        info["nope"]
    with pytest.raises(KeyError):
        info[torch.zeros(1)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        info["0.weight"].path = "hook"


def test_a_step_as_the_view_sees_it():
    """Before states: the format the group asks for and no step; after a backward in immediate
    mode the fused weights' updates ran (by the C++ pre-hook or Python); after step() every
    parameter has counted one."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2, mode="immediate", state_format="int8",
                            min_8bit_size=1024)
    info = opt.inspect()
    big = [p for p in info if p.nbytes >= 4 * 1024]
    assert big and all(p.state_format == "int8" and p.step == 0 for p in big)
    assert all(p.state_format == "fp32" for p in info if p.nbytes < 4 * 1024)
    for step in range(2):
        lm_loss(model, step).backward()
        info = opt.inspect()
        fused = [p for p in info if p.path == "fused"]
        assert fused and all(p.updated_this_step and not p.waiting for p in fused)
        assert not any(p.updated_this_step for p in info if p.path == "batched")  # (at step())
        opt.step()
        opt.zero_grad()
    info = opt.inspect()
    assert info.step == 2 and all(p.step == 2 for p in info)
    assert not any(p.updated_this_step for p in info)
    assert all(p.state_bytes > 0 for p in info)


def test_shared_and_frozen_parameters():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

    model = Tied()
    with pytest.warns(UserWarning, match="more than one place"):
        opt = forge.optim.AdamW(model, params=list(model.parameters()))
    info = opt.inspect()
    assert info["out.weight"] is info["emb.weight"]
    assert info["emb.weight"].names == ("emb.weight", "out.weight")
    assert info["emb.weight"].path == "deferred" and not info["emb.weight"].frozen
    assert info["frozen.weight"].frozen and info["frozen.weight"].state_format is None


def test_the_summary_is_the_inspection_in_words():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, lr=1e-2)
    info = opt.inspect()
    text = opt.summary()
    fused = [p for p in info if p.path == "fused"]
    batched = [p for p in info if p.path == "batched"]
    assert f"{len(info)} parameters in its param groups, mode='auto'" in text
    assert f"fused into the weight-gradient GEMM (no gradient is ever allocated): " \
           f"{len(fused)} parameters" in text
    assert f"one call: {len(batched)} parameters" in text
    hooks = "C++" if all(p.cpp_prehook for p in fused) else "Python"
    assert (f"the C++ pre-hook for {len(fused)}" in text) == (hooks == "C++")
