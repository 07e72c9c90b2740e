"""dist_worker.py — what each rank of test_distributed.py and test_distributed_cuda.py runs.

run(rank, world, out_dir, port, jobs) is one process of a gloo process group on the CPU (what
test_distributed.py spawns); run_threads(world, out_dir, jobs, device) runs every rank as a
thread of the calling process on torch's threaded process group (test_distributed_cuda.py:
several ranks on one GPU). Either initializes the group, runs the jobs' checks and writes one
JSON file per rank into out_dir: {"ok": bool, "error": str | None, "measured": {...}}. The test
process reads the files and asserts; every check that can fail here raises. A process rank's
stderr goes to rank<r>.log there, which the test prints if a rank dies.

device: where the model, its batches, the optimizer states and the collectives' tensors are,
"cpu" or "cuda". On "cuda" every rank uses cuda:0, and torch's kernels are deterministic, as the
resumed checkpoint's bit-exact continuation needs.

Model: a small Llama-style decoder (embedding, RMSNorm, attention q/k/v/o, SwiGLU gate/up/down,
final norm, untied head), written so that tensor parallel only shards heads and features:
the attention works on whatever heads this rank holds. Dimensions are multiples of
64 · world so int8 blocks never straddle a shard.
"""
from __future__ import annotations

import copy
import datetime
import faulthandler
import json
import os
import sys
import threading
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

