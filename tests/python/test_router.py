"""test_router.py — forge/optim/routing.py and slot.py on their own: which path each parameter
takes, what attaching changes on the model (patched forwards, hooks, owners) and what detaching
gives back, and the slot's own bookkeeping (its key, its stand-in, the sum of several uses).
The Router is driven here with a stub for the parts its hooks would call.
"""
import gc
import warnings

import pytest
import torch
import torch.nn as nn

import forge
import forge.optim
from forge import _linear, _ops
from forge.optim import routing
from forge.optim.routing import Router, owner_of, parameter_names
from forge.optim.shared import Shared
from forge.optim.slot import Slot


class _Backward:
    """The Router's view of backward.py's part: the hooks call it, detach settles it."""

    def __init__(self, shared):
        self.shared = shared
        self.settled = 0

    def settle_all(self):
        self.settled += 1


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # (tied: one parameter under two names)
        self.scale = nn.Parameter(torch.ones(8, 8))  # (a 2-d parameter read in forward)

    def forward(self, tokens):
        return self.head(self.fc(self.emb(tokens)) @ self.scale)


def _router(model, params=None):
    params = list(model.parameters()) if params is None else params
    shared = Shared("auto", deferring=True)
    shared.param_groups = [{"params": params}]
    backward = _Backward(shared)
    router = Router(shared, forge.library(), backward, modes=None, torch_name="Test",
                    distributed_=False)
    return router, shared, backward, params


def _attach(model, params=None):
    router, shared, backward, params = _router(model, params)
    names = parameter_names(model)
    router.check_params(model, params, names)
    shared.attached = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        router.attach(model, params, names)
    return router, shared, backward, caught


def test_each_parameter_takes_its_path_and_says_why():
    model = _Net()
    router, shared, backward, caught = _attach(model)
    paths = {s.name: (s.mode, s.reason) for s in shared.slots.values()}
    assert paths["fc.weight"] == ("fused", "nn.Linear weight")
    assert paths["fc.bias"][0] == "batched"
    assert paths["emb.weight"] == ("deferred", "shared/tied (one parameter under several names)")
    assert paths["frozen.weight"][0] == "deferred"
    assert paths["frozen.weight"][1].startswith("frozen")
    assert paths["scale"][0] == "batched" and "outside nn.Linear" in paths["scale"][1]
    assert any("emb.weight = head.weight" in str(w.message) for w in caught)
    assert all(s.live and s.is_live() for s in shared.slots.values())
    router.detach()


def test_attach_patches_and_hooks_and_detach_gives_it_all_back():
    model = _Net()
    before = model.fc.forward
    router, shared, backward, _ = _attach(model)
    fc = shared.slots[id(model.fc.weight)]
    assert "forward" in model.fc.__dict__ and _linear.slot_of(model.fc.weight) is fc
    assert owner_of(model.fc.weight) is backward
    assert fc.acc_node is not None and (fc.record is not None or len(fc.handles) == 2)
    router.detach()
    assert "forward" not in model.fc.__dict__ and model.fc.forward == before
    assert owner_of(model.fc.weight) is None and _linear.slot_of(model.fc.weight) is None
    assert not fc.live and fc.record is None and not fc.handles and fc.acc_node is None
    assert not shared.attached and backward.settled == 1
    router.detach()  # (twice: nothing more)
    assert backward.settled == 1


def test_without_the_hooks_every_parameter_waits_for_step(monkeypatch):
    monkeypatch.setattr(routing, "_FORCE_NO_HOOKS", True)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    router, shared, _, _ = _attach(model)
    assert {s.mode for s in shared.slots.values()} == {"deferred"}
    router.detach()


def test_check_params_refuses_by_name():
    model = _Net()
    router, _, _, _ = _router(model)
    names = parameter_names(model)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        router.check_params(model, [nn.Parameter(torch.zeros(3))], names)
    sparse = nn.Sequential(nn.Embedding(4, 4, sparse=True))
    with pytest.raises(ValueError, match="sparse gradients"):
        router.check_params(sparse, list(sparse.parameters()), parameter_names(sparse))
    with pytest.warns(UserWarning, match="more than one place"):
        opt = forge.optim.SGD(model, lr=0.1)  # (a live optimizer drives them now)
    with pytest.raises(ValueError, match="already driven by another forge optimizer"):
        router.check_params(model, list(model.parameters()), names)
    del opt
    gc.collect()
    router.check_params(model, list(model.parameters()), names)


def test_keys_are_never_reused_and_go_with_their_slot():
    """forge::wgrad_hand_off finds a slot by its key (_ops.slot_of_key): every slot its own,
    held weakly, and never a key given before."""
    backward = _Backward(None)
    params = [nn.Parameter(torch.zeros(2, 2)) for _ in range(3)]
    slots = [Slot(backward, p, i, [f"p{i}"], "fused") for i, p in enumerate(params)]
    keys = [s.key for s in slots]
    assert len(set(keys)) == 3 and all(_ops.slot_of_key(k) is s for k, s in zip(keys, slots))
    del slots
    gc.collect()
    assert all(_ops.slot_of_key(k) is None for k in keys)
    assert Slot(backward, params[0], 0, ["p0"], "fused").key > max(keys)


def test_a_slot_is_live_only_while_attached_and_its_backward_exists():
    backward = _Backward(None)
    slot = Slot(backward, nn.Parameter(torch.zeros(2)), 0, ["p"], "hook")
    assert not slot.is_live()
    slot.live = True
    assert slot.is_live()
    del backward
    gc.collect()
    assert not slot.is_live()


def test_the_stand_in_is_made_once_and_costs_no_memory():
    w = nn.Parameter(torch.zeros(64, 32))
    slot = Slot(_Backward(None), w, 0, ["w"], "fused")
    stand_in = slot.stand_in_for(w)
    assert stand_in.shape == w.shape and stand_in.stride() == (0, 0)
    assert slot.stand_in_for(w) is stand_in
    assert slot.stand_in_for(w.detach().double()) is not stand_in  # (the weight moved)


def test_several_uses_sum_in_fp32():
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(3, 4))
    slot = Slot(_Backward(None), w, 0, ["w"], "fused")
    xs, dys = [torch.randn(5, 4) for _ in range(3)], [torch.randn(5, 3) for _ in range(3)]
    slot.pending.append((xs[0], 4, dys[0], 3, None, None))
    slot.add_use(xs[1], dys[1])
    slot.add_use(xs[2], dys[2])
    outside = torch.randn(3, 4)
    want = sum(dy.t() @ x for x, dy in zip(xs, dys)) + outside
    assert not slot.pending and slot.partial.dtype == torch.float32
    assert torch.allclose(slot.summed_grad(outside), want, rtol=1e-5, atol=1e-6)
    slot.clear_backward()
    assert slot.partial is None and slot.summed_grad(outside) is not None
