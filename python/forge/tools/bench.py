"""bench.py — forge-bench: the proof. Peak memory and step time of FORGE against what
PyTorch users have today, on real model shapes, and the convergence-parity report.

    forge-bench                                   # every model × seq × ckpt × mode (GPU)
    forge-bench --suite anchors --time-budget 300 # the baselines' cases (docs/performance.md)
    forge-bench --models tiny --device cpu        # smoke test, no GPU needed
    forge-bench --parity --parity-steps 1000      # ~100M model: FORGE vs torch AdamW loss curves
    forge-bench --replot runs/forge-bench/X.json  # redraw md/csv/png from a JSON
    forge-bench --models llama-3.1-8b --seqs 512 --ckpt off --modes forge-bf16 --profile 2
                                                  # + GPU time by kernel category (step_profile.py)
    forge-bench --models llama-3.1-8b --seqs 2048 --ckpt off --modes torch-adamw forge-bf16 --rounds 2
                                                  # each mode once first, once second: the median
    forge-bench --models llama-3.1-8b --seqs 512 --ckpt off --cuda-graph
                                                  # every timed step replayed as one CUDA graph
    forge-bench --suite memory                    # the default arguments' peak, first step and
                                                  # steady state, against torch and the modes
    forge-bench --models llama-200m --seqs 1024 --batch 4 --ckpt off --compile
                                                  # torch.compile(model), both sides

Models are built from their public configs written below (no download): transformers'
config class, random weights, created directly on the GPU in bf16 under a device context
(no slow CPU init, no meta-device round trip whose rotary buffers would need rebuilding).
Modes, batch 1, one step = forward + backward + optimizer:
  torch-adamw        torch.optim.AdamW(fused=True): the gradient pool, then one fused pass
  torch-hooks        optimizer in backward: one torch AdamW per parameter, stepped in a
                     post-accumulate-grad hook (each gradient freed as soon as it is used)
  forge-bf16 / forge-int8 / forge-fp8 / forge-fp32-master   forge.optim.AdamW with those
                     states and every other argument at its default (mode="auto": the first
                     step deferred, then immediate where the loop reads no gradient)
  forge-bf16-immediate / forge-bf16-deferred   the same with that mode named (LOOP_MODES)
  forge-int4         forge.optim.AdamW with 4-bit states (named only: INT4_MODES)
  forge-int8-head-immediate (any -head mode + -immediate)   the fused head and mode="immediate"
                     named: on shards the default stays deferred, holding the sharded gradients
  torch-muon / forge-muon-bf16 / forge-muon-int8   torch.optim.Muon + fused AdamW against
                     forge.optim.Muon (MUON_MODES); a -head suffix (HEAD_MODES): the fused head
Peak = torch.cuda.max_memory_allocated() (reset after the model is built, so weights count),
of the first step and of the steps after it apart (first_peak_gib, steady_peak_gib; peak_gib
is the larger); time = median of 8 steps after 2 warm-ups, timed with CUDA events.
Out-of-memory is a result; its note says where (the stage and the step's phase, the bytes
allocated then and the failing ask).
Under --simulate-ranks a further step says where rank 0's bytes go (memory_phases): what
lives between steps (held_gib: weights, states and anything else kept), what the forward
leaves for the backward (saved_gib: activations, checkpoints, the loss), and what each phase
allocates above that (forward_extra_gib: layers gathered for the forward, logits;
backward_extra_gib: recomputation, gathered layers, gradients awaiting their reduce-scatter;
step_extra_gib: the optimizer's temporaries).
--cuda-graph: each step runs through forge.graphs.CUDAGraphStep (the warm-ups eager, one
untimed call that captures, then the timed steps are replays; torch AdamW with
capturable=True; torch-hooks is reported unsupported).
Results (md, json, csv, png) go to --out (default runs/forge-bench/) and are rewritten after
every case, so a run cut short keeps what it measured; `python3 bench/record.py` appends the
JSON's figures to the results table (bench/results/results.csv).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings
from typing import Dict, List, Optional

import torch

WARMUP_STEPS = 2
TIMED_STEPS = 8
LR = 1e-5  # any small value: the weights are random, only the cost is measured

# Public configs (config.json on the Hugging Face hub), the fields that shape the model.
MODEL_CONFIGS: Dict[str, dict] = {
    "llama-3.1-8b": dict(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-70b": dict(
        family="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001),
    "qwen3-14b": dict(
        family="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645),
    "qwen3-32b": dict(
        family="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645),
    # NOTE: its public config ties input and output embeddings; FORGE detects the shared
    # weight and gives it the materialized-gradient path (a warning names it).
    "qwen3-0.6b": dict(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        hidden_act="silu", attention_bias=False, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645),
    # A ~200M Llama (the torch.compile comparison: batch 4 × seq 1024).
    "llama-200m": dict(
        family="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False),
    # Smoke tests (CPU): a Llama of the same structure, tiny.
    "tiny": dict(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=176,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0,
        hidden_act="silu", tie_word_embeddings=False),
}
DEFAULT_MODELS = ["llama-3.1-8b", "qwen3-14b", "qwen3-0.6b"]
DEFAULT_SEQS = [512, 2048, 4096]
MODES = ["torch-adamw", "torch-hooks", "forge-bf16", "forge-int8", "forge-fp8",
         "forge-fp32-master"]
ALL = MODES
# Modes run only when named in --modes: FORGE with forge.lean's memory-lean activations
# (RMSNorm and the SwiGLU product recomputed in backward; bit-identical gradients in bf16)
# and its chunked cross entropy (model_loss).
LEAN_MODES = ["forge-bf16-lean", "forge-int8-lean", "forge-fp8-lean"]
# A mode's steps as CUDA graph replays (forge.graphs.CUDAGraphStep, as --cuda-graph does for
# every mode): seq 512 is bound by the host's Python when eager, and these measure the GPU.
GRAPH_SUFFIX = "-graph"
GRAPH_MODES = ["torch-adamw-graph", "forge-bf16-lean-graph", "forge-int8-lean-graph",
               "forge-fp8-lean-graph"]
# forge.optim's modes named (the other FORGE modes run the default, mode="auto"): immediate
# (every update inside backward), deferred (each Linear keeps X and dY, or its dense gradient
# in W's dtype where smaller, until step()), deferred with exact clipping (max_grad_norm=1.0),
# and accumulate_grad=True (a dense .grad per parameter).
LOOP_MODES = ["forge-bf16-immediate", "forge-bf16-deferred", "forge-bf16-clip",
              "forge-bf16-accum"]
# A user's loop that clips before each step (torch.nn.utils.clip_grad_norm_(model.parameters(),
# 1.0); ClipInLoop): torch fused AdamW, and forge.optim.AdamW as built by default (mode="auto",
# which the clip keeps deferred).
LOOP_CLIP_SUFFIX = "-loopclip"
LOOP_MODES += ["torch-adamw-loopclip", "forge-bf16-loopclip"]
# FORGE with 4-bit states, run only when named.
INT4_MODES = ["forge-int4"]
# FORGE with the head and its cross entropy fused (forge.loss.enable_fused_head): no logits.
HEAD_MODES = ["forge-bf16-head", "forge-int8-head", "forge-fp8-head", "forge-int4-head"]
# ... and with mode="immediate" named: on shards (FSDP2, TP) the default, mode="auto", stays
# deferred and holds every sharded gradient until step(), as torch does (it cannot see a loop's
# use of a DTensor gradient); immediate applies each shard's gradient as it arrives.
IMMEDIATE_SUFFIX = "-immediate"
HEAD_IMMEDIATE_MODES = [m + IMMEDIATE_SUFFIX for m in HEAD_MODES]
HEAD_MODES += HEAD_IMMEDIATE_MODES
# Muon (hidden Linear weights) + AdamW (the rest), as forge.optim.Muon groups them: torch's
# pair (torch.optim.Muon + fused AdamW, torch >= 2.9) and forge.optim.Muon by momentum format.
MUON_MODES = ["torch-muon", "forge-muon-bf16", "forge-muon-int8"]
# ... and forge.optim.Muon with the fused head (the head is in its AdamW group).
HEAD_MODES += ["forge-muon-bf16-head", "forge-muon-int8-head"]
MUON_LR = 0.02
KNOWN_MODES = MODES + INT4_MODES + LEAN_MODES + GRAPH_MODES + LOOP_MODES + HEAD_MODES + \
    MUON_MODES
# The baselines' cases (docs/performance.md, "What we measure against") and those of TARGETS
# below, most important first:
# (model, seq, activation checkpointing, modes). torch-adamw leads each group: its number
# is the reference, and it is safe from a FORGE kernel fault that could spoil the rest.
ANCHOR_SUITE = [
    ("llama-3.1-8b", 512, False, ALL + LEAN_MODES + GRAPH_MODES),
    ("llama-3.1-8b", 2048, False, ["torch-adamw", "forge-bf16", "forge-int8", "torch-hooks"]),
    ("qwen3-14b", 2048, True, ["torch-adamw", "forge-int8", "forge-bf16"]),
    ("llama-3.1-8b", 512, True, ["torch-adamw", "forge-bf16", "forge-int8"]),
    ("llama-3.1-8b", 4096, False, ["torch-adamw", "forge-bf16", "forge-int8"]),
    ("qwen3-0.6b", 2048, False, ALL),
    ("qwen3-14b", 2048, False, ["torch-adamw", "forge-int8"]),
]
# What the default arguments cost (--suite memory): every case of the default's memory
# promise, torch first, then FORGE as built by default and its two modes named.
MEMORY_MODES = ["torch-adamw", "forge-bf16", "forge-bf16-immediate", "forge-bf16-deferred"]
MEMORY_SUITE = [("llama-3.1-8b", seq, ckpt, MEMORY_MODES)
                for seq in (512, 2048, 4096, 8192) for ckpt in (False, True)] + [
    ("qwen3-0.6b", 2048, False, MEMORY_MODES),
    ("qwen3-14b", 2048, True, MEMORY_MODES),
]
# GPUs needed per model (--suite scale, with --simulate-ranks N --fsdp, N = 2, 4, 8 one call
# each): rank 0's peak for torch's fused AdamW and for FORGE's state formats with the fused
# head (FSDP2 forms the head's dW for its reduce-scatter; no logits), checkpointing on; the
# smallest states first, as they fit the fewest ranks.
SCALE_MODES = ["torch-adamw", "forge-int4-head", "forge-int8-head", "forge-fp8-head",
               "forge-bf16-head", "forge-int4-head-immediate", "forge-int8-head-immediate"]
SCALE_SUITE = [(model, 4096, True, SCALE_MODES)
               for model in ("llama-3.1-8b", "qwen3-32b", "llama-3.1-70b")]
# The memory and time targets on the H200 that forge-bench checks and reports: (model, seq,
# ckpt, mode, field, limit). A limit of None means "no more than torch-adamw in the same case".
TARGETS = [
    ("llama-3.1-8b", 512, False, "forge-bf16", "peak_gib", 47.0),
    ("llama-3.1-8b", 512, False, "forge-bf16", "step_ms", 140.0),
    ("llama-3.1-8b", 512, False, "forge-int8", "peak_gib", 34.0),
    ("llama-3.1-8b", 512, False, "forge-int8", "step_ms", 150.0),
    ("llama-3.1-8b", 2048, False, "forge-bf16", "step_ms", None),
    ("llama-3.1-8b", 2048, False, "forge-int8", "step_ms", None),
    ("qwen3-14b", 2048, True, "forge-int8", "peak_gib", 62.0),
    # The same seq 512 limits for FORGE with forge.lean's memory-lean activations.
    ("llama-3.1-8b", 512, False, "forge-bf16-lean", "peak_gib", 47.0),
    ("llama-3.1-8b", 512, False, "forge-bf16-lean", "step_ms", 140.0),
    ("llama-3.1-8b", 512, False, "forge-int8-lean", "peak_gib", 34.0),
    ("llama-3.1-8b", 512, False, "forge-int8-lean", "step_ms", 150.0),
    # ... and with every step a CUDA graph replay (the step's GPU time, on any host).
    ("llama-3.1-8b", 512, False, "forge-bf16-lean-graph", "peak_gib", 47.0),
    ("llama-3.1-8b", 512, False, "forge-bf16-lean-graph", "step_ms", 140.0),
    ("llama-3.1-8b", 512, False, "forge-int8-lean-graph", "peak_gib", 34.0),
    ("llama-3.1-8b", 512, False, "forge-int8-lean-graph", "step_ms", 150.0),
]
FIELDS = ["model", "seq", "ckpt", "mode", "status", "peak_gib", "first_peak_gib",
          "steady_peak_gib", "step_ms", "tokens_per_s", "params_b", "weights_gib", "states_gib",
          "note", "graph", "batch", "compiled", "forge_mode"]


class BenchError(Exception):
    """User-facing problem: one message, exit 2."""


# Under torchrun with --tp / --fsdp (forge/tools/parallel.py): the process group and mesh every
# case's model is spread over; None in one process. Rows then give rank 0's peak memory and
# step time, and tokens/s per GPU.
_PARALLEL = None


# ----------------------------------------------------------------------------- models

def build_model(name: str, device: torch.device, dtype: torch.dtype):
    """A transformers causal LM with random weights, created directly on `device`.
    Without transformers, "tiny" falls back to forge.models' own Llama-style model."""
    cfg = dict(MODEL_CONFIGS[name])
    family = cfg.pop("family")
    try:
        import transformers
    except ImportError:
        if name != "tiny":
            raise BenchError(f"model {name} needs `transformers` (pip install transformers)")
        from forge.tools import models as forge_models
        torch.manual_seed(0)
        model, _, _ = forge_models.build_model("tiny", device, dtype)
        return model
    config_cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config
    config = config_cls(**cfg, use_cache=False, attn_implementation="sdpa")
    model_cls = (transformers.LlamaForCausalLM if family == "llama"
                 else transformers.Qwen3ForCausalLM)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in bf16 from the start
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    # NOTE: no model.to(dtype): it would also round the fp32 rotary inv_freq buffer to bf16.
    return model