VOCAB, HEADS, SEQ, BATCH, LAYERS = 128, 4, 8, 4, 1
COLLECTIVE_TIMEOUT_S = 300  # a whole spawn takes 10-30 s on 2 busy cores
DIM, FFN = 128, 256  # set_dims: 256, 512 where int8 column shards of 4 ranks need 64 columns
SKIP_MLP = False
DEVICE = "cpu"  # (run_threads sets it: the model, batches and device meshes of every job)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.01 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        hd = DIM // HEADS
        q, k, v = (f(x).view(b, t, -1, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, FFN, bias=False)
        self.up = nn.Linear(DIM, FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(DIM), Attention()
        self.mlp_norm, self.mlp = RMSNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        if SKIP_MLP:  # (a branch a step's backward does not reach: job_loops)
            return x
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.fused_head = False  # True: forward(tokens, targets) is forge.loss's fused loss

    def forward(self, tokens, targets=None):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        if self.fused_head:
            import forge.loss
            return forge.loss.head_cross_entropy(self.norm(x), self.head, targets)
        return self.head(self.norm(x))


def set_dims(dim: int, ffn: int) -> None:
    global DIM, FFN
    DIM, FFN = dim, ffn


_MAKE_MODEL = threading.Lock()  # (ranks that are threads share torch's global generator)


def make_model() -> Decoder:
    with _MAKE_MODEL:
        torch.manual_seed(0)
        model = Decoder()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(0.5)
    return model.to(DEVICE)  # (made on the CPU: the same weights on every device)


def batch(step: int, rows: slice = slice(None), order=None):
    """Step's batch (its `rows`); order: a permutation of those rows (the same loss, summed in
    another order)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)[rows]
    if order is not None:
        tokens = tokens[order]
    tokens = tokens.to(DEVICE)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, step: int, rows: slice = slice(None), order=None):
    x, y = batch(step, rows, order)
    if getattr(model, "fused_head", False):
        return model(x, y)
    logits = model(x)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def tp_plan(sp: bool):
    from forge.optim.distributed import Replicate, Shard  # (torch 2.4 keeps them elsewhere)
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)
    seq = Shard(1) if sp else Replicate()
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": SequenceParallel() if sp else None,
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    for i in range(LAYERS):
        p = f"layers.{i}."
        plan.update({
            p + "attn_norm": SequenceParallel() if sp else None,
            p + "mlp_norm": SequenceParallel() if sp else None,
            p + "attn.q": ColwiseParallel(input_layouts=seq),
            p + "attn.k": ColwiseParallel(input_layouts=seq),
            p + "attn.v": ColwiseParallel(input_layouts=seq),
            p + "attn.o": RowwiseParallel(output_layouts=seq),
            p + "mlp.gate": ColwiseParallel(input_layouts=seq),
            p + "mlp.up": ColwiseParallel(input_layouts=seq),
            p + "mlp.down": RowwiseParallel(output_layouts=seq)})
    return {k: v for k, v in plan.items() if v is not None}


def parallelize(model, mesh, sp: bool):
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(model, mesh, tp_plan(sp))


def fsdp(model, mesh):
    """FSDP2 over mesh: a unit per layer (where the model has layers) and the root."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    for layer in getattr(model, "layers", ()):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def normwise(a, b) -> float:
    a, b = (full(t).detach().to("cpu", torch.float64) for t in (a, b))
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def max_normwise(model_a, model_b) -> float:
    return max(normwise(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))


def train(model, opt, steps, rows=slice(None), start=0, order=None):
    norms = []
    for step in range(start, start + steps):
        loss_of(model, step, rows, order).backward()
        opt.step()
        opt.zero_grad()
        norms.append(getattr(opt, "grad_norm", None))
    return norms


# Muon's references (job_tp, job_fsdp): single-process FORGE on the whole batch with its rows
# permuted, so many runs (tolerances.py, MUON_SUM_ORDER_FACTOR: the orthogonalized update
# carries any rounding difference everywhere, so the sharded run is held to the spread of runs
# that differ only in summation order).
MUON_REORDERINGS = 3


def muon_runs(base, make_forge, steps):
    """(forge on one process, the largest distance from it of MUON_REORDERINGS runs on
    reordered batch rows, its grad norms)."""
    runs = []
    for k in range(MUON_REORDERINGS + 1):
        model = copy.deepcopy(base)
        order = None if k == 0 else torch.randperm(
            BATCH, generator=torch.Generator().manual_seed(k))
        norms = train(model, make_forge(model), steps, order=order)
        runs.append((model, norms))
    own = max(max_normwise(m, runs[0][0]) for m, _ in runs[1:])
    return runs[0][0], own, runs[0][1]


def reference_optimizer(name, params, **kwargs):
    """torch.optim's optimizer (reference.py) with its per-parameter loop, what it runs on the
    CPU by default: on CUDA its default foreach step refuses a list mixing DTensor and plain
    parameters (a model whose norms the plan leaves unsharded)."""
    from reference import torch_optimizer
    if name != "Lion":
        kwargs.setdefault("foreach", False)
    return torch_optimizer(name, params, **kwargs)


# ---------------------------------------------------------------------------- jobs

def job_tp(rank, world, args):
    """Tensor (and sequence) parallel: forge tracks single-process forge within what torch
    itself moves between the same parallel and single-process runs; its statistics are
    global."""
    import forge.optim
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(DEVICE, (world,))
    measured = {}
    for case in args["cases"]:
        name, kwargs, forge_kw, sp = case["name"], case["kwargs"], case["forge"], case["sp"]
        base = make_model()
        if name == "Muon":
            model = copy.deepcopy(base)
            parallelize(model, mesh, sp)
            opt = forge.optim.Muon(model, **kwargs, **forge_kw)
            norms = train(model, opt, args["steps"])
            one, own, one_norms = muon_runs(
                base, lambda m: forge.optim.Muon(m, **kwargs, **forge_kw), args["steps"])
            # (the first step's norm: the weights have been the same until then)
            measured[case["id"]] = {"forge_tp_vs_1": max_normwise(model, one),
                                    "reordered_vs_1": own,
                                    "grad_norm_rel": abs(norms[0] - one_norms[0]) / one_norms[0],
                                    "nonfinite": opt.nonfinite_count}
            continue
        runs = {}
        for key in ("forge_tp", "forge_1", "torch_tp", "torch_1"):
            model = copy.deepcopy(base)
            if key.endswith("tp"):
                parallelize(model, mesh, sp)
            if key.startswith("forge"):
                opt = getattr(forge.optim, name)(model, **kwargs, **forge_kw)
            else:
                opt = reference_optimizer(name, model.parameters(), **kwargs)
            norms = train(model, opt, args["steps"])
            runs[key] = (model, norms, getattr(opt, "nonfinite_count", None))
        forge_error = max_normwise(runs["forge_tp"][0], runs["forge_1"][0])
        torch_error = max_normwise(runs["torch_tp"][0], runs["torch_1"][0])
        norm_error = max(abs(a - b) / b for a, b in zip(runs["forge_tp"][1], runs["forge_1"][1]))
        measured[case["id"]] = {"forge_tp_vs_1": forge_error, "torch_tp_vs_1": torch_error,
                                "grad_norm_rel": norm_error,
                                "nonfinite": runs["forge_tp"][2]}
    return measured


def job_fsdp(rank, world, args):
    """FSDP2: each rank trains on its rows of the batch; the update runs on the shard after
    the reduce-scatter. forge tracks single-process forge on the whole batch within what
    torch FSDP2 moves against single-process torch."""
    import forge.optim
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(DEVICE, (world,))
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    measured = {}
    for case in args["cases"]:
        name, kwargs, forge_kw = case["name"], case["kwargs"], case["forge"]
        base = make_model()
        if name == "Muon":
            model = copy.deepcopy(base)
            fsdp(model, mesh)
            norms = train(model, forge.optim.Muon(model, **kwargs, **forge_kw), args["steps"],
                          rows)
            one, own, one_norms = muon_runs(
                base, lambda m: forge.optim.Muon(m, **kwargs, **forge_kw), args["steps"])
            measured[case["id"]] = {"forge_fsdp_vs_1": max_normwise(model, one),
                                    "reordered_vs_1": own,
                                    "grad_norm_rel": abs(norms[0] - one_norms[0]) / one_norms[0]}
            continue
        runs = {}
        for key in ("forge_fsdp", "forge_1", "torch_fsdp", "torch_1"):
            model = copy.deepcopy(base)
            if key.endswith("fsdp"):
                fsdp(model, mesh)
            if key.startswith("forge"):
                opt = getattr(forge.optim, name)(model, **kwargs, **forge_kw)
            else:
                opt = reference_optimizer(name, model.parameters(), **kwargs)
            norms = train(model, opt, args["steps"], rows if key.endswith("fsdp") else
                          slice(None))
            runs[key] = (model, norms)
        measured[case["id"]] = {
            "forge_fsdp_vs_1": max_normwise(runs["forge_fsdp"][0], runs["forge_1"][0]),
            "torch_fsdp_vs_1": max_normwise(runs["torch_fsdp"][0], runs["torch_1"][0]),
            "grad_norm_rel": max(abs(a - b) / b for a, b in
                                 zip(runs["forge_fsdp"][1], runs["forge_1"][1]))}
    return measured


# The loops of job_loops: after each step opt.zero_grad(set_to_none=False) or
# model.zero_grad(set_to_none=False), leaving the MLP out of every other step ("opt_zeros",
# "model_zeros"); opt.zero_grad() after every step but the first ("missed_zero_grad");
# clip_grad_norm_ before each step ("clip"; FSDP2, and tensor parallel with sequence parallel
# ("tp_sp"): plain tensor parallel leaves the norms plain tensors, which torch's
# clip_grad_norm_ refuses to mix with DTensors); two micro-batches a step ("accumulate"); a
# tensor hook clamping one fused weight's gradient ("hook": FSDP2's sharded parameter is
# outside autograd's graph, so the hook never runs, with torch.optim as with forge); an L2
# penalty on one fused weight, a use outside its Linear ("penalty"; tensor parallel only:
# FSDP2 swaps the parameters a forward sees).
LOOPS = ("opt_zeros", "model_zeros", "missed_zero_grad", "clip", "accumulate", "hook",
         "penalty")
# (setup, loop, forge mode) of job_loops; immediate mode refuses a clip or a second backward
# by name, in one process as on shards
LOOP_CASES = [(setup, loop, mode) for setup in ("tp", "tp_sp", "fsdp") for loop in LOOPS
              for mode in ("immediate", "deferred", "auto")
              if {"tp": loop != "clip", "tp_sp": loop == "clip", "fsdp": loop != "penalty"}[setup]
              and not (loop in ("clip", "accumulate") and mode == "immediate")]


def job_loops(rank, world, args):
    """The training loops users have, on shards (tensor parallel, FSDP2), as in one process:
    gradients zeroed keeping them step what a step's backward left out on zeros, as
    torch.optim does; a loop that never zeroes them is refused at the next backward with
    weights, states and step counts unchanged, and goes on once it zeroes them; clipping and
    micro-batches match. Each forge run is measured against torch.optim on the same sharding,
    with what torch itself moves between that sharding and one process as the allowance."""
    import forge.optim
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(DEVICE, (world,))
    steps = args["steps"]

    def run(setup, make_opt, loop, refuse_at=None):
        global SKIP_MLP
        model = make_model()
        rows = slice(None)
        if setup in ("tp", "tp_sp"):
            parallelize(model, mesh, sp=setup == "tp_sp")
        elif setup == "fsdp":
            fsdp(model, mesh)
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        weight = model.layers[0].mlp.up.weight  # (a fused weight, the hook's or the penalty's)
        if loop == "hook":
            weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        opt = make_opt(model)
        refusal = None
        micro = 2 if loop == "accumulate" else 1
        for step in range(steps):
            SKIP_MLP = loop.endswith("_zeros") and step % 2 == 1
            if step == refuse_at:  # (the loop left out zero_grad after the last step)
                before = snapshot(opt)
                try:
                    loss_of(model, step, rows).backward()
                    refusal = "not refused"
                except RuntimeError as e:
                    refusal = str(e)
                after = snapshot(opt)
                refusal = (refusal, len(before) == len(after) and all(
                    torch.equal(a, b) for a, b in zip(before, after)))
                opt.zero_grad()
            for m in range(micro):
                loss = loss_of(model, micro * step + m, rows) / micro
                if loop == "penalty":
                    loss = loss + 0.1 * full(weight.square().sum())
                loss.backward()
            SKIP_MLP = False
            if loop == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # (every step clips)
            opt.step()
            if loop == "opt_zeros":
                opt.zero_grad(set_to_none=False)
            elif loop == "model_zeros":
                model.zero_grad(set_to_none=False)
            elif loop != "missed_zero_grad" or step + 1 != refuse_at:
                opt.zero_grad()
        return model, refusal, getattr(opt, "mode", None)

    def snapshot(opt):
        """Every parameter, state and step count of opt, as full tensors (collective; the
        parameters as the optimizer holds them: FSDP2 swaps the module's own during a
        forward and backward)."""
        params = [p for g in opt.param_groups for p in g["params"]]
        return [full(p).detach().clone() for p in params] + [
            full(v).detach().clone() if torch.is_tensor(v) else torch.tensor(v)
            for p in params for _, v in sorted(opt.state[p].items())]

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    measured, torch_runs = {}, {}
    for setup, loop, mode in LOOP_CASES:
        if (setup, loop) not in torch_runs:
            torch_run, _, _ = run(setup, adamw, loop)
            torch_1, _, _ = run("one process", adamw, loop)
            torch_runs[setup, loop] = (torch_run, max_normwise(torch_run, torch_1))
        torch_run, allowance = torch_runs[setup, loop]
        forge_run, refusal, mode_after = run(setup, lambda m: forge.optim.AdamW(
            m, lr=1e-2, weight_decay=0.1, mode=mode), loop,
            refuse_at=1 if loop == "missed_zero_grad" else None)
        measured[f"{setup}-{loop}-{mode}"] = {
            "forge_vs_torch": max_normwise(forge_run, torch_run),
            "torch_vs_1": allowance, "refusal": refusal, "mode_after": mode_after}
    return measured


def job_fsdp_head(rank, world, args):
    """FSDP2 with forge.loss's fused head (no logits): the loss sees the unsharded head weight,
    whose dW it forms block by block for FSDP2's reduce-scatter. forge on FSDP2 with the fused
    head tracks single-process forge with the fused head (its head updated block by block in
    backward) within what torch FSDP2 moves against single-process torch (plain head). And
    enable_fused_head takes an FSDP2 model whose head weight is a DTensor between steps."""
    import forge.loss
    import forge.optim
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(DEVICE, (world,))
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    base = make_model()
    runs = {}
    for key in ("forge_fsdp", "forge_1", "torch_fsdp", "torch_1"):
        model = copy.deepcopy(base)
        model.fused_head = key.startswith("forge")
        if key.endswith("fsdp"):
            fsdp(model, mesh)
        opt = (forge.optim.AdamW(model, **kwargs) if key.startswith("forge")
               else reference_optimizer("AdamW", model.parameters(), **kwargs))
        train(model, opt, args["steps"], rows if key.endswith("fsdp") else slice(None))
        runs[key] = model
    causal_lm = nn.Module()
    causal_lm.model = nn.Identity()
    causal_lm.lm_head = nn.Linear(DIM, VOCAB, bias=False, device=DEVICE)
    fsdp_lm = fsdp(causal_lm, mesh)
    try:
        forge.loss.enable_fused_head(fsdp_lm)
        enabled = "enabled"
    except ValueError as e:
        enabled = str(e)
    return {"forge_fsdp_vs_1": max_normwise(runs["forge_fsdp"], runs["forge_1"]),
            "torch_fsdp_vs_1": max_normwise(runs["torch_fsdp"], runs["torch_1"]),
            "head_is_dtensor": bool(hasattr(fsdp_lm.lm_head.weight, "full_tensor")),
            "enable_fused_head": enabled}


def job_head(rank, world, args):
    """forge.loss's chunked head refuses a tensor-parallel head by name, before anything runs."""
    import forge.loss
    from torch.distributed.device_mesh import init_device_mesh
    model = make_model()
    parallelize(model, init_device_mesh(DEVICE, (world,)), sp=False)
    causal_lm = nn.Module()
    causal_lm.model, causal_lm.lm_head = nn.Identity(), model.head
    refusals = {}
    for what, call in (
            ("head_cross_entropy", lambda: forge.loss.head_cross_entropy(
                torch.randn(2, DIM, device=DEVICE), model.head,
                torch.zeros(2, dtype=torch.long, device=DEVICE))),
            ("enable_fused_head", lambda: forge.loss.enable_fused_head(causal_lm))):
        try:
            call()
            refusals[what] = "not refused"
        except ValueError as e:
            refusals[what] = str(e)
    return refusals


def job_ddp(rank, world, args):
    """DDP is refused before any weight changes, however the optimizer meets the model."""
    import forge.optim
    from torch.nn.parallel import DistributedDataParallel as DDP
    results = {}
    # 1. the optimizer given the DDP wrapper
    model = make_model()
    try:
        forge.optim.AdamW(DDP(model))
        results["wrapper"] = "accepted"
    except ValueError as e:
        results["wrapper"] = str(e)
    # 2. given the module a DDP wraps
    model = make_model()
    ddp = DDP(model)
    try:
        forge.optim.AdamW(model)
        results["inner"] = "accepted"
    except ValueError as e:
        results["inner"] = str(e)
    del ddp
    # 3. DDP made after the optimizer: refused at the model's forward (before backward starts
    # DDP's all-reduces), nothing changed
    model = make_model()
    opt = forge.optim.AdamW(model, mode="immediate")
    ddp = DDP(model)
    before = [p.detach().clone() for p in model.parameters()]
    results["later_at"] = "forward"
    try:
        loss = loss_of(ddp, 0, slice(rank, rank + 1))
        results["later_at"] = "backward"
        loss.backward()
        opt.step()
        results["later"] = "accepted"
    except ValueError as e:
        results["later"] = str(e)
    results["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return results


def full_states(model, opt):
    """Every state of opt as full tensors on the CPU (collective), keyed by parameter name and
    state."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}.{k}": full(v).detach().to("cpu", copy=True)
            for p, st in opt.state.items()
            for k, v in st.items() if torch.is_tensor(v)} | {
        f"{names[id(p)]}.step": torch.tensor(st["step"]) for p, st in opt.state.items()}


def _dcp_options(args):
    """get_state_dict's options: args["flatten"] flattens the optimizer's dict (torchtitan's
    way: each param group's values under every one of its parameters' names)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=args.get("flatten", False))


def job_dcp_save(rank, world, args):
    """Tensor parallel over `world` ranks, int8 states (args["state_format"]: another block
    format; args["max_grad_norm"]: immediate mode's lagged clipping, whose norm the saved param
    groups carry; args["flatten"]: _dcp_options): train, save model and optimizer with
    torch.distributed.checkpoint, train on; record the full states at the save and the weights
    after the continuation."""
    set_dims(256, 512)
    import forge.optim
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(DEVICE, (world,))
    model = parallelize(make_model(), mesh, sp=False)
    opt = forge.optim.AdamW(model, lr=1e-2, state_format=args.get("state_format", "int8"),
                            mode="immediate", max_grad_norm=args.get("max_grad_norm"))
    train(model, opt, 2)
    model_sd, optim_sd = get_state_dict(model, opt, options=_dcp_options(args))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args["dir"])
    states = full_states(model, opt)
    train(model, opt, 2, start=2)
    weights = {n: full(p).detach().to("cpu", copy=True)  # (collective)
               for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"states": states, "weights": weights},
                   os.path.join(args["dir"], "reference.pt"))
    return {}


