"""GPT-2 with forge.optim.AdamW: its linear layers are transformers' Conv1D (y = x·W + b,
W stored [in, out]: a transposed nn.Linear), and FORGE fuses them like nn.Linear — the
update of every attention and MLP weight runs inside the weight-gradient GEMM of backward,
and no weight gradient is ever allocated. opt.summary() says which parameters are fused and
why the others are not (biases and LayerNorms are element-wise by nature, the embedding
tied to lm_head waits for opt.step()).

    python examples/gpt2.py        # a tiny GPT-2 built from its config (no download), CPU

The loop is the plain torch one: forge.optim.AdamW is a torch.optim.Optimizer.
"""
import logging
import warnings

import torch
import transformers

import forge

VOCAB, SEQ = 256, 32


def tiny_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 from a config (no download). Dropout off: two runs of the same
    steps then see the same computation (the test compares forge with torch.optim)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def batch(step: int, batch_size: int = 4) -> torch.Tensor:
    """Token ids [batch, SEQ] of a toy language: each row counts up from a random start
    (mod VOCAB), so the next token is predictable and the loss visibly falls."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB


def train(model, opt, steps: int, log=None) -> list:
    """The usual loop; returns the loss of each step."""
    model.train()
    losses = []
    for step in range(steps):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()       # the Conv1D weights are updated here, tile by tile
        opt.step()            # biases, LayerNorms, the tied embedding; bookkeeping
        opt.zero_grad()
        losses.append(loss.item())
        if log is not None:
            log(step, loss.item())
    return losses


def make_optimizer(model) -> forge.optim.AdamW:
    with warnings.catch_warnings():
        # GPT-2 ties lm_head to the token embedding; forge warns that it takes the
        # materialized-gradient path (its full gradient, applied in opt.step())
        warnings.filterwarnings("ignore", message="forge: parameters used in more than one")
        return forge.optim.AdamW(model, lr=3e-3, weight_decay=0.1)


def main(steps: int = 20) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # forge's INFO line
    transformers.logging.set_verbosity_error()
    model = tiny_gpt2()
    opt = make_optimizer(model)
    print(opt.summary())
    train(model, opt, steps, log=lambda step, loss: print(f"step {step:3d}  loss {loss:.4f}"))


if __name__ == "__main__":
    main()
