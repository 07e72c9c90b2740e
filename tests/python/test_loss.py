"""test_loss.py — forge.loss: the head and its cross entropy without the logits.

head_cross_entropy equals F.cross_entropy(F.linear(hidden, W)) (loss, dX, dW) to fp32 rounding;
with a forge optimizer driving the head its update runs block by block on rows of W, which
equals the whole update bit for bit given the same dY; a Hugging Face model with
enable_fused_head() trains as it does without. Bounds: tolerances.py.
"""
import copy
import types

import pytest
import torch
import torch.nn.functional as F

import forge
import forge.loss
import forge.optim
from forge.optim.backward import RowUpdate
from forge.optim.deferred import FactoredGrad
from tolerances import HEAD_CE_RTOL, HF_LOSS_RTOL


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("block", [64, 4096])
def test_matches_linear_then_cross_entropy(block):
    torch.manual_seed(0)
    n, d, vocab = 37, 24, 301
    hidden = torch.randn(n, d, requires_grad=True)
    head = torch.nn.Linear(d, vocab, bias=False)
    targets = torch.randint(0, vocab, (n,))
    targets[[3, 17]] = -100  # ignored rows
    loss = forge.loss.head_cross_entropy(hidden, head, targets, block=block)
    loss.backward()
    got = (loss.detach(), hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    want = F.cross_entropy(F.linear(hidden, head.weight), targets)
    want.backward()
    assert abs(got[0] - want.detach()) <= HEAD_CE_RTOL * want.abs()
    assert rel(got[1], hidden.grad) <= HEAD_CE_RTOL
    assert rel(got[2], head.weight.grad) <= HEAD_CE_RTOL


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_backwards_not_accumulating_into_the_head_leave_it_alone(mode):
    """With a forge optimizer driving the head: torch.autograd.grad of the hidden states
    (nothing reaches W) updates nothing; torch.autograd.grad naming W returns dW as the
    unfused head computes it, updating nothing; then backward() updates the head as usual."""
    torch.manual_seed(0)
    n, d, vocab = 37, 24, 301
    hidden = torch.randn(n, d, requires_grad=True)
    head = torch.nn.Linear(d, vocab, bias=False)
    targets = torch.randint(0, vocab, (n,))
    opt = forge.optim.SGD(torch.nn.Sequential(head), lr=0.1, mode=mode)
    before = head.weight.detach().clone()
    (dh,) = torch.autograd.grad(forge.loss.head_cross_entropy(hidden, head, targets, block=64),
                                hidden)
    assert torch.equal(head.weight, before) and head.weight.grad is None
    (dw,) = torch.autograd.grad(forge.loss.head_cross_entropy(hidden, head, targets, block=64),
                                [head.weight])
    want = torch.autograd.grad(F.cross_entropy(F.linear(hidden, head.weight), targets),
                               [head.weight])[0]
    assert rel(dw, want) <= HEAD_CE_RTOL
    assert torch.equal(head.weight, before) and head.weight.grad is None and not opt.state
    forge.loss.head_cross_entropy(hidden, head, targets, block=64).backward()
    opt.step()
    assert rel(head.weight - before, -0.1 * want) <= HEAD_CE_RTOL


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_create_graph_through_the_head_is_refused_before_it_updates(how):
    """The head's backward takes the logits' gradient without a graph, so its gradients could
    not be differentiated: create_graph=True through it (a gradient penalty on the hidden
    states, on .grad) is refused by name, the head and its optimizer untouched."""
    torch.manual_seed(0)
    n, d, vocab = 37, 24, 301
    hidden = torch.randn(n, d, requires_grad=True)
    head = torch.nn.Linear(d, vocab, bias=False)
    targets = torch.randint(0, vocab, (n,))
    opt = forge.optim.SGD(torch.nn.Sequential(head), lr=0.1, mode="deferred")
    before = head.weight.detach().clone()
    loss = forge.loss.head_cross_entropy(hidden, head, targets, block=64)
    with pytest.raises(RuntimeError, match="head_cross_entropy's backward is not itself"):
        if how == "backward":
            loss.backward(create_graph=True)
        else:
            torch.autograd.grad(loss, hidden, create_graph=True)
    assert torch.equal(head.weight, before) and head.weight.grad is None and not opt.state


def test_bad_arguments_are_refused():
    head = torch.nn.Linear(4, 10)
    with pytest.raises(ValueError, match="without bias"):
        forge.loss.head_cross_entropy(torch.randn(3, 4), head, torch.zeros(3, dtype=torch.long))
    head = torch.nn.Linear(4, 10, bias=False)
    with pytest.raises(ValueError, match="do not match"):
        forge.loss.head_cross_entropy(torch.randn(3, 4), head, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="block"):
        forge.loss.head_cross_entropy(torch.randn(3, 4), head, torch.zeros(3, dtype=torch.long),
                                      block=0)


@pytest.mark.parametrize("dtype,state_format", [(torch.float32, "fp32"),
                                                (torch.float32, "int8"),
                                                (torch.float32, "fp8"),
                                                (torch.bfloat16, "bf16")])
def test_row_blocks_equal_the_whole_update(dtype, state_format):
    """The head's update, block by block on rows of W (what the fused loss runs through
    forge.optim's RowUpdate), is the update of the whole weight, bit for bit, given the same X
    and dY: weights, states, step."""
    if dtype == torch.bfloat16 and not hasattr(forge._lib.Param(), "row_offset"):
        pytest.skip("stochastic rounding of a row block needs forge_param.row_offset")
    torch.manual_seed(0)
    base = torch.nn.Linear(128, 200, bias=False).to(dtype)
    x = torch.randn(9, 128).to(dtype)
    dy = torch.randn(9, 200).to(dtype)
    runs = []
    for blocks in ([(0, 200)], [(0, 64), (64, 128), (128, 200)]):
        layer = copy.deepcopy(base)
        opt = forge.optim.AdamW(torch.nn.Sequential(layer), lr=1e-2, mode="immediate",
                                state_format=state_format)
        for step in range(2):
            update = RowUpdate.begin(layer.weight)
            for i, (r0, r1) in enumerate(blocks):
                block_dy = dy[:, r0:r1].contiguous()
                update.update(x, block_dy, rows=None if len(blocks) == 1 else (r0, r1),
                              last=i == len(blocks) - 1)
            opt.step()
        st = opt.state[layer.weight]
        runs.append((layer.weight.detach().clone(),
                     {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}, st["step"]))
    (w_a, s_a, n_a), (w_b, s_b, n_b) = runs
    assert torch.equal(w_a, w_b) and n_a == n_b == 2
    assert all(torch.equal(s_a[k], s_b[k]) for k in s_a)


@pytest.mark.parametrize("dtype,state_format", [(torch.float32, "fp32"),
                                                (torch.bfloat16, "bf16")])
def test_a_deferred_step_keeps_the_heads_factors_and_updates_as_immediate(dtype, state_format):
    """A deferred step keeps the head's hidden states and whole logits' gradient as any fused
    Linear's X and dY (a FactoredGrad; here they take fewer bytes than dW), not dW: its update
    at step() is the immediate mode's, block by block, bit for bit. Where they would take
    more bytes, the head keeps dW."""
    if dtype == torch.bfloat16 and not hasattr(forge._lib.Param(), "row_offset"):
        pytest.skip("stochastic rounding of a row block needs forge_param.row_offset")
    torch.manual_seed(0)
    n, d, vocab = 37, 256, 301  # n·(d + vocab) < vocab·d
    hidden = torch.randn(n, d).to(dtype).requires_grad_()
    base = torch.nn.Linear(d, vocab, bias=False).to(dtype)
    targets = torch.randint(0, vocab, (n,))
    targets[5] = -100
    weights = {}
    for mode in ("immediate", "deferred"):
        head = copy.deepcopy(base)
        opt = forge.optim.AdamW(torch.nn.Sequential(head), lr=1e-2, mode=mode,
                                state_format=state_format)
        for _ in range(2):
            forge.loss.head_cross_entropy(hidden, head, targets, block=64).backward()
            if mode == "deferred":
                grad = head.weight.grad
                assert isinstance(grad, FactoredGrad) and grad.dense is None
                assert [tuple(x.shape) + tuple(dy.shape) for x, dy in grad.parts] == \
                    [(n, d, n, vocab)]
            opt.step()
            opt.zero_grad()
        weights[mode] = head.weight.detach().clone()
    assert torch.equal(weights["immediate"], weights["deferred"])
    narrow = torch.nn.Linear(8, vocab, bias=False).to(dtype)  # n·(8 + vocab) > vocab·8
    opt = forge.optim.AdamW(torch.nn.Sequential(narrow), lr=1e-2, mode="deferred")
    forge.loss.head_cross_entropy(torch.randn(n, 8).to(dtype), narrow, targets,
                                  block=64).backward()
    grad = narrow.weight.grad
    assert isinstance(grad, FactoredGrad) and grad.dense is not None and not grad.parts


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_hf_model_with_fused_head_trains_as_without(mode, record_difference):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 5] = -100
    losses = {}
    for fused in (False, True):
        model = copy.deepcopy(base)
        if fused:
            forge.loss.enable_fused_head(model)
        opt = forge.optim.AdamW(model, lr=1e-3, mode=mode)
        losses[fused] = []
        for _ in range(5):
            out = model(input_ids=ids, labels=labels)
            assert (out.logits is None) == fused
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses[fused].append(out.loss.item())
        if fused:
            assert model(input_ids=ids).logits.shape == (2, 16, 300)  # no labels: as before
    worst = max(abs(a - b) / b for a, b in zip(losses[True], losses[False]))
    record_difference(f"fused head loss ({mode})", worst)
    assert worst <= HF_LOSS_RTOL["float32"], losses
    assert losses[True][-1] < losses[True][0]