def job_dcp_load(rank, world, args):
    """Loads job_dcp_save's checkpoint at another number of ranks: the states come back bit
    for bit, and training goes on to within tensor parallel's own rounding of the saver's."""
    set_dims(256, 512)
    import forge.optim
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = make_model()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        parallelize(model, init_device_mesh(DEVICE, (world,)), sp=False)
    opt = forge.optim.AdamW(model, lr=1e-2, state_format=args.get("state_format", "int8"),
                            mode="immediate", max_grad_norm=args.get("max_grad_norm"))
    model_sd, optim_sd = get_state_dict(model, opt, options=_dcp_options(args))
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=args["dir"])
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=_dcp_options(args))
    reference = torch.load(os.path.join(args["dir"], "reference.pt"))
    states = full_states(model, opt)
    differ = sorted(k for k in states if k not in reference["states"]
                    or not torch.equal(states[k], reference["states"][k]))
    same_states = states.keys() == reference["states"].keys() and not differ
    train(model, opt, 2, start=2)
    error = max(normwise(p, reference["weights"][n]) for n, p in model.named_parameters())
    return {"same_states": same_states, "differ": differ[:5], "continued_vs_saver": error}


# A job's name, with an optional ":label" to run it twice in one spawn (its measurements are
# keyed by the whole name).
JOBS = {"tp": job_tp, "fsdp": job_fsdp, "loops": job_loops, "ddp": job_ddp, "head": job_head,
        "fsdp_head": job_fsdp_head,
        "dcp_save": job_dcp_save, "dcp_load": job_dcp_load}


