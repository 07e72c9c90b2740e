"""stats.py — the step's by-products: Σg² and the count of skipped (non-finite) elements.

Every update adds into per-device fp64 / int64 tensors (forge_step_outputs points at them);
step() closes them (the last step's are what opt.grad_norm and opt.nonfinite_count read),
summed over the ranks for a model spread over several (distributed.py). A CUDA-graph capture
makes its own inside the graph (capture.py), so every replay adds into zeros.
"""
from __future__ import annotations

import ctypes
import math
from typing import Dict, Optional, Tuple

import torch

from .. import _lib


class Stats:
    """The statistics tensors of the step in progress (by device) and of the last one."""

    def __init__(self):
        self.current: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._outputs: Dict[torch.device, _lib.StepOutputs] = {}  # pointers into current
        self.last: Optional[Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]]] = None

    def outputs(self, device: torch.device) -> _lib.StepOutputs:
        """This step's statistics outputs on `device` (made at its first update)."""
        out = self._outputs.get(device)
        if out is not None:
            return out
        stats = (torch.zeros((), dtype=torch.float64, device=device),
                 torch.zeros((), dtype=torch.int64, device=device))
        self.current[device] = stats
        out = _lib.StepOutputs()
        out.grad_sq_sum = ctypes.cast(stats[0].data_ptr(), ctypes.POINTER(ctypes.c_double))
        out.nonfinite_count = ctypes.cast(stats[1].data_ptr(), ctypes.POINTER(ctypes.c_int64))
        self._outputs[device] = out
        return out

    def consumed_norm(self) -> float:
        """The norm of the gradients this step's updates consumed (after their scale)."""
        return math.sqrt(sum(float(sq.item()) for sq, _ in self.current.values()))

    def reduce(self, devices) -> None:
        """This step's statistics summed over every rank (each element was counted by one);
        devices: where this rank's parameters are (every rank reduces the same tensors)."""
        import torch.distributed as dist
        for device in devices:
            self.outputs(device)
        for sq, nf in self.current.values():
            dist.all_reduce(sq)
            dist.all_reduce(nf)

    def close(self) -> None:
        """The step ends: its statistics become the last step's."""
        self.last = self.current
        self.discard()

    def discard(self) -> None:
        """Forgets the statistics of the step in progress (a capture's, which made its own)."""
        self.current = {}
        self._outputs = {}

    def grad_norm(self) -> Optional[float]:
        if self.last is None:
            return None
        return math.sqrt(sum(float(sq.item()) for sq, _ in self.last.values()))

    def nonfinite_count(self) -> Optional[int]:
        if self.last is None:
            return None
        return sum(int(nf.item()) for _, nf in self.last.values())
