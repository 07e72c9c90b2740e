"""graphs.py — forge.graphs: whole training steps captured and replayed as CUDA graphs.

    step = forge.graphs.CUDAGraphStep(train_step, optimizers=[opt], warmup=2)
    for tokens in data:
        loss = step(tokens)       # one training step on these inputs, every call

Why: a step of small kernels is bound by the host's Python (torch's fused AdamW step on the
seq-512 Llama-3.1-8B takes about 150 ms eager and 97 ms replayed as a CUDA graph on one
H200, forge-bench). A replay launches the whole step at once. FORGE's updates read their
step number, lr and rounding seed from device memory filled before each replay
(forge/optim/capture.py), so the replays train exactly as eager steps do.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["CUDAGraphStep"]


def _takes_part_in_capture(opt) -> bool:
    """Whether opt has the graph-capture interface of forge.optim (optim/capture.py):
    begin_graph_capture, end_graph_capture, prepare_graph_replay."""
    return all(callable(getattr(opt, name, None)) for name in
               ("begin_graph_capture", "end_graph_capture", "prepare_graph_replay"))


class CUDAGraphStep:
    """Runs `fn`, one whole training step, as a CUDA graph replay.

        step = CUDAGraphStep(fn, optimizers=[opt], warmup=2)
        out = step(*inputs)       # exactly one training step on `inputs`, every call

    fn(*inputs) runs one step: forward, backward, optimizer.step() (once per optimizer),
    zero_grad; it returns a tensor or a tuple of tensors (the loss, say). The inputs are
    CUDA tensors whose shapes and dtypes never change.

    - The first `warmup` calls (at least 1) run fn eagerly, on a side stream. They are
      real steps; they also create the optimizer states and let libraries pick their
      kernels before anything is captured.
    - The next call captures fn on that stream into one graph, reading static copies of
      the inputs, then replays it once: that call too is one real step.
    - Every later call copies its inputs into the static ones (a different shape or dtype
      is a ValueError naming the input) and replays the graph. It returns the same output
      tensors each time, overwritten by the next call: clone what you keep.

    What fn must do: use fixed shapes and no host synchronization (no .item(), no printing
    or branching on a tensor's value, no loss.cpu()); read the loss from the returned tensor
    outside fn. Every parameter the optimizers hold lives on CUDA.

    forge.optim optimizers: each replay gets its own step number and rounding seed, and the
    lr in each param group at the time of the call (so LR schedulers work); the other
    hyper-parameters are those of the capture (changing one is an error at the next call).
    grad_norm and nonfinite_count report the last replay. torch.optim optimizers need
    capturable=True (and then follow torch's rules: a float lr is fixed at capture).

    Make every call on one stream (each replay, and the copy of its scalars before it, go
    on the current stream). A captured step that splits its GEMM over the token dimension
    (layers with fewer tiles than SMs) uses a workspace of its own, made at the capture and
    kept for the life of the process (SMs × 64 KiB: 8.25 MiB on an H200).
    `graph` is the torch.cuda.CUDAGraph once captured (None before).
    """

    def __init__(self, fn: Callable[..., Any], optimizers: Sequence[torch.optim.Optimizer] = (),
                 warmup: int = 2):
        if not callable(fn):
            raise TypeError(f"fn: must be callable (one training step), got {type(fn).__name__}")
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        optimizers = list(optimizers)
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizers[{i}]: not a torch.optim.Optimizer "
                                f"({type(opt).__name__})")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"warmup: must be an int >= 1 (eager steps before the capture, "
                             f"which make the optimizer states), got {warmup!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAGraphStep: CUDA graphs need a CUDA GPU, and torch sees "
                               "none; run the step eagerly")
        for i, opt in enumerate(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if not p.is_cuda:
                        raise ValueError(f"optimizers[{i}]: a parameter of shape "
                                         f"{list(p.shape)} is on {p.device}; CUDAGraphStep "
                                         "needs the model on CUDA")
        self.fn = fn
        self.optimizers = optimizers
        self.warmup = warmup
        self.graph: Optional[torch.cuda.CUDAGraph] = None  # set by the capture
        self._forge = [opt for opt in optimizers if _takes_part_in_capture(opt)]
        self._captures: List[Tuple[Any, Any]] = []  # (forge optimizer, its GraphCapture)
        self._calls = 0
        self._signature: Optional[List[Tuple[torch.Size, torch.dtype, torch.device]]] = None
        self._static_inputs: List[torch.Tensor] = []
        self._static_outputs: Any = None
        self._stream: Optional[torch.cuda.Stream] = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        self._check_inputs(inputs)
        if self.graph is not None:
            return self._replay(inputs)
        if self._calls < self.warmup:
            return self._eager(inputs)
        return self._capture(inputs)

    # ------------------------------------------------------------------ the three phases

    def _eager(self, inputs) -> Any:
        current = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side = self._stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            if self._calls == 0:
                # the fused weights' gradient nodes, made on the stream current when the
                # optimizer was built, now belong to the stream the graph will be captured on
                for opt in self._forge:
                    opt.rebind_streams()
            out = self.fn(*inputs)
        current.wait_stream(side)
        self._calls += 1
        return out

    def _capture(self, inputs) -> Any:
        self._static_inputs = [x.clone() for x in inputs]
        graph = torch.cuda.CUDAGraph()
        begun = []
        try:
            try:
                for opt in self._forge:
                    opt.begin_graph_capture()
                    begun.append(opt)
                with torch.cuda.graph(graph, stream=self._stream):
                    outputs = self.fn(*self._static_inputs)
            finally:
                captures = [(opt, opt.end_graph_capture()) for opt in begun]
        except Exception as e:
            raise RuntimeError(
                f"CUDAGraphStep: the step could not be captured as a CUDA graph: "
                f"{type(e).__name__}: {e}. Everything fn runs must be capturable: fixed shapes, "
                "no host synchronization (.item(), printing a tensor); torch.optim optimizers "
                "need capturable=True") from e
        for opt, cap in captures:
            if cap.steps != 1:
                raise RuntimeError(f"CUDAGraphStep: fn called step() of optimizers"
                                   f"[{self.optimizers.index(opt)}] {cap.steps} times; it must "
                                   "call it exactly once per training step")
        self.graph, self._captures, self._static_outputs = graph, captures, outputs
        self._calls += 1
        return self._launch()  # the capture ran nothing: this call's step is the first replay

    def _replay(self, inputs) -> Any:
        for static, x in zip(self._static_inputs, inputs):
            static.copy_(x)
        self._calls += 1
        return self._launch()

    def _launch(self) -> Any:
        # NOTE: the run-scalars copies of prepare_graph_replay and the replay go on the same
        # (current) stream: each replay reads the scalars filled for it.
        for opt, cap in self._captures:
            opt.prepare_graph_replay(cap)
        self.graph.replay()
        return self._static_outputs

    # ------------------------------------------------------------------ checks

    def _check_inputs(self, inputs) -> None:
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"CUDAGraphStep: input {i}: must be a tensor, got "
                                f"{type(x).__name__}")
            if not x.is_cuda:
                raise ValueError(f"CUDAGraphStep: input {i}: is on {x.device}; a CUDA graph "
                                 "reads CUDA tensors")
        signature = [(x.shape, x.dtype, x.device) for x in inputs]
        if self._signature is None:
            self._signature = signature
            return
        if len(signature) != len(self._signature):
            raise ValueError(f"CUDAGraphStep: {len(signature)} inputs given, the first call had "
                             f"{len(self._signature)}")
        for i, (got, first) in enumerate(zip(signature, self._signature)):
            if got != first:
                raise ValueError(
                    f"CUDAGraphStep: input {i}: {list(got[0])} {got[1]} on {got[2]}, but the "
                    f"first call's was {list(first[0])} {first[1]} on {first[2]}; a CUDA graph "
                    "replays fixed shapes (make a CUDAGraphStep per shape)")