def run(rank: int, world: int, out_dir: str, port: int, jobs) -> None:
    # This rank's stderr (native messages too: gloo's, a C++ "terminate called ...") and, on a
    # fatal signal, every thread's Python stack go to rank<r>.log, which the test prints when a
    # process dies without writing its JSON; the job lines there say which job it was in.
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    result = {"ok": True, "error": None, "measured": {}}
    try:
        if world > 1:
            # (a rank that fails leaves the others waiting in a collective: they fail after
            # this, not after gloo's default half hour)
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        for name, args in jobs:
            print(f"job {name}: start", file=log)
            result["measured"][name] = JOBS[name.split(":")[0]](rank, world, args)
            print(f"job {name}: done", file=log)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc(), "measured": result["measured"]}
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    print("results written", file=log)
    log.close()
    # NOTE: the process ends here, without the interpreter's finalization. A gloo worker thread
    # may still be dropping the last collective's tensors, which takes the GIL; during
    # finalization that ends the thread with pthread_exit inside a noexcept frame of torch's,
    # and the rank aborts after its results are written ("terminate called without an active
    # exception"; torch's ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject ->
    # PyEval_AcquireThread; pytorch/pytorch#190489). It aborted in about 1 spawn in 20 on 2
    # busy cores.
    os._exit(0)


