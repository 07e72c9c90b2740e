"""parallel.py — forge-train and forge-bench under torchrun: tensor (and sequence) parallel
with torch.distributed.tensor.parallel, FSDP2 (fully_shard), or both on a 2-D mesh.

    torchrun --nproc-per-node 4 -m forge.tools.train --tp 4               # tensor parallel
    torchrun --nproc-per-node 4 -m forge.tools.train --fsdp               # FSDP2 over 4 ranks
    torchrun --nproc-per-node 4 -m forge.tools.train --tp 2 --fsdp        # 2 × 2

The mesh is (dp, tp) with dp = world / tp; with --fsdp the model is sharded over dp, and
without it dp must be 1 (a replicated model would need DDP, which forge.optim refuses). Each
dp rank trains on its rows of the global batch. The plans below know forge.tools.models'
CausalLM and Hugging Face Llama / Qwen3 / Mistral module names.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, Optional

import torch
import torch.nn as nn


class ParallelError(ValueError):
    pass


@dataclasses.dataclass
class Parallel:
    world: int
    rank: int
    local_rank: int
    tp: int
    dp: int
    fsdp: bool
    mesh: object            # DeviceMesh ("dp", "tp")
    device: torch.device
    # rank 0 of a `world`-rank job alone in this process (simulate): collectives move nothing
    simulated: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def batch_rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch (every tensor-parallel rank of a group the same)."""
        if batch_size % self.dp:
            raise ParallelError(f"--batch-size {batch_size} does not split over the {self.dp} "
                                "data-parallel ranks")
        dp_rank = self.mesh.get_local_rank("dp")
        per = batch_size // self.dp
        return slice(dp_rank * per, (dp_rank + 1) * per)


def _data_parallel(world: int, tp: int, fsdp: bool, what: str) -> int:
    """The data-parallel size of `world` ranks with tensor parallel over `tp`: refused where tp
    does not divide them, or where it leaves replicas that --fsdp does not shard."""
    if tp < 1 or world % tp:
        raise ParallelError(f"--tp {tp}: must divide the {world} {what}")
    dp = world // tp
    if dp > 1 and not fsdp:
        raise ParallelError(f"{world} ranks with --tp {tp} leave {dp} data-parallel replicas: "
                            "add --fsdp to shard them (forge.optim refuses DDP replicas)")
    return dp


