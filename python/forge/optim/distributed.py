"""distributed.py — forge.optim on torch.distributed: what a parameter is on this rank.

Nothing here communicates on its own account; torch.distributed (DTensor, FSDP2) does.

- Tensor / sequence parallel (parallelize_module): a Linear weight is a DTensor sharded by
  rows (ColwiseParallel, Shard(0)) or columns (RowwiseParallel, Shard(1)). Its fused step runs
  on the local shard with the X and dY this rank already holds: for a row shard, the full X
  (sequence-gathered where SP gathered it) and dY's matching columns; for a column shard,
  X's matching columns and the full dY. Every element still sums all tokens in order, so the
  result is the single-process result. Other parameters (norms, embeddings) take their
  gradient as a DTensor; a Partial one (a norm under SP) is reduced first, so nothing is
  counted twice.
- FSDP2 (fully_shard): parameters are DTensors sharded by rows over the data-parallel mesh;
  FSDP2 reduce-scatters each unit's gradient and runs the parameter's post-accumulate-grad
  hooks, where the update is applied to the local shard and its gradient freed.
- Either way the states live as DTensors of the parameter's layout (torch.distributed.checkpoint
  saves and reshards them), stochastic rounding draws from the element's index in the full
  parameter (Geometry), and the step's statistics are summed over ranks, each element once.
- DDP (and FSDP1) replicate a model and average gradients after backward: an update inside
  backward would apply each rank's local gradient. Refused (check_no_replicating_wrapper).
"""
from __future__ import annotations

import gc
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

INT8_BLOCK = 64


def _dtensor_module():
    try:
        import torch.distributed.tensor as module  # torch >= 2.5
        module.DTensor  # noqa: B018
        return module
    except (ImportError, AttributeError):
        try:
            import torch.distributed._tensor as module  # torch 2.4
            return module
        except ImportError:
            return None