def _use_device(device: str) -> None:
    global DEVICE
    DEVICE = device
    if device == "cuda":
        # (before anything touches the GPU: cuBLAS reads its workspace setting when it starts,
        # which deterministic mode needs)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True)


def run_threads(world: int, out_dir: str, jobs, device: str = "cpu",
                timeout_s: float = COLLECTIVE_TIMEOUT_S * 4) -> None:
    """The ranks as threads of this process on torch's threaded process group (backend
    "threaded", torch.testing._internal.distributed.multi_threaded_pg: what torch's own DTensor
    tests use): every collective really moves the ranks' tensors between them, with torch ops
    on whatever device they are on. So several ranks share one GPU, which NCCL does not allow
    and gloo does not survive with CUDA tensors. Writes rank<r>.json as run() does; a rank
    that fails wakes the others (they fail too, naming it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as threaded
    deterministic = torch.are_deterministic_algorithms_enabled()
    _use_device(device)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    store = dist.HashStore()

    def rank_main(rank):
        result = {"ok": True, "error": None, "measured": {}}
        try:
            if device == "cuda":
                torch.cuda.set_device(0)  # (the current device is per thread)
            if world > 1:
                dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            for name, args in jobs:
                result["measured"][name] = JOBS[name.split(":")[0]](rank, world, args)
        except BaseException as e:  # noqa: B036 (reported in the JSON, the others woken)
            result = {"ok": False, "error": traceback.format_exc(),
                      "measured": result["measured"]}
            threaded.ProcessLocalGroup.exception_handle(e)
        finally:
            if world > 1 and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except AttributeError:  # (torch 2.11's thread-local world lacks `comms`:
                    pass                # its groups go with the thread's world)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, default=str)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
            if t.is_alive():
                raise TimeoutError(f"{t.name} still runs after {timeout_s:.0f} s")
    finally:
        threaded._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        torch.use_deterministic_algorithms(deterministic)