def model_loss(model, tokens: torch.Tensor, lean: bool = False) -> torch.Tensor:
    """Mean next-token cross entropy of `tokens`. lean (the -lean modes): the head runs on the
    positions that have a next token and forge.lean.cross_entropy takes the loss, which keeps
    the bf16 logits instead of fp32 log-probabilities (the same value to fp32 rounding)."""
    from forge.tools import models as forge_models
    # (torch.compile's wrapper forwards calls to the model it holds: check that one)
    if isinstance(getattr(model, "_orig_mod", model), forge_models.CausalLM):  # no transformers
        from forge.tools.train import lm_loss
        return lm_loss(model, tokens, lean=lean)
    if lean:
        from forge.lean import cross_entropy
        hidden = model.model(input_ids=tokens).last_hidden_state  # [B, T, hidden]
        return cross_entropy(model.lm_head(hidden[:, :-1]), tokens[:, 1:])
    return model(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels


# ----------------------------------------------------------------------------- modes

class ClipInLoop:
    """An optimizer as a user's loop drives it with clipping: step() first calls
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), then the optimizer's step."""

    def __init__(self, optimizer, model, max_norm: float):
        self.optimizer, self.params, self.max_norm = optimizer, list(model.parameters()), max_norm

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def make_optimizer(mode: str, model, device: torch.device, graph: bool = False):
    """The optimizer object for a mode (None for torch-hooks, which lives in the hooks);
    graph: its steps will be captured as a CUDA graph (torch's AdamW then capturable)."""
    fused = device.type == "cuda"
    if mode.endswith(LOOP_CLIP_SUFFIX):
        if graph:
            raise BenchError(f"{mode}: a loop that clips runs eagerly (no CUDA graph)")
        if mode == "torch-adamw-loopclip":
            inner = make_optimizer("torch-adamw", model, device)
        else:
            import forge.optim
            inner = forge.optim.AdamW(model, lr=LR, state_format="bf16")
        return ClipInLoop(inner, model, max_norm=1.0)
    if mode == "torch-adamw":
        return torch.optim.AdamW(model.parameters(), lr=LR, fused=fused, capturable=graph)
    if mode == "torch-hooks":
        return OptimizerInBackward(model, fused)
    if mode == "torch-muon":
        from forge.tools.torch_muon import TorchMuonAdamW
        try:
            return TorchMuonAdamW(model, lr=MUON_LR, adamw_lr=LR, fused=fused)
        except ValueError as e:  # (a torch without torch.optim.Muon)
            raise BenchError(f"torch-muon: {e}") from None
    import forge.optim
    # (mode="immediate" named, or the default)
    named = dict(mode="immediate") if mode.endswith(IMMEDIATE_SUFFIX) else {}
    mode = mode[:-len(IMMEDIATE_SUFFIX)] if named else mode
    mode = mode[:-len("-lean")] if mode in LEAN_MODES else mode
    mode = mode[:-len("-head")] if mode in HEAD_MODES else mode
    if mode in ("forge-muon-bf16", "forge-muon-int8"):
        return forge.optim.Muon(model, lr=MUON_LR, adamw_lr=LR, state_format=mode[-4:])
    if mode == "forge-bf16":
        return forge.optim.AdamW(model, lr=LR, state_format="bf16", **named)
    if mode == "forge-int8":
        return forge.optim.AdamW(model, lr=LR, state_format="int8", **named)
    if mode == "forge-fp8":
        return forge.optim.AdamW(model, lr=LR, state_format="fp8", **named)
    if mode == "forge-int4":
        return forge.optim.AdamW(model, lr=LR, state_format="int4", **named)
    if mode == "forge-fp32-master":
        return forge.optim.AdamW(model, lr=LR, state_format="fp32", master_weights=True)
    if mode == "forge-bf16-deferred":
        return forge.optim.AdamW(model, lr=LR, state_format="bf16", mode="deferred")
    if mode == "forge-bf16-clip":
        return forge.optim.AdamW(model, lr=LR, state_format="bf16", mode="deferred",
                                 max_grad_norm=1.0)
    if mode == "forge-bf16-accum":
        return forge.optim.AdamW(model, lr=LR, state_format="bf16", accumulate_grad=True)
    raise BenchError(f"unknown mode {mode!r}; choose from {', '.join(KNOWN_MODES)}")


class OptimizerInBackward:
    """One torch.optim.AdamW per parameter, stepped by its post-accumulate-grad hook.

    The hooks live on the C++ side of each parameter, where Python's garbage collector
    cannot see the cycle parameter → hook → optimizer → parameter: close() removes them,
    or every case in the process would keep its model and states alive (seen on the
    H200: 45 GiB per torch-hooks case)."""

    def __init__(self, model, fused: bool):
        self.handles = []
        for p in model.parameters():
            opt = torch.optim.AdamW([p], lr=LR, fused=fused)

            def hook(param, opt=opt):
                opt.step()
                opt.zero_grad(set_to_none=True)
            self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def step(self):
        pass  # the hooks did it

    def zero_grad(self, set_to_none: bool = True):
        pass

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


# Where the running case is, for an out-of-memory row's note (oom_note): the stage (building
# the model, making the optimizer, a step) and the step's phase, the weights' bytes once known.
_WHERE: Dict[str, object] = {}


def _at(stage: str) -> None:
    _WHERE.update(stage=stage, phase=None)


def oom_note(e: BaseException, device: torch.device) -> str:
    """"out of memory", and on a GPU where: the stage and phase, what was allocated then
    (the weights' share where known) and what the failing allocation asked for."""
    note = "out of memory"
    stage, phase = _WHERE.get("stage"), _WHERE.get("phase")
    if stage:
        note += f" in {stage}" + (f" ({phase})" if phase else "")
    if device.type == "cuda":
        gib = (lambda b: f"{b / 2**30:.1f}")
        weights = _WHERE.get("weights")
        note += (f": {gib(torch.cuda.memory_allocated())} GiB allocated"
                 + (f" ({gib(weights)} of them weights)" if weights else "")
                 + f", peak {gib(torch.cuda.max_memory_allocated())} GiB")
        asked = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", str(e))
        if asked:
            note += f", asking for {asked.group(1)} more"
    return note


def is_oom(e: BaseException) -> bool:
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  torch.cuda.OutOfMemoryError, MemoryError) if t)
    return isinstance(e, oom_types) or "out of memory" in str(e).lower()


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t1 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def stop_ms(self) -> float:
        if self.cuda:
            self.t1.record()
            self.t1.synchronize()
            return self.t0.elapsed_time(self.t1)
        return (time.perf_counter() - self.t0) * 1e3