def from_environment(tp: int, fsdp: bool, device_name: str) -> Optional[Parallel]:
    """The process group of a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK), or None for one
    process without --tp / --fsdp."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and tp == 1 and not fsdp:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dp = _data_parallel(world, tp, fsdp, "ranks")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_name != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return Parallel(world, rank, local_rank, tp, dp, fsdp, mesh, device)


def simulate(world: int, tp: int, fsdp: bool, device_name: str) -> Parallel:
    """Rank 0 of a `world`-rank job, alone in this process: torch's fake process group (as
    torchtitan estimates memory with), whose collectives return at once and move nothing. Rank 0
    holds exactly its shards, the layers FSDP2 gathers and its activations, and runs the same
    kernels on them: its peak memory is the real rank's, its step time the compute alone (no
    communication), and what a collective would have filled holds whatever its buffer held."""
    if world < 2:
        raise ParallelError(f"--simulate-ranks {world}: at least 2 ranks")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
        raise ParallelError(f"--simulate-ranks: needs torch >= 2.6 (its fake process group "
                            f"under FSDP2 is not tried on older ones; this is {torch.__version__})")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ParallelError("--simulate-ranks runs in one process: not under torchrun")
    dp = _data_parallel(world, tp, fsdp, "simulated ranks")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    use_cuda = device_name != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda \
        else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return Parallel(world, 0, 0, tp, dp, fsdp, mesh, device, simulated=True)


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """A model built on the meta device and sharded (apply) given storage on `device`, this
    rank's shards only, and values: weights N(0, 0.02), one-dimensional parameters 1 (norm
    scales; values matter to nothing measured but must be finite), the rotary tables computed
    again (forge.tools.models' CausalLM, Hugging Face's rotary_emb)."""
    from forge.tools import models
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.dim() >= 2:
                local.normal_(0.0, 0.02)
            else:
                local.fill_(1.0)
        if isinstance(model, models.CausalLM):
            cfg = model.config
            cos, sin = models.rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len,
                                            cfg.rope_theta)
            model.rope_cos.copy_(cos)
            model.rope_sin.copy_(sin)
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        if rotary is not None:
            fresh = type(rotary)(model.config)  # (on the CPU: copied over below)
            for name, buf in fresh.named_buffers():
                rotary.get_buffer(name).copy_(buf)
    return model


def leave(code: Optional[int] = None) -> Optional[int]:
    """The end of forge-train or forge-bench in a process that joined a process group: the
    group is destroyed and, given an exit code, the process ends here with it (stdout and
    stderr flushed). Returns code where no group was made.
    NOTE: without the interpreter's finalization. A gloo worker thread may still be dropping
    the last collective's tensors then, which takes the GIL, and the rank aborts after its work
    is done ("terminate called without an active exception"; torch's ProcessGroupGloo::runLoop
    -> TensorImpl::decref_pyobject -> PyEval_AcquireThread, pytorch/pytorch#190489), and
    torchrun then fails the run (seen in the 4-rank forge-train test on 2 busy cores)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return code
    dist.destroy_process_group()
    if code is None:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _names(model: nn.Module) -> Dict[str, str]:
    """The module names the plan needs: layers, attention and MLP projections, norms."""
    if hasattr(model, "blocks"):  # forge.tools.models.CausalLM
        return dict(layers="blocks", attn="attn", mlp="mlp", attn_norm="attn_norm",
                    mlp_norm="mlp_norm", embed="embed", norm="norm", head="head",
                    sequence_parallel=True)
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):  # Hugging Face Llama / Qwen3 / Mistral
        # (no sequence parallel: the model computes its rotary tables from the sequence its
        # decoder layers receive, which SP would shard)
        return dict(layers="model.layers", attn="self_attn", mlp="mlp",
                    attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                    embed="model.embed_tokens", norm="model.norm", head="lm_head",
                    sequence_parallel=False)
    raise ParallelError(f"no tensor-parallel plan for {type(model).__name__}")


def _layers(model: nn.Module, names) -> nn.ModuleList:
    module = model
    for part in names["layers"].split("."):
        module = getattr(module, part)
    return module


def apply(model: nn.Module, par: Parallel, sequence_parallel: Optional[bool] = None) -> nn.Module:
    """Tensor parallel over par.mesh["tp"] (Megatron-style: q/k/v, gate/up by columns, o and
    down by rows; norms sequence-parallel where the model allows it, by default where it
    does), then FSDP2 per layer and at the root over par.mesh["dp"] with --fsdp. In place;
    returns the model."""
    names = _names(model)
    if sequence_parallel is None:
        sequence_parallel = names["sequence_parallel"]
    elif sequence_parallel and not names["sequence_parallel"]:
        raise ParallelError(f"sequence parallel: {type(model).__name__} computes its rotary "
                            "tables from the sequence its layers see; use "
                            "--no-sequence-parallel")
    if par.tp > 1:
        from forge.optim.distributed import Replicate, Shard  # (torch 2.4 keeps them elsewhere)
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)
        seq = Shard(1) if sequence_parallel else Replicate()
        plan = {names["embed"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
                names["head"]: ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
        if sequence_parallel:
            plan[names["norm"]] = SequenceParallel()
        for i in range(len(_layers(model, names))):
            prefix = f"{names['layers']}.{i}."
            a, m = prefix + names["attn"] + ".", prefix + names["mlp"] + "."
            for proj in ("q_proj", "k_proj", "v_proj"):
                plan[a + proj] = ColwiseParallel(input_layouts=seq)
            plan[a + "o_proj"] = RowwiseParallel(output_layouts=seq)
            plan[m + "gate_proj"] = ColwiseParallel(input_layouts=seq)
            plan[m + "up_proj"] = ColwiseParallel(input_layouts=seq)
            plan[m + "down_proj"] = RowwiseParallel(output_layouts=seq)
            if sequence_parallel:
                plan[prefix + names["attn_norm"]] = SequenceParallel()
                plan[prefix + names["mlp_norm"]] = SequenceParallel()
        parallelize_module(model, par.mesh["tp"], plan)
    if par.fsdp:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.4-2.5
            from torch.distributed._composable.fsdp import fully_shard
        dp_mesh = par.mesh["dp"]
        for layer in _layers(model, names):
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model