def test_a_model_saved_whole_loads_with_its_own_head_and_fuses_again(tmp_path):
    """torch.save(model) with the fused head: the file loads (its forward is the class's,
    the logits formed as without forge.loss); enable_fused_head on it fuses again, once. A
    forward another library set on the instance before is fused over, as ever."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = forge.loss.enable_fused_head(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    fused = model(input_ids=ids, labels=ids)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    plain = loaded(input_ids=ids, labels=ids)
    assert plain.logits is not None
    assert rel(plain.loss, fused.loss) <= HEAD_CE_RTOL
    forge.loss.enable_fused_head(loaded)
    dense = loaded._forge_dense_forward
    forge.loss.enable_fused_head(loaded)  # again: nothing changes
    assert loaded._forge_dense_forward == dense and dense.__func__ is type(loaded).forward
    again = loaded(input_ids=ids, labels=ids)
    assert again.logits is None and torch.equal(again.loss, fused.loss)
    # a forward another library set on the instance first (accelerate's wrapper) is fused over
    wrapped = transformers.LlamaForCausalLM(config)
    wrapped.forward = types.MethodType(lambda self, **kw: type(self).forward(self, **kw), wrapped)
    forge.loss.enable_fused_head(wrapped)
    assert wrapped(input_ids=ids, labels=ids).logits is None