_DT = _dtensor_module()
DTensor = getattr(_DT, "DTensor", None)
# The placements, from wherever this torch keeps them (forge.tools.parallel and the tests build
# tensor-parallel plans with them).
Replicate = getattr(_DT, "Replicate", None)
Shard = getattr(_DT, "Shard", None)


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def is_fsdp_module(module) -> bool:
    """module is an FSDP2 (fully_shard) module."""
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch 2.4-2.5
        except ImportError:
            return False
    return isinstance(module, FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of t (t itself unless a DTensor)."""
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Geometry(NamedTuple):
    """A parameter as the fused step sees it: [rows, cols] on this rank (a 1-D parameter is
    [1, n]), and where that block lies in the full [*, full_cols] parameter."""
    rows: int
    cols: int
    row_offset: int = 0
    col_offset: int = 0
    full_cols: int = 0  # 0: not a shard


def geometry(param: torch.Tensor, name: str) -> Geometry:
    """The parameter's Geometry; a DTensor sharded along a middle dimension is refused, naming
    it (row blocks, column blocks and 2-D blocks of both are what FORGE updates)."""
    shape = tuple(param.shape)
    cols = shape[-1] if shape else 1
    rows = param.numel() // cols if cols else 0
    if not is_dtensor(param):
        return Geometry(rows, cols)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    local_shape, offset = compute_local_shape_and_global_offset(
        shape, param.device_mesh, param.placements)
    if len(shape) <= 1:
        n = local_shape[0] if local_shape else 1
        return Geometry(1, n, 0, offset[0] if offset else 0, cols)
    sharded = [d for d in range(len(shape)) if local_shape[d] != shape[d]]
    inner = 1
    for d in shape[1:-1]:
        inner *= d
    if not sharded:
        return Geometry(rows, cols)
    last = len(shape) - 1
    if set(sharded) <= {0, last}:  # a block of whole rows, of whole columns, or both (2-D)
        local_rows = (local_shape[0] if 0 in sharded else shape[0]) * inner
        return Geometry(local_rows, local_shape[last], offset[0] * inner, offset[last], cols)
    raise ValueError(f"parameter '{name}': a DTensor of shape {list(shape)} with placements "
                     f"{list(param.placements)} is sharded along dims {sharded}; FORGE updates "
                     "blocks of rows (dim 0) and columns (the last dim) only")


def check_int8_blocks(geo: Geometry, name: str) -> None:
    """int8 and fp8 states share one absmax per 64 elements of a row: a column shard must
    start on a block, and end on one unless it ends the row."""
    if not geo.full_cols or geo.cols == geo.full_cols:
        return
    end = geo.col_offset + geo.cols
    if geo.col_offset % INT8_BLOCK or (end % INT8_BLOCK and end != geo.full_cols):
        raise ValueError(
            f"parameter '{name}': its shard holds columns {geo.col_offset}..{end - 1} of "
            f"{geo.full_cols}, which do not start and end on blocks of {INT8_BLOCK} (int8 "
            "and fp8 states keep one absmax per 64 elements of a row); use another state_format "
            "for it or a sharding whose column shards are multiples of 64")


def absmax_placements(param) -> Sequence:
    """The placements of an int8 / fp8 absmax tensor ([rows, ceil(cols / 64)]) of a DTensor
    parameter: a 1-D parameter's Shard(0) is the absmax's Shard(1)."""
    if param.dim() > 1:
        return param.placements
    return [_DT.Shard(1) if isinstance(p, _DT.Shard) else p for p in param.placements]


def as_state(local_tensor: torch.Tensor, param, global_shape: Tuple[int, ...],
             placements: Optional[Sequence] = None) -> torch.Tensor:
    """A state buffer of a DTensor parameter, as a DTensor of its layout (what
    torch.distributed.checkpoint saves and reshards)."""
    if not is_dtensor(param):
        return local_tensor
    placements = param.placements if placements is None else placements
    return DTensor.from_local(local_tensor, param.device_mesh, placements, run_check=False,
                              shape=torch.Size(global_shape),
                              stride=_contiguous_stride(global_shape))


def full_matrix(local_block: torch.Tensor, param) -> torch.Tensor:
    """The whole [rows, cols] matrix of which local_block is this rank's block, laid out as
    the DTensor parameter `param` is (every rank gets it: an all-gather over its mesh)."""
    return as_state(local_block, param, tuple(param.shape)).full_tensor()


def _contiguous_stride(shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def counts_once(param) -> bool:
    """Whether this rank counts param's elements in the step's statistics: every rank its
    own shard, a replicated dimension of the mesh only at its coordinate 0."""
    if not is_dtensor(param):
        return True
    mesh = param.device_mesh
    coords = mesh.get_coordinate()
    if coords is None:
        return False
    # (a shard of any kind: Shard, and the _StridedShard of FSDP2 over tensor parallel)
    return all(not (p.is_replicate() or p.is_partial()) or coords[d] == 0
               for d, p in enumerate(param.placements))


def grad_as_param(grad: torch.Tensor, param) -> torch.Tensor:
    """The gradient as this rank's piece of the parameter's layout: a DTensor gradient is
    redistributed to the parameter's placements first (a Partial one is reduced)."""
    if is_dtensor(grad):
        if tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad


def fused_layouts(weight, name: str):
    """For a DTensor Linear weight [out, in]: the placements X and dY must have for this rank's
    shard of dW = dYᵀX (the ones the tensor-parallel styles leave them in): row shard, full X
    and dY's matching columns; column shard, X's matching columns and the full dY."""
    if weight.dim() != 2:
        raise ValueError(f"parameter '{name}': a DTensor Linear weight must be 2-D")
    x_layout, dy_layout = [], []
    for p in weight.placements:
        if isinstance(p, _DT.Replicate):
            x_layout.append(_DT.Replicate())
            dy_layout.append(_DT.Replicate())
        elif isinstance(p, _DT.Shard) and p.dim in (0, -2):
            x_layout.append(_DT.Replicate())
            dy_layout.append(_DT.Shard(-1))
        elif isinstance(p, _DT.Shard) and p.dim in (1, -1):
            x_layout.append(_DT.Shard(-1))
            dy_layout.append(_DT.Replicate())
        else:
            raise ValueError(f"parameter '{name}': placement {p} of a Linear weight is not one "
                             "FORGE fuses (Replicate, Shard(0) or Shard(1))")
    return x_layout, dy_layout


def as_local_rows(t, layout, device_mesh) -> torch.Tensor:
    """An activation (X or dY) of a tensor-parallel Linear as this rank's local tensor in the
    layout its weight shard needs (no communication when it is already in it)."""
    if not is_dtensor(t):
        return t
    target = []
    for p in layout:  # Shard(-1): the activation's last dim
        target.append(_DT.Shard(t.dim() - 1) if isinstance(p, _DT.Shard) else p)
    if tuple(t.placements) != tuple(target):
        t = t.redistribute(device_mesh, target)
    return t.to_local()


def is_fsdp_managed(model: nn.Module, param) -> bool:
    """Whether FSDP2 (fully_shard) manages param: it then arrives sharded, its gradient
    reduce-scattered, and the update runs in its post-accumulate-grad hook."""
    if not is_dtensor(param):
        return False
    for module in model.modules():
        if type(module).__name__.startswith("FSDP") and any(
                q is param for q in module.parameters(recurse=True)):
            return True
    return False


_REPLICATING = ("DistributedDataParallel", "FullyShardedDataParallel")


def check_no_replicating_wrapper(model: nn.Module) -> None:
    """DDP and FSDP1 average gradients across ranks after backward; FORGE applies updates in
    backward (or from .grad before that average exists in its own hooks), so each rank would
    apply its local gradient. Refused whether the optimizer was given the wrapper or the model
    it wraps (found through the wrapper's reference to it)."""
    wrappers = [model] if type(model).__name__ in _REPLICATING else []
    if not wrappers:
        wrappers = [w for w in _holders(model, depth=3) if type(w).__name__ in _REPLICATING
                    and getattr(w, "module", None) is model]
    if wrappers:
        raise ValueError(
            f"forge.optim: the model is wrapped in {type(wrappers[0]).__name__}, which averages "
            "gradients across ranks after backward, but FORGE applies each update inside "
            "backward: every rank would apply its own local gradient. Shard the model with "
            "FSDP2 (torch.distributed.fsdp.fully_shard) instead, or tensor parallel "
            "(parallelize_module)")


def _holders(obj, depth: int):
    """The objects that hold obj through at most `depth` references (a module's owner holds it
    through its _modules dict, and that through its __dict__)."""
    found, frontier, seen = [], [obj], {id(obj)}
    for _ in range(depth):
        nxt = []
        for o in frontier:
            for holder in gc.get_referrers(o):
                if id(holder) in seen or holder is frontier:
                    continue
                seen.add(id(holder))
                if isinstance(holder, dict) or isinstance(holder, nn.Module):
                    nxt.append(holder)
                    found.append(holder)
        frontier = nxt
    return found