def run_case(model_name: str, seq: int, ckpt: bool, mode: str, device: torch.device,
             dtype: torch.dtype, profile: int = 0, graph: bool = False, batch: int = 1,
             compiled: bool = False) -> dict:
    """Builds the model, runs WARMUP_STEPS + TIMED_STEPS steps of `batch` sequences (then
    `profile` steps under torch.profiler when > 0; graph: the steps as CUDA graph replays;
    compiled: the model under torch.compile, made after the optimizer); raises on OOM."""
    if mode.endswith(GRAPH_SUFFIX):  # (measure() marks the row)
        mode, graph = mode[:-len(GRAPH_SUFFIX)], True
    if compiled and (graph or mode in LEAN_MODES):
        return dict(status="unsupported",
                    note="--compile runs the model's own forward eagerly around nothing else: "
                         "not with CUDA graphs or the lean modes' split forward")
    if graph and mode == "torch-hooks":
        return dict(status="unsupported",
                    note="not captured as a CUDA graph: its per-parameter torch optimizers step "
                         "in autograd hooks")
    if graph and device.type != "cuda":
        return dict(status="unsupported", note="CUDA graphs need a CUDA GPU")
    # Memory still held from earlier cases would inflate this case's peak: record it.
    leftover = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    simulated = _PARALLEL is not None and _PARALLEL.simulated
    # (simulated ranks: built on the meta device, sharded, then this rank's shards made: a
    # model larger than the card never exists whole)
    _WHERE.clear()
    _at("building the model")
    model = build_model(model_name, torch.device("meta") if simulated else device, dtype)
    model.train()
    if ckpt:
        from forge.tools.models import enable_activation_checkpointing
        enable_activation_checkpointing(model)
    prepare_model(model, model_name, mode)
    n_params = sum(p.numel() for p in model.parameters())
    if _PARALLEL is not None:
        from forge.tools import parallel
        parallel.apply(model, _PARALLEL)
        if simulated:
            parallel.materialize(model, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
    else:  # (this rank's shards: a DTensor's local tensor)
        weights = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    _WHERE["weights"] = weights
    _at("making the optimizer")
    optimizer = make_optimizer(mode, model, device, graph)
    if compiled:  # (after the optimizer: forge.optim patches the Linears' forwards)
        model = torch.compile(model)
    try:
        result = timed_steps(model, optimizer, seq, device, n_params, weights, leftover,
                             profile, lean=mode in LEAN_MODES, graph=graph, batch=batch)
        inner = getattr(optimizer, "optimizer", optimizer)  # (a loop's: the one it drives)
        if type(inner).__module__.startswith("forge.optim"):
            result["forge_mode"] = inner.mode  # where its updates ran at the last step
        return result
    finally:
        if isinstance(optimizer, OptimizerInBackward):
            optimizer.close()


def state_gib(optimizer) -> Optional[float]:
    """The GiB of the optimizer's state tensors on this rank (a loop's optimizer: the one it
    drives); None where it keeps no single state (torch-hooks' optimizer per parameter)."""
    state = getattr(getattr(optimizer, "optimizer", optimizer), "state", None)
    if not isinstance(state, dict):
        return None
    return round(sum(_local(t).numel() * t.element_size() for st in state.values()
                     for t in st.values() if isinstance(t, torch.Tensor)) / 2**30, 6)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def prepare_model(model, model_name: str, mode: str) -> None:
    """What the mode changes in the model before its optimizer is made: forge.lean's
    activations (LEAN_MODES), the fused head (HEAD_MODES)."""
    if mode in LEAN_MODES:
        from forge.lean import enable_lean_activations
        if not any(enable_lean_activations(model).values()):
            raise BenchError(f"{mode}: model {model_name} has nothing forge.lean recomputes")
    if mode in HEAD_MODES:
        import forge.loss
        try:
            forge.loss.enable_fused_head(model)
        except ValueError as e:
            raise BenchError(f"{mode}: {e}") from None


def train_step(model, optimizer, tokens: torch.Tensor, lean: bool = False) -> torch.Tensor:
    """One measured step: forward, backward, optimizer; returns the loss."""
    _WHERE["phase"] = "forward"
    loss = model_loss(model, tokens, lean)
    _WHERE["phase"] = "backward"
    loss.backward()
    if optimizer is not None:
        _WHERE["phase"] = "optimizer step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def train_phases(model, optimizer, tokens: torch.Tensor, lean: bool = False):
    """train_step cut into its three phases, in order, for step_profile.phase_times."""
    loss = []

    def forward():
        loss.append(model_loss(model, tokens, lean))

    def backward():
        loss.pop().backward()

    def step():
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return [("forward", forward), ("backward", backward), ("optimizer", step)]


def memory_phases(model, optimizer, tokens: torch.Tensor, lean: bool = False) -> dict:
    """One more step, its GPU memory phase by phase (GiB): held between steps, saved by the
    forward for the backward, and what the forward, the backward and the optimizer step
    allocate above what they start from (module docstring)."""
    gib = (lambda b: round(b / 2**30, 2))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    peak, end = {}, {}  # phase -> bytes at its peak, at its end
    for phase, run in train_phases(model, optimizer, tokens, lean):
        torch.cuda.reset_peak_memory_stats()
        run()
        peak[phase], end[phase] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    return dict(held_gib=gib(held), saved_gib=gib(end["forward"] - held),
                forward_extra_gib=gib(peak["forward"] - end["forward"]),
                backward_extra_gib=gib(peak["backward"] - end["forward"]),
                step_extra_gib=gib(peak["optimizer"] - end["backward"]))


def timed_steps(model, optimizer, seq: int, device: torch.device, n_params: int,
                weights: int, leftover: int, profile: int = 0, lean: bool = False,
                graph: bool = False, batch: int = 1) -> dict:
    vocab = model.config.vocab_size
    # (`batch` sequences per data-parallel rank: every tensor-parallel rank of a group the same)
    dp_rank = _PARALLEL.mesh.get_local_rank("dp") if _PARALLEL is not None else 0
    g = torch.Generator().manual_seed(dp_rank)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    timer = Timer(device)
    warmup, step = WARMUP_STEPS, functools.partial(train_step, model, optimizer, tokens, lean)
    if graph:
        from forge.graphs import CUDAGraphStep
        graphed = CUDAGraphStep(functools.partial(train_step, model, optimizer, lean=lean),
                                optimizers=[optimizer], warmup=WARMUP_STEPS)
        # the call that captures (and replays once) is one more warm-up, not timed
        warmup, step = WARMUP_STEPS + 1, functools.partial(graphed, tokens)

    def timed(count: int):
        """`count` steps: each one's milliseconds (events on a GPU) and the host's time to
        issue it (train_step's return: equal to the step on a host-bound step)."""
        times, host = [], []
        for _ in range(count):
            timer.start()
            t0 = time.perf_counter()
            loss = step()
            host.append((time.perf_counter() - t0) * 1e3)
            times.append(timer.stop_ms())
        return times, host, loss

    # NOTE: the first step's peak apart: a default forge optimizer's first step is deferred
    # (mode="auto") and makes the states, so it may peak where the steady state does not
    cuda = device.type == "cuda"
    _at("the first step")
    timed(1)
    _at("the steps after the first")
    first_peak = torch.cuda.max_memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timed(warmup - 1)
    times, host, loss = timed(TIMED_STEPS)
    steady_peak = torch.cuda.max_memory_allocated() if cuda else 0
    peak = max(first_peak, steady_peak)
    step_ms = statistics.median(times)
    note = ""
    if not torch.isfinite(loss.detach()).item():
        note = "non-finite loss" + (" (simulated ranks: the collectives filled nothing)"
                                    if _PARALLEL is not None and _PARALLEL.simulated else "")
    if leftover > 2**28:
        note = f"{leftover / 2**30:.1f} GiB left over from earlier cases is in the peak"
    per_gpu = 1.0 if _PARALLEL is None else _PARALLEL.dp / _PARALLEL.world
    gib = (lambda b: round(b / 2**30, 2) if b else None)
    row = dict(status="ok", peak_gib=gib(peak), first_peak_gib=gib(first_peak),
               steady_peak_gib=gib(steady_peak), step_ms=round(step_ms, 1),
               tokens_per_s=round(batch * seq * per_gpu / (step_ms / 1e3)),
               params_b=round(n_params / 1e9, 3), weights_gib=round(weights / 2**30, 6),
               states_gib=state_gib(optimizer), note=note, step_ms_each=[round(t, 1) for t in times],
               host_ms=round(statistics.median(host), 1))
    if cuda and not graph and _PARALLEL is not None and _PARALLEL.simulated:
        row.update(memory_phases(model, optimizer, tokens, lean))
    if profile > 0:  # after the peak and the times are taken: the profiler perturbs both
        from forge.tools.step_profile import profile_steps
        # A graphed step is one replay: its kernels are profiled, but it has no phases to time
        # apart (the replay is one launch).
        row["profile"] = profile_steps(
            step if graph else lambda: train_step(model, optimizer, tokens, lean), profile,
            device, None if graph else train_phases(model, optimizer, tokens, lean))
        # The same timed steps once more, after everything the profile ran: says whether the
        # step time drifts within a case (a host whose speed varies between calls does).
        again, again_host, _ = timed(TIMED_STEPS)
        row["profile"]["retimed"] = dict(step_ms=round(statistics.median(again), 1),
                                         host_ms=round(statistics.median(again_host), 1))
    return row


def limit_memory(gib: float, device: torch.device) -> None:
    """--memory-limit-gib: the caching allocator refuses to hold more than `gib` GiB."""
    if device.type != "cuda":
        raise BenchError(f"--memory-limit-gib: a CUDA device's limit, not {device}'s")
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < gib * 2**30 <= total:
        raise BenchError(f"--memory-limit-gib: must be in (0, {total / 2**30:.1f}] on this "
                         f"device, got {gib:g}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, index)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        # NOTE: torch keeps a cuBLAS workspace per stream that ran a GEMM (~32 MiB each, in the
        # caching allocator); a -graph case's capture stream would leave its own in the next
        # case's peak (+0.12 GiB measured after two graph cases).
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def measure(model_name, seq, ckpt, mode, device, dtype, profile: int = 0,
            graph: bool = False, batch: int = 1, compiled: bool = False) -> dict:
    """One row; out-of-memory and other failures are recorded, never raised."""
    row = dict(model=model_name, seq=seq, ckpt=ckpt, mode=mode)
    if graph or mode.endswith(GRAPH_SUFFIX):
        row["graph"] = True
    if batch != 1:
        row["batch"] = batch
    if compiled:
        row["compiled"] = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row.update(run_case(model_name, seq, ckpt, mode, device, dtype, profile, graph,
                                batch, compiled))
        # FORGE's own warnings (e.g. a tied weight on the materialized-gradient path)
        # qualify the measurement: keep them with the row.
        forge_notes = sorted({str(w.message)[len("forge:"):].strip()[:200] for w in caught
                              if str(w.message).startswith("forge:")})
        if forge_notes:
            row["note"] = "; ".join(filter(None, [row.get("note")] + forge_notes))
    except BenchError:
        raise
    except Exception as e:  # noqa: BLE001 — a failed case is a result
        if is_oom(e):
            row.update(status="oom", note=oom_note(e, device))
        else:
            row.update(status="error", note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                       if str(e) else type(e).__name__)
        # The traceback holds the case's frames (model, optimizer); drop it before freeing.
        e.__traceback__ = None
        del e
    if compiled:  # (the next case's model is another: its graphs, compiled anew)
        torch._dynamo.reset()
    free_memory(device)
    return row


# ----------------------------------------------------------------------------- output

def environment(device: torch.device, argv: List[str]) -> dict:
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "command": "forge-bench " + " ".join(argv), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    try:
        import forge
        info["forge"] = getattr(forge, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        info["forge"] = None
    if _PARALLEL is not None:
        info["parallel"] = {"world": _PARALLEL.world, "tp": _PARALLEL.tp, "dp": _PARALLEL.dp,
                            "fsdp": _PARALLEL.fsdp, "simulated": _PARALLEL.simulated}
        info["card"] = info["gpu"]  # (one card's name, for the results table)
        if _PARALLEL.simulated:
            info["gpu"] += (f", rank 0 of {_PARALLEL.world} simulated (tp {_PARALLEL.tp}, "
                            f"dp {_PARALLEL.dp}" + (", FSDP2" if _PARALLEL.fsdp else "") +
                            "; fake process group: step times are compute only)")
        else:
            info["gpu"] += f" ×{_PARALLEL.world} (tp {_PARALLEL.tp}, dp {_PARALLEL.dp}" + \
                (", FSDP2)" if _PARALLEL.fsdp else ")")
    return info


def result_stem(info: dict, kind: str = "bench") -> str:
    gpu = re.sub(r"[^a-z0-9]+", "-", info["gpu"].lower()).strip("-")
    gpu = gpu.replace("nvidia-", "")[:32]
    return f"forge-{kind}-{info['date'][:10]}-{gpu}"


def cell(row: dict) -> str:
    """peak GiB of the first step / of the steps after it (one peak where the row has no
    such split), step ms."""
    if row["status"] == "ok":
        mem = ""
        if row.get("peak_gib") is not None:
            first, steady = row.get("first_peak_gib"), row.get("steady_peak_gib")
            mem = f"{row['peak_gib']:.1f} GiB, "
            if first is not None and steady is not None:
                mem = f"{first:.1f} / {steady:.1f} GiB, "
        return f"{mem}{row['step_ms']:.1f} ms"
    labels = {"oom": "OOM", "skipped": "skipped", "unsupported": "unsupported"}
    return labels.get(row["status"], "error")


def display_mode(row: dict) -> str:
    """The row's mode, with "+graph" when --cuda-graph ran it as a CUDA graph."""
    graphed = row.get("graph") and not row["mode"].endswith(GRAPH_SUFFIX)
    return row["mode"] + ("+graph" if graphed else "")


def graph_sentence(rows: List[dict]) -> str:
    """What the markdown says about rows timed as CUDA graph replays."""
    how = "forge.graphs.CUDAGraphStep, torch AdamW capturable=True"
    if rows and all(r.get("graph") for r in rows):
        return f" Every timed step was one CUDA graph replay (--cuda-graph: {how})."
    if any(r.get("graph") for r in rows):
        return f" The -graph modes' timed steps were CUDA graph replays ({how})."
    return ""


def markdown(info: dict, rows: List[dict]) -> str:
    modes = [m for m in KNOWN_MODES if any(r["mode"] == m for r in rows)]
    lines = [f"# forge-bench, {info['date'][:10]}, {info['gpu']}", "",
             f"torch {info['torch']}, transformers {info['transformers']}, forge "
             f"{info['forge']}, {info['date']}. Batch 1, bf16 weights, median of "
             f"{TIMED_STEPS} steps after {WARMUP_STEPS} warm-ups (forward + backward + "
             "optimizer); peak = torch.cuda.max_memory_allocated() (GPU runs only): of the first "
             "step / of the steps after it."
             + (f" Batch {rows[0]['batch']}." if rows and rows[0].get("batch") else "")
             + (" The model under torch.compile." if any(r.get("compiled") for r in rows)
                else "")
             + graph_sentence(rows), "",
             f"Command: `{info['command']}`", "",
             "| model | seq | " + " | ".join(modes) + " |",
             "| --- | --- | " + " | ".join("---" for _ in modes) + " |"]
    cases = []
    for r in rows:
        key = (r["model"], r["seq"], r["ckpt"])
        if key not in cases:
            cases.append(key)
    for model, seq, ckpt in cases:
        by_mode = {r["mode"]: r for r in rows if (r["model"], r["seq"], r["ckpt"]) ==
                   (model, seq, ckpt)}
        cells = [cell(by_mode[m]) if m in by_mode else "" for m in modes]
        lines.append(f"| {model} | {seq}{', activation ckpt' if ckpt else ''} | "
                     + " | ".join(cells) + " |")
    checks = target_checks(rows)
    if checks:
        lines += ["", "Targets:", "", "| case | target | measured | met |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {c['case']} | {c['target']} | {c['measured']} | {c['met']} |"
                  for c in checks]
    notes = [r for r in rows if r["status"] not in ("ok", "oom") or r.get("note")]
    if notes:
        lines += ["", "Notes:"]
        lines += [f"- {r['model']} {r['seq']}{' ckpt' if r['ckpt'] else ''} {r['mode']}: "
                  f"{r['status']} {r.get('note') or ''}".rstrip() for r in notes]
    return "\n".join(lines) + "\n"


def target_checks(rows: List[dict]) -> List[dict]:
    """TARGETS against the rows that measured them."""
    def find(model, seq, ckpt, mode):
        return next((r for r in rows if (r["model"], r["seq"], r["ckpt"], r["mode"]) ==
                     (model, seq, ckpt, mode)), None)
    checks = []
    for model, seq, ckpt, mode, field, limit in TARGETS:
        row = find(model, seq, ckpt, mode)
        if row is None:
            continue
        unit = "GiB" if field == "peak_gib" else "ms"
        if limit is None:
            ref = find(model, seq, ckpt, "torch-adamw")
            limit = ref.get(field) if ref and ref["status"] == "ok" else None
            target = f"{field} <= torch-adamw" + (f" ({limit} {unit})" if limit else "")
        else:
            target = f"{field} <= {limit} {unit}"
        value = row.get(field) if row["status"] == "ok" else None
        met = "?" if value is None or limit is None else ("yes" if value <= limit else "NO")
        checks.append(dict(case=f"{model} {seq}{' ckpt' if ckpt else ''} {mode}", target=target,
                           measured=f"{value} {unit}" if value is not None else row["status"],
                           met=met))
    return checks


def summarize(directory: str) -> int:
    """Short summary of the newest bench and parity JSON files in a directory."""
    import glob
    lines = []
    benches = sorted(glob.glob(os.path.join(directory, "forge-bench-*.json")), key=os.path.getmtime)
    if benches:
        with open(benches[-1]) as f:
            saved = json.load(f)
        rows = saved["results"]
        counts = {s: sum(r["status"] == s for r in rows)
                  for s in ("ok", "oom", "error", "skipped", "unsupported")}
        lines.append(f"bench ({os.path.basename(benches[-1])}): " +
                     ", ".join(f"{n} {s}" for s, n in counts.items() if n))
        for r in rows:
            lines.append(f"  {r['model']:>13} {r['seq']:>5}{' ckpt' if r['ckpt'] else '     '} "
                         f"{display_mode(r):<24} {cell(r)}")
        for c in target_checks(rows):
            lines.append(f"  target {c['case']}: {c['target']}: {c['measured']} -> {c['met']}")
    else:
        lines.append("bench: no results")
    parities = sorted(glob.glob(os.path.join(directory, "forge-parity-*.json")),
                      key=os.path.getmtime)
    if parities:
        with open(parities[-1]) as f:
            report = json.load(f)
        lines.append(f"parity ({os.path.basename(parities[-1])}):")
        for name, c in report["comparisons"].items():
            lines.append(f"  {name}: {parity_line(c)}")
        # reports written before the spread existed: computed from their loss curves
        spread = report.get("spread") or parity_spread(
            {n: r["losses"] for n, r in report["runs"].items() if "losses" in r},
            [report.get("bf16_reference", PARITY_REFERENCE)] +
            [n for n in report["runs"]
             if n.startswith(PARITY_NAMES[report.get("optimizer", "adamw")]["noise"])])
        lines.extend(f"  {line}" for line in spread_lines(spread))
        for name, r in report["runs"].items():
            lines.append(f"  run {name}: " + (f"error: {r['error']}" if "error" in r else
                         f"{r['seconds']} s, final loss {r['final_loss']:.4f}, "
                         f"{r['tokens_per_s']} tok/s, peak {r['peak_memory_gib']} GiB"))
    else:
        lines.append("parity: no report")
    print("\n".join(lines))
    return 0


def plot(info: dict, rows: List[dict], path: str) -> Optional[str]:
    """Grouped bars: peak memory and step time per case and mode. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = []
    for r in rows:
        key = (r["model"], r["seq"], r["ckpt"])
        if key not in cases:
            cases.append(key)
    modes = [m for m in KNOWN_MODES if any(r["mode"] == m for r in rows)]
    width = 0.8 / max(1, len(modes))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(cases)), 8))
    for ax, field, label in ((axes[0], "peak_gib", "peak memory (GiB)"),
                             (axes[1], "step_ms", "step time (ms)")):
        for j, mode in enumerate(modes):
            xs, ys = [], []
            for i, case in enumerate(cases):
                r = next((r for r in rows if (r["model"], r["seq"], r["ckpt"]) == case
                          and r["mode"] == mode), None)
                if r is None:
                    continue
                x = i + (j - (len(modes) - 1) / 2) * width
                if r["status"] == "ok" and r.get(field) is not None:
                    xs.append(x)
                    ys.append(r[field])
                elif r["status"] != "ok":
                    ax.text(x, 0, cell(r), rotation=90, ha="center", va="bottom", fontsize=7)
            ax.bar(xs, ys, width, label=mode, color=f"C{KNOWN_MODES.index(mode)}")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{m}\n{s}{' ckpt' if c else ''}" for m, s, c in cases],
                           fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=len(modes))
    axes[0].set_title(f"forge-bench {info['date'][:10]}, {info['gpu']}, torch {info['torch']}",
                      fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(out_dir: str, info: dict, rows: List[dict]) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(info))
    paths = {"json": stem + ".json", "csv": stem + ".csv", "md": stem + ".md"}
    with open(paths["json"], "w") as f:
        json.dump({"environment": info, "results": rows}, f, indent=1)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(paths["md"], "w") as f:
        f.write(markdown(info, rows))
    png = plot(info, rows, stem + ".png")
    paths["png"] = png or "(no PNG: matplotlib not installed; rerun with --replot)"
    if any(row.get("profile") for row in rows):
        from forge.tools.step_profile import markdown as profile_markdown
        paths["profile"] = os.path.join(out_dir, result_stem(info, "profile") + ".md")
        with open(paths["profile"], "w") as f:
            f.write(profile_markdown(info, rows))
    return paths


# ----------------------------------------------------------------------------- parity

# The GPU convergence-parity report: FORGE (bf16 weights: stochastic rounding; bf16, int8,
# fp8 and int4 states) on the ~100M model, held to the spread of a mixed-precision reference
# over seeds (PARITY_AMP_REFERENCE, amp_seed_spread: the criterion), and measured per step
# against torch.optim.AdamW(fused=True) on bf16 weights with the same seed and batches (mean
# |Δloss| over the last half; information, with the noise floor below as its scale).
# FORGE's runs, each with its state format (the first: bf16 states).
PARITY_RUNS = {"forge-bf16-sr": "bf16", "forge-int8": "int8", "forge-fp8": "fp8",
               "forge-int4": "int4"}
PARITY_REFERENCE = "torch-adamw-fused"
# The reference: torch's AdamW on fp32 weights and states with the model computing in bf16
# under autocast (mixed precision), the update bf16 storage approximates. torch's AdamW on bf16
# weights rounds each update to nearest and so drops the updates smaller than half a bf16 step
# (those of the warm-up's small lr, at first); FORGE's stochastic rounding keeps them on
# average (measured: FORGE trains faster than torch bf16 over the first 50 steps).
PARITY_AMP_REFERENCE = "torch-adamw-amp"
# Its spread over seeds (--parity-amp-seeds N: seeds 0 .. N-1, each its own initial weights
# and batches) is the criterion every other run is held to (amp_seed_spread): its mean loss
# over the last half lies within the seeds' spread of theirs around their center.
# Noise runs give the scale of the per-step distances: torch against itself with every initial
# weight moved by about one bf16 rounding step (relative 2^-8 · N(0,1), rounded back to bf16),
# one noise seed per run (--parity-noise-runs). Two bf16 runs whose roundings differ anywhere
# drift apart like this (measured on the H200, 1000 steps: torch vs perturbed torch 0.010 and
# 0.047 nats mean |Δloss| for two noise seeds), so each FORGE comparison also says whether it
# lies within the largest torch-vs-torch distance measured ("noise floor"), and parity_spread
# compares every run with every torch run.
NOISE_RUN = "torch-adamw-fused-perturbed"
# --parity-optimizer muon: the same report for forge.optim.Muon against torch.optim.Muon +
# AdamW (forge-train --optimizer muon, its torch baseline), its runs named for it.
# --parity-continue REPORT: a report made over several calls (each shorter than a device
# call's limit): the earlier call's finished runs are taken from its JSON, the rest run.
PARITY_NAMES = {
    "adamw": dict(reference=PARITY_REFERENCE, amp=PARITY_AMP_REFERENCE, noise=NOISE_RUN,
                  forge=PARITY_RUNS, lr=6e-4),
    "muon": dict(reference="torch-muon", amp="torch-muon-amp", noise="torch-muon-perturbed",
                 forge={"forge-muon-bf16-sr": "bf16", "forge-muon-int8": "int8",
                        "forge-muon-fp8": "fp8"}, lr=0.02),
}
NOISE_SCALE = 2.0 ** -8
NOISE_SEED = 12345
SMOOTH_WINDOW = 50


def seed_run_names(count: int, base: str) -> List[str]:
    """A run over seeds: base (seed 0), base-seed1, ... (count runs in all)."""
    return [base] + [f"{base}-seed{k}" for k in range(1, count)]


def amp_run_names(count: int, base: str = PARITY_AMP_REFERENCE) -> List[str]:
    """torch-adamw-amp (seed 0), torch-adamw-amp-seed1, ... (count runs in all)."""
    return seed_run_names(count, base)


def amp_seed_spread(curves: Dict[str, List[float]], amp_runs: List[str],
                    families: Optional[Dict[str, List[str]]] = None) -> dict:
    """The mixed-precision reference's spread over seeds, and every other run against it:
    each run's mean loss over the last half of its steps; the seeds' center (the mean of
    theirs) and radius (the largest distance of one of theirs from the center); a run is
    `within` when its own lies no farther from the center than the radius. Defined from two
    seeds on; the report says how many there were. `families` names a run over several seeds
    (its name: its seeds' runs): the mean of their last-half means is held to the same
    spread (`families` in the result, present seeds counted), as the seeds' center is."""
    def last_half_mean(losses: List[float]) -> float:
        half = losses[len(losses) // 2:] or losses
        return sum(half) / len(half)

    seeds = {n: last_half_mean(curves[n]) for n in amp_runs if n in curves}
    result = {"seeds": seeds, "runs": {}}
    if len(seeds) < 2:
        return result
    center = sum(seeds.values()) / len(seeds)
    radius = max(abs(m - center) for m in seeds.values())
    result.update(center=center, radius=radius)
    for name, losses in curves.items():
        if name in seeds:
            continue
        m = last_half_mean(losses)
        result["runs"][name] = {"last_half_mean": m, "offset": m - center,
                                "within": abs(m - center) <= radius}
    result["families"] = {}
    for name, members in (families or {}).items():
        present = [result["runs"][n]["last_half_mean"] for n in members if n in result["runs"]]
        if len(present) < 2:
            continue
        m = sum(present) / len(present)
        result["families"][name] = {"seeds": len(present), "last_half_mean": m,
                                    "offset": m - center, "within": abs(m - center) <= radius}
    return result


def amp_spread_lines(spread: Optional[dict], base: str = PARITY_AMP_REFERENCE) -> List[str]:
    if not spread or "radius" not in spread:
        return []
    lines = [f"{base} over {len(spread['seeds'])} seeds: last-half mean loss "
             f"{spread['center']:.5f} ± {spread['radius']:.5f} nats"]
    for name, e in spread["runs"].items():
        lines.append(f"{name}: {e['last_half_mean']:.5f} ({e['offset']:+.5f}): "
                     f"{'within' if e['within'] else 'OUTSIDE'} the seeds' spread")
    for name, e in spread.get("families", {}).items():
        lines.append(f"{name} over {e['seeds']} seeds: {e['last_half_mean']:.5f} "
                     f"({e['offset']:+.5f}): "
                     f"{'within' if e['within'] else 'OUTSIDE'} the seeds' spread")
    return lines


def noise_run_names(count: int, base: str = NOISE_RUN) -> List[str]:
    """torch-adamw-fused-perturbed, torch-adamw-fused-perturbed-2, ..."""
    return [base if i == 0 else f"{base}-{i + 1}" for i in range(count)]


def parity_report(args, info: dict) -> int:
    if args.parity_noise_runs < 0:
        raise BenchError(f"--parity-noise-runs: must be >= 0, got {args.parity_noise_runs}")
    if args.parity_amp_seeds < 1:
        raise BenchError(f"--parity-amp-seeds: must be >= 1, got {args.parity_amp_seeds}")
    if args.parity_seeds < 1:
        raise BenchError(f"--parity-seeds: must be >= 1, got {args.parity_seeds}")
    if args.parity_jobs < 1:
        raise BenchError(f"--parity-jobs: must be >= 1, got {args.parity_jobs}")
    names = PARITY_NAMES[args.parity_optimizer]
    reference, amp_reference = names["reference"], names["amp"]
    forge_runs = tuple(names["forge"])
    chosen = list(forge_runs) if args.parity_runs is None else args.parity_runs
    unknown = [r for r in chosen if r not in forge_runs]
    if unknown or not chosen:
        raise BenchError(f"--parity-runs: choose one or more of {', '.join(forge_runs)}, got "
                         f"{' '.join(chosen) or 'none'}")
    noise_runs = noise_run_names(args.parity_noise_runs, names["noise"])
    amp_runs = amp_run_names(args.parity_amp_seeds, amp_reference)

    def forge_args(state_format: str) -> List[str]:
        return ["--bf16", "--state-format", state_format, "--stochastic-rounding"]
    (bf16, _), *quantized = names["forge"].items()
    # NOTE: the mixed-precision reference and the first noise run go before the int8 run: the
    # bf16 comparison is only meaningful beside them, and a cut-short call keeps all three.
    runs = {reference: ["--bf16", "--baseline", "torch"], bf16: forge_args("bf16"),
            amp_reference: ["--amp", "--baseline", "torch"]}
    runs.update({name: ["--bf16", "--baseline", "torch"] for name in noise_runs[:1]})
    runs.update({name: forge_args(fmt) for name, fmt in quantized})
    runs.update({name: ["--bf16", "--baseline", "torch"] for name in noise_runs[1:]})
    # (common's "--seed 0" comes first: argparse keeps the last)
    runs.update({name: ["--amp", "--baseline", "torch", "--seed", str(k)]
                 for k, name in enumerate(amp_runs) if k > 0})
    for name in set(forge_runs) - set(chosen):  # (--parity-runs: FORGE's runs)
        del runs[name]
    # --parity-seeds N: each chosen FORGE run again at seeds 1 .. N-1 (the amp seeds' initial
    # weights and batches), last; the criterion then holds the mean over its seeds.
    families = {name: seed_run_names(args.parity_seeds, name) for name in chosen}
    for name in chosen:
        runs.update({run: forge_args(names["forge"][name]) + ["--seed", str(k)]
                     for k, run in enumerate(families[name]) if k > 0})
    lr = names["lr"] if args.parity_lr is None else args.parity_lr
    # (Muon's AdamW part keeps torch's betas: forge-train takes --betas for AdamW only)
    betas = ["--betas", "0.9", "0.95"] if args.parity_optimizer == "adamw" else []
    common = ["--model", args.parity_model, "--steps", str(args.parity_steps),
              "--seq-len", str(args.parity_seq_len), "--batch-size", str(args.parity_batch_size),
              "--optimizer", args.parity_optimizer, "--lr", str(lr), *betas,
              "--weight-decay", "0.1", "--seed", "0", "--device", args.device, "--no-plot",
              "--overwrite", "--log-every", str(max(1, args.parity_steps // 10))]
    if args.parity_data:
        common += ["--data", *args.parity_data]
    carried = continued_runs(args.parity_continue, info, common, runs)  # (checked first)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, result_stem(info, "parity"))
    curves = {}
    report = {"environment": info, "settings": common, "reference": amp_reference,
              "optimizer": args.parity_optimizer, "bf16_reference": reference, "noise_runs": {
                  name: f"initial weights scaled by (1 + {NOISE_SCALE:g}·N(0,1)), noise seed "
                        f"{NOISE_SEED + i}" for i, name in enumerate(noise_runs)},
              "runs": {}, "comparisons": {}}
    argvs = {name: common + extra + ["--out", os.path.join(args.parity_work_dir, name)]
             for name, extra in runs.items()}
    noise_of = {name: noise_runs.index(name) if name in noise_runs else -1 for name in runs}
    # (a FORGE run at another seed is compared per step with the amp run of its seed
    # alone, where there is one)
    amp_of_seed = {run: amp_runs[k] if k < len(amp_runs) else None
                   for runs_of in families.values() for k, run in enumerate(runs_of) if k}
    report["jobs"] = args.parity_jobs
    if carried:
        report["continued"] = {"from": os.path.basename(args.parity_continue),
                               "runs": list(carried)}

    def record(name: str, outcome: dict) -> None:
        """One finished run into the report (in the plan's order, whatever order the runs
        finish in), every comparison redone, the report rewritten."""
        report["runs"][name] = outcome if "error" in outcome else dict(outcome,
                                                                       arguments=runs[name])
        report["runs"] = {n: report["runs"][n] for n in runs if n in report["runs"]}
        done = {n: report["runs"][n]["losses"] for n in runs
                if "losses" in report["runs"].get(n, {})}
        curves.clear()
        curves.update(done)
        ref = curves.get(reference)
        for other in tuple(forge_runs) + tuple(noise_runs):
            if ref is not None and other in curves:
                report["comparisons"][other] = compare_curves(ref, curves[other])
        floor = [report["comparisons"][n]["mean_abs_diff_last_half"] for n in noise_runs
                 if n in report["comparisons"]]
        for other in forge_runs:
            c = report["comparisons"].get(other)
            if c is not None and floor:
                c["noise_floor"] = floor
                c["within_noise_floor"] = c["mean_abs_diff_last_half"] <= max(floor)
        report["spread"] = parity_spread(
            {k: v for k, v in curves.items() if k not in amp_runs and k not in amp_of_seed},
            [reference] + noise_runs)
        report["against_amp"] = {}
        for run, curve in curves.items():
            amp = curves.get(amp_of_seed.get(run, amp_reference))
            if run not in amp_runs and amp is not None:
                report["against_amp"][run] = compare_curves(amp, curve)
        report["amp_seed_spread"] = amp_seed_spread(curves, amp_runs, families)
        with open(stem + ".json", "w") as f:  # after every run: a cut-short job keeps it
            json.dump(report, f, indent=1)
        if curves:
            _plot_parity(curves, stem + ".png", info, args, reference)

    for name, outcome in carried.items():
        record(name, outcome)
    todo = [name for name in runs if name not in carried]
    if args.parity_jobs == 1:
        for name in todo:
            record(name, parity_run(argvs[name], noise_of[name]))
    else:
        # NOTE: the runs are independent (each seeds its own weights and batches), so several
        # share the device at once: a small model's run leaves it mostly idle. Each worker is
        # its own process (spawned: a CUDA context does not survive a fork).
        import concurrent.futures
        import multiprocessing
        with concurrent.futures.ProcessPoolExecutor(
                max_workers=args.parity_jobs,
                mp_context=multiprocessing.get_context("spawn")) as pool:
            pending = {pool.submit(parity_run, argvs[name], noise_of[name]): name
                       for name in todo}
            for future in concurrent.futures.as_completed(pending):
                try:
                    outcome = future.result()
                except Exception as e:  # (a worker's failure ends its run only)
                    outcome = {"error": f"{type(e).__name__}: {e}".strip()}
                record(pending[future], outcome)
    print(f"parity ({args.parity_model}, bf16, {args.parity_steps} steps): the criterion, "
          f"{amp_reference} (fp32 weights and states, bf16 autocast) over its seeds:")
    if carried:
        print(f"  taken from {args.parity_continue} (not run again): {', '.join(carried)}")
    for line in amp_spread_lines(report.get("amp_seed_spread"), amp_reference):
        print(f"  {line}")
    print(f"  per step, against {reference} (bf16 weights and states, same batches):")
    for name, c in report["comparisons"].items():
        print(f"    {name}: {parity_line(c)}")
    for line in spread_lines(report.get("spread")):
        print(f"    {line}")
    print(f"  per step, against {amp_reference} (seed 0; a run at another seed: its seed's):")
    for name, c in report.get("against_amp", {}).items():
        print(f"    {name}: {parity_line(c)}")
    for name, run in report["runs"].items():
        if "error" in run:
            print(f"  {name}: FAILED: {run['error']}")
    print(f"  report: {stem}.json, {stem}.png", flush=True)
    return 0


def continued_runs(path: Optional[str], info: dict, settings: List[str],
                   runs: Dict[str, List[str]]) -> Dict[str, dict]:
    """--parity-continue: the finished runs of an earlier report (its JSON at `path`) that this
    plan holds with the same arguments, by name, to be taken as they are instead of run again.
    The earlier report must have run the same settings on the same card; its failed runs, and
    runs this plan does not hold, are run (or left) as the plan says."""
    if path is None:
        return {}
    try:
        with open(path) as f:
            earlier = json.load(f)
        earlier_settings, earlier_runs = earlier["settings"], earlier["runs"]
        earlier_card = earlier["environment"]["gpu"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"--parity-continue: {path} is no parity report "
                         f"({type(e).__name__}: {e})") from None
    if earlier_card != info["gpu"]:
        raise BenchError(f"--parity-continue: {path} ran on {earlier_card}, this run is on "
                         f"{info['gpu']}: a report compares runs of one card")
    if earlier_settings != settings:
        raise BenchError(f"--parity-continue: {path} ran other settings "
                         f"({' '.join(map(str, earlier_settings))}; now {' '.join(settings)})")
    carried = {}
    for name, extra in runs.items():
        run = earlier_runs.get(name)
        if isinstance(run, dict) and "losses" in run and run.get("arguments") == extra:
            carried[name] = {k: v for k, v in run.items() if k != "arguments"}
    return carried


def parity_run(argv: List[str], noise: int) -> dict:
    """One forge-train run of the parity report (noise >= 0: a noise run, its initial weights
    perturbed with noise seed NOISE_SEED + noise): its losses and figures, or its error. A
    top-level function: --parity-jobs runs it in worker processes."""
    from forge.tools import train as forge_train
    fargs, explicit = forge_train.parse_args(argv)
    t0 = time.perf_counter()
    try:
        with _perturbed_init(NOISE_SCALE if noise >= 0 else 0.0, NOISE_SEED + noise):
            result = forge_train.train(fargs, explicit)
    except forge_train.TrainError as e:
        return {"error": str(e)}
    return {"optimizer": result.optimizer, "seconds": round(time.perf_counter() - t0, 1),
            "final_loss": result.losses[-1], "tokens_per_s": round(result.tokens_per_s),
            "peak_memory_gib": round(result.peak_memory / 2**30, 2), "losses": result.losses}


def parity_spread(curves: Dict[str, List[float]], torch_runs: List[str]) -> dict:
    """The reference is one torch run among several that differ only in bf16-step noise of
    their initial weights; any one of them may sit at the edge of that spread. So beside the
    issue's measure (against the reference alone) this compares every run with every torch
    run: `torch_pairs` is the mean |Δloss| over the last half of each pair of torch runs,
    and each FORGE run gets its distance to every torch run, their mean, and whether that
    mean lies within the largest torch-vs-torch distance (`within_torch_spread`)."""
    present = [n for n in torch_runs if n in curves]

    def dist(a: str, b: str) -> float:
        return compare_curves(curves[a], curves[b])["mean_abs_diff_last_half"]

    pairs = {f"{a} vs {b}": dist(a, b)
             for i, a in enumerate(present) for b in present[i + 1:]}
    result = {"torch_pairs": pairs, "forge": {}}
    for name in curves:
        if name in torch_runs or not present:
            continue
        to_torch = {t: dist(name, t) for t in present}
        mean = sum(to_torch.values()) / len(to_torch)
        entry = {"to_torch_runs": to_torch, "mean_to_torch_runs": mean}
        if pairs:
            entry["within_torch_spread"] = mean <= max(pairs.values())
        result["forge"][name] = entry
    return result


def spread_lines(spread: Optional[dict]) -> List[str]:
    if not spread or not spread.get("torch_pairs"):
        return []
    pairs = spread["torch_pairs"]
    lines = [f"torch vs torch ({len(pairs)} pair{'' if len(pairs) == 1 else 's'}): "
             f"mean |dloss| over last half "
             f"{min(pairs.values()):.5f} .. {max(pairs.values()):.5f} nats"]
    for name, e in spread["forge"].items():
        lines.append(f"{name} vs each torch run: mean {e['mean_to_torch_runs']:.5f} nats "
                     f"({', '.join(f'{v:.5f}' for v in e['to_torch_runs'].values())}): "
                     f"{'within' if e.get('within_torch_spread') else 'ABOVE'} the torch spread")
    return lines


class _perturbed_init:
    """Scales every initial weight by (1 + scale·N(0,1)) (seeded), for the noise runs."""

    def __init__(self, scale: float, seed: int = NOISE_SEED):
        self.scale = scale
        self.seed = seed

    def __enter__(self):
        from forge.tools import models as forge_models
        self.module, self.original = forge_models, forge_models.build_model
        if self.scale:
            def build(*a, **k):
                model, kind, max_seq = self.original(*a, **k)
                g = torch.Generator().manual_seed(self.seed)
                with torch.no_grad():
                    for p in model.parameters():
                        noise = torch.randn(p.shape, generator=g).to(p.device)
                        p.copy_(p.float() * (1 + self.scale * noise))
                return model, kind, max_seq
            forge_models.build_model = build
        return self

    def __exit__(self, *exc):
        self.module.build_model = self.original
        return False


def compare_curves(ref: List[float], other: List[float]) -> dict:
    """Mean |Δloss| per step over the last half (the issue's measure), the gap between
    the two runs' mean losses there, and the mean |Δ| of SMOOTH_WINDOW-step averages."""
    n = min(len(ref), len(other))
    a, b = ref[n // 2:n], other[n // 2:n]
    m = max(1, len(a))
    diffs = [abs(x - y) for x, y in zip(a, b)]
    w = min(SMOOTH_WINDOW, m)
    smooth = [abs(sum(a[i:i + w]) - sum(b[i:i + w])) / w for i in range(0, len(a) - w + 1)]
    result = {"steps": n, "mean_abs_diff_last_half": sum(diffs) / m,
              "max_abs_diff_last_half": max(diffs, default=0.0),
              "mean_loss_gap_last_half": (sum(b) - sum(a)) / m,
              f"mean_abs_diff_{w}_step_average": sum(smooth) / max(1, len(smooth))}
    return result


def parity_line(c: dict) -> str:
    smooth = next(v for k, v in c.items() if k.startswith("mean_abs_diff_") and "average" in k)
    floor = ""
    if c.get("noise_floor"):
        floor = (f"; torch-vs-torch noise floor ({len(c['noise_floor'])} runs) max "
                 f"{max(c['noise_floor']):.5f}: "
                 f"{'within' if c['within_noise_floor'] else 'ABOVE'}")
    return (f"mean |dloss| over last half {c['mean_abs_diff_last_half']:.5f} nats; "
            f"mean gap {c['mean_loss_gap_last_half']:+.5f}; smoothed {smooth:.5f}; "
            f"{c['steps']} steps{floor}")


def _plot_parity(curves: Dict[str, List[float]], path: str, info: dict, args,
                 reference: str = PARITY_REFERENCE) -> None:
    """Loss curves (top) and each run's loss minus the reference's, smoothed (bottom)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, losses in curves.items():
        top.plot(range(1, len(losses) + 1), losses, label=name, linewidth=0.8)
    top.set_ylabel("training loss (nats/token)")
    top.set_title(f"convergence parity: {args.parity_model}, bf16, {info['gpu']}, "
                  f"{info['date'][:10]}", fontsize=10)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    ref = curves.get(reference)
    if ref is not None and len(curves) > 1:
        for name, losses in curves.items():
            if name == reference:
                continue
            n = min(len(ref), len(losses))
            w = max(1, min(SMOOTH_WINDOW, n // 10))
            diff = [losses[i] - ref[i] for i in range(n)]
            smooth = [sum(diff[i:i + w]) / w for i in range(0, n - w + 1)]
            bottom.plot(range(w, n + 1), smooth, label=f"{name} − reference", linewidth=1)
        bottom.axhline(0, color="black", linewidth=0.5)
        bottom.set_ylabel("Δloss vs reference (moving mean)")
        bottom.legend(fontsize=8)
        bottom.grid(alpha=0.3)
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forge-bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Peak memory and step time of FORGE against torch.optim on real model "
                    "shapes (batch 1), and the convergence-parity report.",
        epilog="examples:\n" + __doc__.split("\n\n")[1])
    p.add_argument("--models", nargs="+", default=None,
                   help=f"from {', '.join(MODEL_CONFIGS)} (default: {' '.join(DEFAULT_MODELS)})")
    p.add_argument("--seqs", nargs="+", type=int, default=None,
                   help=f"sequence lengths (default: {' '.join(map(str, DEFAULT_SEQS))})")
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"from {', '.join(KNOWN_MODES)} (default: {', '.join(MODES)})")
    p.add_argument("--ckpt", choices=["off", "on", "both"], default="both",
                   help="activation checkpointing")
    p.add_argument("--suite", choices=["full", "anchors", "memory", "scale"], default="full",
                   help="full: every combination of the filters; anchors: the cases of "
                        "the baselines (docs/performance.md) and TARGETS, most important first; "
                        "memory: the default "
                        "arguments' peak against torch and the modes named (MEMORY_SUITE); "
                        "scale: GPUs needed per model, with --simulate-ranks (SCALE_SUITE); "
                        "the filters still apply")
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="sequences per step (default 1)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile(model) in every case (made after the optimizer)")
    p.add_argument("--memory-limit-gib", type=float, default=0, metavar="GIB",
                   help="cap this process's CUDA memory at GIB (torch.cuda."
                        "set_per_process_memory_fraction): what a smaller card would hold; "
                        "a case above it is out of memory (0: the whole device)")
    p.add_argument("--timed-steps", type=int, default=TIMED_STEPS, metavar="N",
                   help=f"steps timed after the warm-ups (default {TIMED_STEPS})")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--out", default=os.path.join("runs", "forge-bench"),
                   help="directory of the result files (default runs/forge-bench)")
    p.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                   help="skip the cases left once this much time has passed (0: no limit)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after each case's timed steps, profile STEPS more with torch.profiler: "
                        "kernel time per step by category and the top kernels "
                        "(forge-profile-*.md); of a -graph mode, its replays' kernels")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="measure every case N times, each group of modes (one model, seq and "
                        "checkpointing) in reverse order every other round; a mode's step "
                        "time is then the median of its rounds' medians (order-balanced: on "
                        "the H200 the later of two modes has measured 1-2 %% slower); "
                        "--profile runs in the first round only")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="under torchrun: tensor parallel over N ranks (forge/tools/parallel.py)")
    p.add_argument("--simulate-ranks", type=int, default=0, metavar="N",
                   help="rank 0 of an N-rank job with --fsdp / --tp, alone on this device "
                        "(torch's fake process group): its peak memory, and its step time "
                        "without communication")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: FSDP2 over the data-parallel ranks (world / tp); "
                        "batch 1 per data-parallel rank")
    p.add_argument("--cuda-graph", action="store_true",
                   help="run every step through forge.graphs.CUDAGraphStep: the warm-ups eager, "
                        "then one capture, then the timed steps as CUDA graph replays (torch "
                        "AdamW with capturable=True; torch-hooks: unsupported); host time is "
                        "the replay call's")
    p.add_argument("--replot", metavar="JSON", help="redraw md/csv/png from a results JSON")
    p.add_argument("--summarize", metavar="DIR",
                   help="print a short summary of the newest bench and parity results in DIR")
    g = p.add_argument_group("convergence parity (--parity)")
    g.add_argument("--parity", action="store_true",
                   help="run the convergence-parity report instead of the benchmark")
    g.add_argument("--parity-model", default="100m")
    g.add_argument("--parity-steps", type=int, default=1000)
    g.add_argument("--parity-seq-len", type=int, default=512)
    g.add_argument("--parity-batch-size", type=int, default=8)
    g.add_argument("--parity-optimizer", choices=sorted(PARITY_NAMES), default="adamw",
                   help="adamw: forge.optim.AdamW against torch's; muon: forge.optim.Muon against "
                        "torch.optim.Muon + AdamW (forge-train --optimizer muon), runs named for it")
    g.add_argument("--parity-lr", type=float, default=None,
                   help="default per optimizer: " + ", ".join(
                       f"{k} {v['lr']:g}" for k, v in PARITY_NAMES.items()))
    g.add_argument("--parity-data", nargs="+", help="text files/dirs (default: built-in corpus)")
    g.add_argument("--parity-amp-seeds", type=int, default=3, metavar="N",
                   help="the mixed-precision reference over seeds 0 .. N-1 (after every other "
                        "run): every run's last-half mean loss is held to their spread")
    g.add_argument("--parity-seeds", type=int, default=1, metavar="N",
                   help="FORGE's runs over seeds 0 .. N-1, the amp seeds' initial weights and "
                        "batches (default 1); the criterion holds the mean over its seeds")
    g.add_argument("--parity-runs", nargs="+", default=None, metavar="RUN",
                   help=f"FORGE's runs (adamw: {', '.join(PARITY_RUNS)}; muon: "
                        f"{', '.join(PARITY_NAMES['muon']['forge'])}; default: all): the "
                        "references run whatever this says")
    g.add_argument("--parity-noise-runs", type=int, default=1,
                   help="torch runs with perturbed initial weights (one noise seed each) that "
                        "measure the run-to-run noise floor (default 1)")
    g.add_argument("--parity-jobs", type=int, default=1, metavar="N",
                   help="runs at once, each in its own process on the same device (default 1); "
                        "the losses do not depend on it, the runs' seconds and tokens/s do")
    g.add_argument("--parity-work-dir", default=os.path.join("runs", "parity"),
                   help="where the training runs keep their metrics")
    g.add_argument("--parity-continue", metavar="REPORT",
                   help="an earlier parity report (its JSON) of the same settings and card: its "
                        "finished runs that this plan holds with the same arguments are taken "
                        "from it, the others run (a report made over several calls)")
    return p


def plan(args) -> List[tuple]:
    models = args.models or DEFAULT_MODELS
    seqs = args.seqs or DEFAULT_SEQS
    # The anchors suite names its own modes (the lean ones too); --modes filters them.
    modes = args.modes or (KNOWN_MODES if args.suite != "full" else MODES)
    for name in models:
        if name not in MODEL_CONFIGS:
            raise BenchError(f"unknown model {name!r}; choose from {', '.join(MODEL_CONFIGS)}")
    for mode in modes:
        if mode not in KNOWN_MODES:
            raise BenchError(f"unknown mode {mode!r}; choose from {', '.join(KNOWN_MODES)}")
    ckpts = {"off": [False], "on": [True], "both": [False, True]}[args.ckpt]
    if args.suite != "full":
        suite = {"anchors": ANCHOR_SUITE, "memory": MEMORY_SUITE,
                 "scale": SCALE_SUITE}[args.suite]
        return [(m, s, c, mode) for m, s, c, suite_modes in suite
                if (args.models is None or m in models) and (args.seqs is None or s in seqs)
                and c in ckpts for mode in suite_modes if mode in modes]
    return [(m, s, c, mode) for m in models for s in seqs for c in ckpts for mode in modes]


def balanced_rounds(cases: List[tuple], rounds: int) -> List[tuple]:
    """`cases` (plan()'s (model, seq, ckpt, mode) tuples) `rounds` times; in odd rounds each
    run of consecutive cases with one model, seq and ckpt has its modes reversed, so that no
    mode always goes first."""
    groups: List[List[tuple]] = []
    for case in cases:
        if groups and groups[-1][0][:3] == case[:3]:
            groups[-1].append(case)
        else:
            groups.append([case])
    return [case for r in range(rounds) for group in groups
            for case in (group if r % 2 == 0 else group[::-1])]


def merge_rounds(rows: List[dict]) -> List[dict]:
    """One row per (model, seq, ckpt, mode), in order of first appearance: a case measured in
    several rounds gets the median of their step and host times, the largest peak, and its
    rounds' step times in step_ms_rounds. Rounds the time budget skipped are left out; any
    other round that did not end "ok" (out of memory) stands for the case, with a note saying
    which."""
    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["seq"], row["ckpt"], row["mode"]), []).append(row)
    merged = []
    for group in groups.values():
        # a round the time budget skipped says nothing when another round measured the case
        group = [r for r in group if r.get("status") != "skipped"] or group[:1]
        bad = [r for r in group if r.get("status") != "ok"]
        if len(group) == 1:
            merged.append(group[0])
        elif bad:
            row = dict(bad[0])
            row["note"] = (f"round {group.index(bad[0]) + 1} of {len(group)}: "
                           + (row.get("note") or row.get("status", "")))
            merged.append(row)
        else:
            row = dict(group[0])
            times = [r["step_ms"] for r in group]
            row["step_ms"] = round(statistics.median(times), 1)
            row["step_ms_rounds"] = times
            for key in ("peak_gib", "first_peak_gib", "steady_peak_gib"):
                peaks = [r[key] for r in group if r.get(key) is not None]
                row[key] = max(peaks) if peaks else None  # None: no CUDA peak (the CPU)
            hosts = [r["host_ms"] for r in group if r.get("host_ms") is not None]
            if len(hosts) == len(group):
                row["host_ms"] = round(statistics.median(hosts), 1)
            row["tokens_per_s"] = round(row.get("batch", 1) * row["seq"] * 1000.0
                                        / row["step_ms"])
            row["note"] = "median of rounds " + " / ".join(f"{t:.1f}" for t in times) + " ms"
            merged.append(row)
    return merged


def main(argv=None) -> int:
    global _PARALLEL
    try:
        code = _run(argv)
    finally:
        if _PARALLEL is not None and _PARALLEL.simulated:  # (one process: it goes on)
            import torch.distributed as dist
            dist.destroy_process_group()
            _PARALLEL = None
    if _PARALLEL is not None:  # (under torchrun: the process may end there)
        from forge.tools import parallel
        parallel.leave(code)
    return code


def _run(argv) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.profile < 0:
            raise BenchError(f"--profile: STEPS must be >= 0, got {args.profile}")
        if args.rounds < 1:
            raise BenchError(f"--rounds: N must be >= 1, got {args.rounds}")
        if args.batch < 1:
            raise BenchError(f"--batch: B must be >= 1, got {args.batch}")
        if args.timed_steps < 1:
            raise BenchError(f"--timed-steps: N must be >= 1, got {args.timed_steps}")
        global TIMED_STEPS
        TIMED_STEPS = args.timed_steps
        if args.cuda_graph and args.parity:
            raise BenchError("--cuda-graph: not with --parity (the parity's training runs are "
                             "eager)")
        if args.summarize:
            return summarize(args.summarize)
        if args.replot:
            with open(args.replot) as f:
                saved = json.load(f)
            paths = write_results(os.path.dirname(args.replot) or ".", saved["environment"],
                                  saved["results"])
            print("\n".join(f"{k}: {v}" for k, v in paths.items()))
            return 0
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                              else ("cpu" if args.device == "auto" else args.device))
        global _PARALLEL
        from forge.tools import parallel
        try:
            if args.simulate_ranks:
                _PARALLEL = parallel.simulate(args.simulate_ranks, args.tp, args.fsdp,
                                              device.type)
            else:
                _PARALLEL = parallel.from_environment(args.tp, args.fsdp, device.type)
        except parallel.ParallelError as e:
            raise BenchError(str(e)) from None
        if _PARALLEL is not None:
            device = _PARALLEL.device
            if args.cuda_graph or args.parity or args.profile:
                raise BenchError("--tp / --fsdp: --cuda-graph, --parity and --profile run in "
                                 "one process")
            if not _PARALLEL.main:
                sys.stdout = open(os.devnull, "w")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BenchError("--device cuda: no CUDA GPU is available to torch")
        if args.cuda_graph and device.type != "cuda":
            raise BenchError(f"--cuda-graph: CUDA graphs need a CUDA device, not {device}")
        if args.memory_limit_gib:
            limit_memory(args.memory_limit_gib, device)
        info = environment(device, argv)
        if args.parity:
            return parity_report(args, info)
        cases = plan(args)
        if not cases:
            raise BenchError("no case matches --models/--seqs/--modes/--ckpt"
                             + (" in the anchors suite" if args.suite == "anchors" else ""))
        first_round = len(cases)
        cases = balanced_rounds(cases, args.rounds)
        big = sorted({c[0] for c in cases} - {"tiny"})
        if device.type == "cpu" and big:
            raise BenchError(f"{', '.join(big)} need a CUDA GPU; on CPU use --models tiny")
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    except (BenchError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"forge-bench: error: {e}", file=sys.stderr)
        return 2
    print(f"forge-bench: {len(cases)} case(s) on {info['gpu']}, torch {info['torch']}",
          flush=True)
    rows, t_start = [], time.perf_counter()
    for i, (model, seq, ckpt, mode) in enumerate(cases):
        label = f"[{i + 1}/{len(cases)}] {model} seq {seq}{' ckpt' if ckpt else ''} {mode}"
        if args.time_budget and time.perf_counter() - t_start > args.time_budget:
            rows.append(dict(model=model, seq=seq, ckpt=ckpt, mode=mode, status="skipped",
                             note="time budget spent"))
            print(f"{label}: skipped (time budget)", flush=True)
            continue
        try:
            # NOTE: the profile, if asked for, in the first round only
            row = measure(model, seq, ckpt, mode, device, dtype,
                          args.profile if i < first_round else 0, args.cuda_graph,
                          args.batch, args.compile)
        except BenchError as e:
            print(f"forge-bench: error: {e}", file=sys.stderr)
            return 2
        rows.append(row)
        print(f"{label}: {cell(row)}" + (f" ({row['note']})" if row.get("note") else ""),
              flush=True)
        if _PARALLEL is None or _PARALLEL.main:
            paths = write_results(args.out, info, merge_rounds(rows))
    rows = merge_rounds(rows)
    if _PARALLEL is not None and not _PARALLEL.main:
        return 0
    paths = write_results(args.out, info, rows)
    print("\n" + markdown(info, rows))
    print("\n".join(f"{k}: {v}" for k, v in paths.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
