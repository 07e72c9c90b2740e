"""train.py — forge-train: train a causal LM with forge.optim, offline, in one command.

    forge-train                      # tiny Llama-style model, built-in corpus, CPU or GPU
    forge-train --model 100m --bf16 --state-format int8 --steps 2000 --data ~/texts
    forge-train --out runs/a --save-every 100 ... ; forge-train --out runs/a --resume

What it shows: every nn.Linear weight is updated inside backward, so the run's summary
reports 0 bytes of Linear weight gradient ever held (measured with gradient hooks, not
assumed), next to the loss, tokens/s and peak memory. `--baseline torch` trains the same
model with torch.optim for comparison.

Checkpoints hold model, optimizer (FORGE states included), scheduler, RNG and the loss
history; batches are a pure function of (seed, step), so --resume continues bit-exactly.
Every run ends with one (a resumed run's moves to its end), and --save-every adds more;
each is written to a temporary file beside it, fsynced and renamed over it, so an
interrupted run keeps its last one. Ctrl-C lets the step in flight finish, then saves its
checkpoint (see InterruptGuard), whatever became of stdout and stderr (a pipe to tee that
the same Ctrl-C closed: see say()). --resume DIR continues in DIR unless --out names another
directory. An --out that holds another run's checkpoint, metrics or plot is refused unless
--resume continues that run or --overwrite replaces it.
Bad input ends with one line on stderr and exit status 2, before training starts where it
can be known then (--out included); see TrainError.

torch is imported only once the command line is parsed and checked (each function that
needs it imports it): --help and a bad option answer at once, not after torch's seconds.
main() sets OMP_WAIT_POLICY=PASSIVE unless it is set (see there).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import signal
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:  # annotations only: each function imports torch where it uses it
    import torch
    import torch.nn as nn

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.json"
PLOT_NAME = "loss.png"
# What a run writes into --out: another run's, there, is refused unless --resume / --overwrite.
RUN_FILES = (CHECKPOINT_NAME, METRICS_NAME, PLOT_NAME)
CHECKPOINT_FORMAT = "forge-train checkpoint"
CHECKPOINT_VERSION = 1
DEFAULT_OUT = os.path.join("runs", "forge-train")
# Default step count: the default run (tiny model, 16 × 128 tokens a step) takes under two
# minutes on 2 idle CPU cores, start-up included, and its loss falls from ln 256 = 5.5 to
# about 2 nats/token.
DEFAULT_STEPS = 250
# forge.tools.models.PRESETS' names, for --help without importing torch (test_train.py checks
# that they are the same).
MODEL_PRESETS = ("tiny", "small", "100m")


class TrainError(Exception):
    """A user-facing problem (bad input, corrupt checkpoint, ...): one message, exit 2."""


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    class_name: str              # the same name in forge.optim and torch.optim
    lr: float                    # forge-train's default learning rate for it
    hparams: tuple               # CLI hyper-parameters (torch.optim keyword names) it takes
    in_torch: bool = True        # torch.optim has it (for --baseline torch)


OPTIMIZERS: Dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("AdamW", 1e-3, ("betas", "eps", "weight_decay")),
    "nadam": OptimizerSpec("NAdam", 1e-3, ("betas", "eps", "weight_decay")),
    "radam": OptimizerSpec("RAdam", 1e-3, ("betas", "eps", "weight_decay")),
    "lion": OptimizerSpec("Lion", 1e-4, ("betas", "weight_decay"), in_torch=False),
    "rmsprop": OptimizerSpec("RMSprop", 1e-3,
                             ("alpha", "eps", "weight_decay", "momentum", "centered")),
    "adagrad": OptimizerSpec("Adagrad", 1e-2, ("lr_decay", "eps", "weight_decay")),
    "sgd": OptimizerSpec("SGD", 5e-2, ("momentum", "dampening", "weight_decay", "nesterov")),
    # Muon for the hidden Linear weights, AdamW (torch's defaults) for the rest; its torch
    # baseline is the same pair (forge/tools/torch_muon.py)
    "muon": OptimizerSpec("Muon", 2e-2, ("momentum", "weight_decay", "nesterov")),
}
HPARAM_FLAGS = {"betas": "--betas", "eps": "--eps", "weight_decay": "--weight-decay",
                "alpha": "--alpha", "momentum": "--momentum", "centered": "--centered",
                "lr_decay": "--lr-decay", "dampening": "--dampening", "nesterov": "--nesterov"}

# Options that define the training trajectory: a resumed run takes them from the
# checkpoint, and refuses an explicit different value (it could not continue bit-exactly),
# except --steps, which may lengthen or shorten the run (and so its cosine schedule).
TRAJECTORY_OPTIONS = ("model", "data", "max_data_mb", "optimizer", "lr", "betas", "eps",
                      "weight_decay", "alpha", "momentum", "centered", "lr_decay", "dampening",
                      "nesterov", "state_format", "master_weights", "stochastic_rounding",
                      "seq_len", "batch_size", "warmup", "min_lr_ratio", "bf16", "amp", "seed",
                      "baseline", "steps",
                      # NOTE: bit-identical in bf16 only; in fp32 it sums an RMSNorm's
                      # gradient terms in another order (forge.lean).
                      "lean_activations")
# Options a resumed run also takes from the checkpoint unless given again (free to change).
INHERITED_OPTIONS = ("save_every", "activation_checkpointing", "no_plot", "log_every",
                     "cuda_graph")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" where there is a default to show: not for options whose default
    is decided later (None), flags (False) or help that already says it."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forge-train", formatter_class=HelpFormatter,
        description="Train a causal LM with FORGE: every nn.Linear weight is updated inside "
                    "backward and never holds a gradient. With no arguments: a tiny model on "
                    "a built-in corpus, under two minutes on a 2-core CPU.")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tiny",
                   help=f"preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face "
                        "config.json / checkpoint directory (needs transformers)")
    g.add_argument("--data", nargs="+", metavar="PATH",
                   help="local text files or directories (default: the built-in corpus, "
                        "the Python standard library's sources)")
    g.add_argument("--max-data-mb", type=int, default=256, help="read at most this much text")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    g = p.add_argument_group("optimizer (hyper-parameters default to torch.optim's)")
    g.add_argument("--optimizer", default="adamw", help=" | ".join(OPTIMIZERS))
    g.add_argument("--baseline", choices=["torch"],
                   help="use torch.optim instead of forge.optim (AdamW fused on CUDA), to compare")
    g.add_argument("--lr", type=float,
                   help="peak learning rate (default per optimizer: " +
                        ", ".join(f"{name} {spec.lr:g}" for name, spec in OPTIMIZERS.items()) + ")")
    g.add_argument("--weight-decay", type=float, help="weight decay")
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"),
                   help="moment decay rates (Adam family, Lion)")
    g.add_argument("--eps", type=float, help="denominator term")
    g.add_argument("--momentum", type=float, help="RMSprop, SGD")
    g.add_argument("--alpha", type=float, help="RMSprop smoothing constant")
    g.add_argument("--centered", action="store_true", default=None, help="RMSprop")
    g.add_argument("--lr-decay", type=float, help="Adagrad")
    g.add_argument("--dampening", type=float, help="SGD")
    g.add_argument("--nesterov", action="store_true", default=None, help="SGD (default off); Muon (default on)")
    g.add_argument("--state-format", choices=["fp32", "bf16", "int8", "fp8", "int4"],
                   help="FORGE optimizer-state storage (default: forge.optim's)")
    g.add_argument("--master-weights", action="store_true", default=None,
                   help="FORGE: keep an fp32 master copy of bf16 weights")
    g.add_argument("--stochastic-rounding", action=argparse.BooleanOptionalAction,
                   default=None, help="FORGE: stochastic rounding of bf16 stores (default: "
                                      "forge.optim's, on)")
    g = p.add_argument_group("schedule and precision")
    g.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    g.add_argument("--warmup", type=int, help="linear warm-up steps (default: 5%% of --steps), "
                                              "then cosine decay")
    g.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine ends at this fraction of --lr")
    g.add_argument("--bf16", action="store_true", help="bf16 weights (default: fp32)")
    g.add_argument("--amp", action="store_true",
                   help="mixed precision: fp32 weights (and optimizer states), forward and "
                        "backward under torch.autocast(bfloat16); not with --bf16")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                   help="after two eager steps, capture the whole step as one CUDA graph and "
                        "replay it (forge.graphs.CUDAGraphStep): the same updates without the "
                        "host's per-layer time; forge.optim on a GPU only")
    g.add_argument("--lean-activations", action=argparse.BooleanOptionalAction, default=False,
                   help="recompute RMSNorm and the SwiGLU product in backward instead of "
                        "keeping their intermediates (less memory, same gradients in bf16: "
                        "forge.lean)")
    g.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    g = p.add_argument_group("several processes (under torchrun; forge/tools/parallel.py)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel over N ranks (Megatron-style plan, sequence parallel "
                        "norms)")
    g.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 over the data-parallel ranks (world / tp)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="with --tp: norms and the residual stream sharded along the sequence "
                        "(default: where the model allows it)")
    g.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda "
                                                    "| cuda:N")
    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--out", help=f"directory for checkpoint, metrics, plot (default: "
                                 f"{DEFAULT_OUT}, or with --resume DIR that directory)")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="write a checkpoint every N steps as well (every run writes one at "
                        "its end and when interrupted with Ctrl-C; 0: only those)")
    g.add_argument("--resume", nargs="?", const="", metavar="CHECKPOINT",
                   help=f"continue from CHECKPOINT, a file or a directory, and write there "
                        f"unless --out is given (without CHECKPOINT: OUT/{CHECKPOINT_NAME})")
    g.add_argument("--overwrite", action="store_true",
                   help=f"replace the run in --out (its {', '.join(RUN_FILES)}, removed "
                        f"first); without it an --out holding them is refused unless --resume "
                        f"continues that run")
    g.add_argument("--log-every", type=int, default=0,
                   help="without tqdm: print a progress line every N steps (default: ~20 lines)")
    g.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG")
    return p


def _numeric_values_attached(parser: argparse.ArgumentParser, argv: List[str]) -> List[str]:
    """argv with "--lr -1e-3" given as "--lr=-1e-3": argparse takes a negative number in
    exponent notation for an option of its own, so the value would never reach the checks
    that explain why it is refused. Options taking one int or float value only."""
    numeric = {s for a in parser._actions for s in a.option_strings
               if a.nargs is None and a.type in (int, float)}
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in numeric and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{arg}={argv[i + 1]}")
                i += 2
                continue
        out.append(arg)
        i += 1
    return out


def parse_args(argv=None):
    """(args, explicit): explicit is the set of options given on the command line."""
    parser = build_parser()
    argv = _numeric_values_attached(parser, list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    explicit = set(vars(probe.parse_args(argv)))
    if args.out is None:  # decided in train(): --resume DIR may give it
        args.out = DEFAULT_OUT
    return args, explicit


# ----------------------------------------------------------------------------- checks

def resolve_optimizer(args, explicit) -> OptimizerSpec:
    name = args.optimizer.lower()
    if name not in OPTIMIZERS:
        raise TrainError(f"unknown optimizer {args.optimizer!r}; choose one of "
                         f"{', '.join(OPTIMIZERS)}")
    spec = OPTIMIZERS[name]
    for hp, flag in HPARAM_FLAGS.items():
        if hp in explicit and hp not in spec.hparams:
            raise TrainError(f"{flag} does not apply to {name} (it takes "
                             f"{', '.join(HPARAM_FLAGS[h] for h in spec.hparams)})")
    if args.baseline == "torch":
        if not spec.in_torch:
            raise TrainError(f"torch.optim has no {spec.class_name}: --baseline torch cannot "
                             f"run {name}")
        forge_only = [f for f in ("state_format", "master_weights", "stochastic_rounding")
                      if f in explicit]
        if forge_only:
            raise TrainError(f"--{forge_only[0].replace('_', '-')} is a FORGE option; it "
                             "does not apply with --baseline torch")
    return spec


def check_precision(args):
    if args.amp and args.bf16:
        raise TrainError("--amp keeps fp32 weights and computes in bf16 under autocast; "
                         "--bf16 stores the weights in bf16: choose one")


def check_cuda_graph(args, device: torch.device):
    if not args.cuda_graph:
        return
    if args.baseline == "torch":
        raise TrainError("--cuda-graph replays forge.optim's steps with each step's lr; "
                         "torch.optim's would keep the lr of the capture: not with --baseline "
                         "torch")
    if device.type != "cuda":
        raise TrainError(f"--cuda-graph needs a CUDA device; this run is on {device}")


def check_numbers(args):
    for flag, value in (("--steps", args.steps), ("--seq-len", args.seq_len),
                        ("--batch-size", args.batch_size), ("--max-data-mb", args.max_data_mb)):
        if value <= 0:
            raise TrainError(f"{flag} must be positive, got {value}")
    if args.save_every < 0:
        raise TrainError(f"--save-every must be >= 0, got {args.save_every}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr >= 0):
        raise TrainError(f"--lr must be a finite number >= 0, got {args.lr:g}")
    if args.warmup is not None and args.warmup < 0:
        raise TrainError(f"--warmup must be >= 0, got {args.warmup}")


def resolve_out(args, explicit) -> None:
    """--resume DIR (or a file in DIR) writes to DIR unless --out names another directory."""
    if args.resume and "out" not in explicit:
        args.out = args.resume if os.path.isdir(args.resume) else \
            (os.path.dirname(args.resume) or ".")


def check_out(path: str) -> None:
    """--out must be a directory this process can write, or one it can create: found now,
    not in a traceback after the whole run."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise TrainError(f"--out {path}: is a file, not a directory")
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            raise TrainError(f"--out {path}: cannot write there ({e.strerror})") from None
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise TrainError(f"--out {path}: cannot be created, {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TrainError(f"--out {path}: cannot be created, {parent} is not writable")


def check_out_unused(args) -> None:
    """A fresh run must not mix its files with another run's: an --out that holds a
    checkpoint, metrics or plot is refused unless this run continues that one (--resume from
    that folder) or --overwrite says to replace it. Other files are no run's and stay."""
    if args.overwrite or not os.path.isdir(args.out):
        return
    if args.resume is not None:
        resumed = checkpoint_path(args)
        if os.path.abspath(os.path.dirname(resumed) or ".") == os.path.abspath(args.out):
            return
    found = [name for name in RUN_FILES if os.path.exists(os.path.join(args.out, name))]
    if found:
        raise TrainError(f"--out {args.out}: holds another run's {', '.join(found)}; continue "
                         "that run with --resume, replace it with --overwrite, or choose "
                         "another --out")


def remove_run_files(out: str) -> None:
    """--overwrite: the old run's files go before this run writes any (a new run that fails
    early then leaves none of the old one's beside its own)."""
    for name in RUN_FILES:
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)


def say(text: str = "", stream=None, end: str = "\n") -> None:
    """print() that a closed stdout or stderr cannot stop: under `forge-train ... 2>&1 | tee
    log` the Ctrl-C that interrupts the run ends tee too, and every later write fails
    (BrokenPipeError), also the interrupt handler's own; the run must still finish its step
    and save it. The stream that failed is pointed at os.devnull from then on, and its file
    descriptor too, so that later prints and the interpreter's last flush do not fail again."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, end=end, flush=True)
    except OSError:  # BrokenPipeError (EPIPE), EIO of a closed terminal
        _silence(stream)


def _silence(stream) -> None:
    devnull = open(os.devnull, "w")
    try:
        os.dup2(devnull.fileno(), stream.fileno())
    except (OSError, ValueError, AttributeError):  # (no descriptor: a StringIO, a closed file)
        pass
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is stream:
            setattr(sys, name, devnull)


def pick_device(name: str) -> torch.device:
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainError(f"unknown device {name!r}; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda: no CUDA GPU is available to torch")
    if device.type not in ("cpu", "cuda"):
        raise TrainError(f"unsupported device {name!r}; use auto, cpu or cuda")
    return device


# ----------------------------------------------------------------------------- pieces

def make_optimizer(model: nn.Module, spec: OptimizerSpec, args, device: torch.device):
    import torch
    kwargs = {"lr": args.lr if args.lr is not None else spec.lr}
    for hp in spec.hparams:
        value = getattr(args, hp)
        if value is not None:
            kwargs[hp] = tuple(value) if hp == "betas" else value
    if args.baseline == "torch" and spec.class_name == "Muon":
        from forge.tools.torch_muon import TorchMuonAdamW
        try:
            opt = TorchMuonAdamW(model, fused=True if device.type == "cuda" else None, **kwargs)
        except ValueError as e:
            raise TrainError(f"--baseline torch: {e}") from None
        return opt, "torch.optim.Muon + torch.optim.AdamW"
    if args.baseline == "torch":
        cls = getattr(torch.optim, spec.class_name)
        if device.type == "cuda" and spec.class_name == "AdamW":
            kwargs["fused"] = True  # the fastest torch has: what FORGE is compared with
        return cls(model.parameters(), **kwargs), f"torch.optim.{spec.class_name}"
    try:
        import forge.optim as forge_optim
    except Exception as e:  # ImportError, or OSError when libforge cannot be loaded
        raise TrainError(f"cannot load forge.optim ({type(e).__name__}: {e}); build libforge "
                         "or set FORGE_LIBRARY, or run with --baseline torch") from None
    if device.type == "cuda":
        import forge
        if not forge.has_cuda():
            raise TrainError(f"libforge ({forge.library().path}) was built without its CUDA "
                             "backend: rebuild it where nvcc is found, or use --device cpu")
    for opt in ("state_format", "master_weights", "stochastic_rounding"):
        if getattr(args, opt) is not None:
            kwargs[opt] = getattr(args, opt)
    kwargs["seed"] = args.seed
    # (this loop never reads a gradient before step(): every update runs inside backward from
    # the first step on, also on shards, where mode='auto' would stay deferred)
    kwargs["mode"] = "immediate"
    try:
        opt = getattr(forge_optim, spec.class_name)(model, **kwargs)
    except (ValueError, TypeError) as e:
        raise TrainError(f"forge.optim.{spec.class_name}: {e}") from None
    label = f"forge.optim.{spec.class_name}"
    if args.state_format:
        label += f" (state_format={args.state_format})"
    return opt, label


def make_schedule(optimizer, steps: int, warmup: int, min_ratio: float):
    """Linear warm-up to the peak lr, then cosine down to min_ratio · peak."""
    import torch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lm_loss(model: nn.Module, tokens: torch.Tensor, lean: bool = False) -> torch.Tensor:
    """Next-token cross entropy in fp32; tokens: [B, T + 1]. lean: forge.lean.cross_entropy
    (the same value to fp32 rounding, without fp32 log-probabilities kept for backward)."""
    import torch.nn.functional as F
    from forge.tools import models as forge_models
    logits = forge_models.logits_of(model, tokens[:, :-1])  # [B, T, vocab]
    if lean:
        from forge.lean import cross_entropy
        return cross_entropy(logits, tokens[:, 1:])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           tokens[:, 1:].reshape(-1))


class GradientBytesTracker:
    """Measures the weight-gradient bytes alive at once, split into nn.Linear weights and
    every other parameter.

    A post-accumulate-grad hook on every parameter sums the .grad tensors alive when it
    fires. Registered before the optimizer exists, these hooks run before any the
    optimizer adds, so they see each gradient before it is consumed and freed. A Linear
    weight FORGE updates inside backward never gets a .grad: its hook never fires; one whose
    update is deferred holds a FactoredGrad, which is no gradient (its X and dY are counted
    apart, in peak_factors). (Not seen: the fp32 sum FORGE keeps for a Linear weight used
    twice in one step; forge.optim warns by name when that happens.)
    """

    def __init__(self, model: nn.Module):
        import torch.nn as nn
        linear_weights = {id(m.weight) for m in model.modules()
                          if isinstance(m, nn.Linear)}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.is_linear = [id(p) in linear_weights for p in self.params]
        self.peak_linear = 0
        self.peak_other = 0
        self.peak_factors = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                        for p in self.params]

    def _on_grad(self, _param):
        linear = other = factors = 0
        for p, is_linear in zip(self.params, self.is_linear):
            g = p.grad
            if g is None or type(g).__name__ == "ConsumedGrad":  # (no memory)
                continue
            if type(g).__name__ == "FactoredGrad":
                factors += sum(x.numel() * x.element_size() + dy.numel() * dy.element_size()
                               for x, dy in g.parts)
                g = g.dense
                if g is None:
                    continue
            n = g.numel() * g.element_size()
            if is_linear:
                linear += n
            else:
                other += n
        self.peak_linear = max(self.peak_linear, linear)
        self.peak_other = max(self.peak_other, other)
        self.peak_factors = max(self.peak_factors, factors)

    def state(self):
        return {"peak_linear": self.peak_linear, "peak_other": self.peak_other,
                "peak_factors": self.peak_factors}

    def load(self, state):
        self.peak_linear, self.peak_other = state["peak_linear"], state["peak_other"]
        self.peak_factors = state.get("peak_factors", 0)


def memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        import torch
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def memory_peak(device: torch.device) -> int:
    if device.type == "cuda":
        import torch
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def optimizer_report(optimizer) -> Dict[str, float]:
    """forge.optim's by-products of the last step (global grad norm, non-finite gradient
    elements skipped); empty for torch.optim."""
    out = {}
    for key in ("grad_norm", "nonfinite_count"):
        value = getattr(optimizer, key, None)
        if isinstance(value, (int, float)):
            out[key] = float(value)
    return out


class Progress:
    """tqdm on a terminal when installed, else a plain line every log_every steps
    (logs of a piped run stay readable)."""

    def __init__(self, start: int, total: int, log_every: int):
        self.total = total
        self.bar = None
        if sys.stdout.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=start, desc="forge-train", unit="step",
                                dynamic_ncols=True, file=sys.stdout)
            except ImportError:
                pass
        self.log_every = log_every or max(1, total // 20)

    def update(self, step: int, text: str):
        if self.bar is not None:
            try:
                self.bar.set_postfix_str(text, refresh=False)
                self.bar.update(1)
            except OSError:  # the terminal went away: no more bar (say())
                self.bar = None
                _silence(sys.stdout)
        elif (step + 1) % self.log_every == 0 or step + 1 == self.total:
            say(f"step {step + 1:>6}/{self.total}  {text}")

    def close(self):
        if self.bar is not None:
            try:
                self.bar.close()
            except OSError:
                _silence(sys.stdout)


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_path(args) -> str:
    """The file --resume names: OUT/checkpoint.pt by default, DIR/checkpoint.pt for a dir."""
    if not args.resume:
        return os.path.join(args.out, CHECKPOINT_NAME)
    if os.path.isdir(args.resume):
        return os.path.join(args.resume, CHECKPOINT_NAME)
    return args.resume


def checkpoint_tmp_path(path: str) -> str:
    """Where save_checkpoint writes before the rename."""
    return os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")


def remove_stale_tmp(path: str) -> None:
    """A save killed before its rename (SIGKILL, power loss) leaves its temporary file: it is
    removed, with a note; the checkpoint itself was never touched."""
    tmp = checkpoint_tmp_path(path)
    if os.path.exists(tmp):
        os.remove(tmp)
        say(f"forge-train: note: removed {tmp}, an unfinished checkpoint write of an earlier "
            f"run that was killed ({os.path.basename(path)} itself is as that run left it)",
            sys.stderr)


def save_checkpoint(path: str, state: dict) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it (atomic)."""
    import torch
    tmp = checkpoint_tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # interrupted or failed: the previous checkpoint stays as it was
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path: str) -> dict:
    import torch
    if not os.path.isfile(path):
        raise TrainError(f"no checkpoint to resume from at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise TrainError(f"cannot read checkpoint {path}: the file is corrupt or not a "
                         f"forge-train checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise TrainError(f"{path} is not a forge-train checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise TrainError(f"{path} is a version {state.get('version')} checkpoint; this "
                         f"forge-train reads version {CHECKPOINT_VERSION}")
    return state


def apply_saved_args(args, explicit, saved: dict, path: str) -> None:
    """Resume with the checkpoint's trajectory options; refuse a conflicting explicit one
    (--steps may change: it extends or shortens the run). Options are compared by the value
    the run uses: an explicit --lr 0.001 equals a checkpoint that took adamw's default."""
    for name in TRAJECTORY_OPTIONS + INHERITED_OPTIONS:
        if name not in saved:
            continue
        value, old = getattr(args, name), saved[name]
        if name in explicit and name in TRAJECTORY_OPTIONS and name != "steps" \
                and _effective(name, value, saved) != _effective(name, old, saved):
            raise TrainError(f"--{name.replace('_', '-')} {_shown(name, value, saved)} differs "
                             f"from the checkpoint's {_shown(name, old, saved)} ({path}); a "
                             "resumed run keeps the checkpoint's settings")
        if name not in explicit:
            setattr(args, name, old)


def _normal(value):
    return list(value) if isinstance(value, tuple) else value


def _optimizer_default(class_name: str, hparam: str):
    """The default of keyword `hparam` of torch.optim's (or forge.optim's) class_name, or None
    where neither can say."""
    import inspect
    import torch
    cls = getattr(torch.optim, class_name, None)
    if cls is None:
        try:
            import forge.optim as forge_optim
            cls = getattr(forge_optim, class_name, None)
        except Exception:  # libforge not loadable: nothing to read the default from
            return None
    try:
        default = inspect.signature(cls).parameters[hparam].default
    except (KeyError, TypeError, ValueError):
        return None
    return None if default is inspect.Parameter.empty else default


def _effective(name: str, value, saved: dict):
    """The value option `name` stands for in a run with the checkpoint's settings `saved`:
    None (not given) becomes the default the run used, where it is known."""
    if value is not None:
        return _normal(value)
    spec = OPTIMIZERS.get(str(saved.get("optimizer", "")).lower())
    if name == "lr" and spec is not None:
        return spec.lr
    if name == "warmup" and isinstance(saved.get("steps"), int):
        return saved["steps"] // 20
    if name in HPARAM_FLAGS and spec is not None:
        return _normal(_optimizer_default(spec.class_name, name))
    return None


_UNSET_NAMES = {"data": "built-in corpus", "state_format": "forge.optim's default",
                "master_weights": "forge.optim's default (off)",
                "stochastic_rounding": "forge.optim's default (on)",
                "baseline": "forge.optim (no baseline)"}


def _shown(name: str, value, saved: dict) -> str:
    """Option `name`'s value for a message: the value in effect, never "None"."""
    effective = _effective(name, value, saved)
    if effective is None:
        return _UNSET_NAMES.get(name, "the default")
    if isinstance(effective, list):
        return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in effective)
    if isinstance(effective, float):
        return f"{effective:g}"
    return str(effective)


def rng_state(device: torch.device) -> dict:
    import torch
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    import torch
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ----------------------------------------------------------------------------- training

@dataclasses.dataclass
class TrainResult:
    losses: List[float]
    steps: int
    peak_memory: int
    peak_linear_grad_bytes: int
    peak_other_grad_bytes: int
    tokens_per_s: float
    optimizer: str
    out: str
    grad_norms: List[float] = dataclasses.field(default_factory=list)
    nonfinite: int = 0           # gradient elements FORGE skipped (NaN/Inf), all steps


class TrainInterrupted(Exception):
    """Ctrl-C ended the run; the message says which checkpoint holds what (exit 130)."""


class InterruptGuard:
    """Ctrl-C (SIGINT) during training: the step in flight finishes, then the loop saves a
    checkpoint of it and stops. A FORGE step updates weights inside backward, so a step cut
    in the middle leaves no consistent state to save. A second Ctrl-C stops at once (a
    KeyboardInterrupt, no new checkpoint). Only in the main thread, where Python delivers
    signals; elsewhere Ctrl-C keeps its default. A SIGINT the process was started ignoring (a
    job run with nohup or in the background of a script) stays ignored."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False

    def _on_sigint(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        # NOTE: say(), not print(): an exception raised here would come out of whatever the
        # step was running (a closed pipe's BrokenPipeError ended the run without its save)
        say("\nforge-train: interrupted: finishing this step, then saving its checkpoint "
            "(Ctrl-C again stops at once, without one)", sys.stderr)


def train(args, explicit=frozenset()) -> TrainResult:
    """Runs one forge-train job; raises TrainError on bad input, TrainInterrupted on Ctrl-C."""
    spec = resolve_optimizer(args, explicit)
    check_numbers(args)
    check_precision(args)
    resolve_out(args, explicit)
    check_out(args.out)
    check_out_unused(args)

    import torch
    from forge.tools import data as forge_data
    from forge.tools import models as forge_models

    resume_state = None
    ckpt_file = os.path.join(args.out, CHECKPOINT_NAME)
    remove_stale_tmp(ckpt_file)
    saved_step = None  # the step ckpt_file holds, where this run knows it
    if args.resume is not None:
        resume_from = checkpoint_path(args)
        resume_state = load_checkpoint(resume_from)
        apply_saved_args(args, explicit, resume_state["args"], resume_from)
        spec = resolve_optimizer(args, explicit)
        if os.path.abspath(resume_from) == os.path.abspath(ckpt_file):
            saved_step = resume_state["step"]
    check_precision(args)
    from forge.tools import parallel
    try:
        par = parallel.from_environment(args.tp, args.fsdp, args.device)
    except parallel.ParallelError as e:
        raise TrainError(str(e)) from None
    if par is not None:
        if args.save_every or args.resume is not None or args.cuda_graph:
            raise TrainError("--save-every, --resume and --cuda-graph: forge-train does not do "
                             "them for a run spread over ranks (torch.distributed.checkpoint "
                             "saves and reshards forge.optim's states: README)")
        if not par.main:  # one process reports
            sys.stdout = open(os.devnull, "w")
    device = par.device if par is not None else pick_device(args.device)
    check_cuda_graph(args, device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    warmup = args.warmup if args.warmup is not None else args.steps // 20

    # Model (seeded: the same seed gives the same initial weights) and tokenizer.
    torch.manual_seed(args.seed)
    try:
        model, kind, max_seq = forge_models.build_model(args.model, device, dtype)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if args.seq_len > max_seq:
        raise TrainError(f"--seq-len {args.seq_len} is longer than model {args.model!r} "
                         f"allows ({max_seq})")
    tokenizer = forge_data.ByteTokenizer()
    if kind == "hf":
        tokenizer = _hf_tokenizer(args.model) or tokenizer
        if tokenizer.vocab_size > model.config.vocab_size:
            raise TrainError(f"model vocabulary {model.config.vocab_size} is smaller than the "
                             f"tokenizer's {tokenizer.vocab_size}")
    if args.activation_checkpointing:
        forge_models.enable_activation_checkpointing(model)
    rows = slice(None)
    if par is not None:
        try:
            parallel.apply(model, par, args.sequence_parallel)
            rows = par.batch_rows(args.batch_size)
        except parallel.ParallelError as e:
            raise TrainError(str(e)) from None
    if args.lean_activations:
        from forge.lean import enable_lean_activations
        if not any(enable_lean_activations(model).values()):
            raise TrainError(f"--lean-activations: model {args.model!r} has no RMSNorm or "
                             "SwiGLU MLP it knows how to recompute")
    model.train()
    try:
        data = forge_data.make_data(args.data, tokenizer, args.seq_len, args.batch_size,
                                    args.seed, max_bytes=args.max_data_mb << 20)
    except forge_data.DataError as e:
        raise TrainError(str(e)) from None

    tracker = GradientBytesTracker(model)  # before the optimizer: see its docstring
    optimizer, opt_label = make_optimizer(model, spec, args, device)
    schedule = make_schedule(optimizer, args.steps, warmup, args.min_lr_ratio)

    start, losses, grad_norms = 0, [], []
    if resume_state is not None:
        try:
            model.load_state_dict(resume_state["model"])
            optimizer.load_state_dict(resume_state["optimizer"])
            schedule.load_state_dict(resume_state["scheduler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise TrainError(f"checkpoint does not match this model/optimizer: "
                             f"{str(e).splitlines()[0]}") from None
        set_rng_state(resume_state["rng"], device)
        tracker.load(resume_state["tracker"])
        start, losses = resume_state["step"], list(resume_state["losses"])
        grad_norms = list(resume_state.get("grad_norms", []))
        if start >= args.steps:
            raise TrainError(f"the checkpoint is at step {start}: nothing to do for "
                             f"--steps {args.steps}")

    n_params = forge_models.count_parameters(model)
    if par is not None:
        say(f"forge-train: {par.world} ranks: tensor parallel {par.tp}"
            f"{' (sequence parallel)' if par.tp > 1 and args.sequence_parallel is not False else ''}, "
            f"data parallel {par.dp}{' (FSDP2)' if par.fsdp else ''}")
    say(f"forge-train: model {args.model} ({n_params / 1e6:.2f} M parameters, "
        f"{str(dtype).replace('torch.', '')}{', bf16 autocast' if args.amp else ''}) on "
        f"{device}; data {data.description}; "
        f"tokenizer {tokenizer.name}; optimizer {opt_label}; "
        f"{args.steps} steps of {args.batch_size}×{args.seq_len} tokens"
        + (f"; resuming at step {start}" if start else ""))
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise TrainError(f"--out {args.out}: cannot create it ({e.strerror})") from None
    if args.overwrite and saved_step is None and (par is None or par.main):
        remove_run_files(args.out)  # (not the checkpoint this run resumes from)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    saved_args = {name: _normal(getattr(args, name))
                  for name in TRAJECTORY_OPTIONS + INHERITED_OPTIONS}
    tokens_per_step = args.batch_size * args.seq_len
    progress = Progress(start, args.steps, args.log_every)
    timed_tokens, timed_s = 0, 0.0
    nonfinite = resume_state.get("nonfinite", 0) if resume_state else 0

    def checkpoint(done: int) -> dict:
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                "step": done, "args": saved_args, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": schedule.state_dict(),
                "rng": rng_state(device), "tracker": tracker.state(),
                "losses": losses, "grad_norms": grad_norms, "nonfinite": nonfinite}

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = lm_loss(model, tokens)
        loss.backward()           # FORGE: every nn.Linear weight is updated here
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if args.cuda_graph:  # two eager steps, then one capture: every call is one step
        from forge.graphs import CUDAGraphStep
        train_step = CUDAGraphStep(train_step, optimizers=[optimizer], warmup=2)
    step = start
    try:
        with InterruptGuard() as interrupt:
            for step in range(start, args.steps):
                t0 = time.perf_counter()
                tokens = data.batch(step, device)[rows]
                loss = train_step(tokens)
                schedule.step()           # (forge.optim reads the new lr at the next replay)
                if par is not None and par.dp > 1:  # the global batch's loss
                    loss = loss.detach().clone()
                    torch.distributed.all_reduce(loss)
                    loss /= par.dp * par.tp
                loss_value = loss.item()  # synchronises: the step's time is complete
                dt = time.perf_counter() - t0
                if not math.isfinite(loss_value):
                    raise TrainError(f"the loss became {loss_value} at step {step + 1}; lower "
                                     "--lr or check the data")
                losses.append(loss_value)
                report = optimizer_report(optimizer)
                if "grad_norm" in report:
                    grad_norms.append(report["grad_norm"])
                nonfinite += int(report.get("nonfinite_count", 0))
                if step > start:  # the first step pays one-time costs
                    timed_tokens += tokens_per_step
                    timed_s += dt
                rate = timed_tokens / timed_s if timed_s else tokens_per_step / dt
                text = (f"loss {loss_value:.4f} | {rate:,.0f} tok/s | "
                        f"mem {human_bytes(memory_now(device))}")
                if "grad_norm" in report:
                    text += f" | gnorm {report['grad_norm']:.3g}"
                progress.update(step, text)
                done = step + 1
                if args.save_every and (done % args.save_every == 0 or done == args.steps):
                    save_checkpoint(ckpt_file, checkpoint(done))
                    saved_step = done
                if interrupt.requested and done < args.steps:
                    if saved_step != done:
                        save_checkpoint(ckpt_file, checkpoint(done))
                        saved_step = done
                    raise TrainInterrupted(
                        f"interrupted after step {done} of {args.steps}; {ckpt_file} holds "
                        f"step {done}: continue with forge-train --resume {args.out}")
            # Every run ends with its checkpoint (a resumed one's moves to its end): the
            # metrics written below and the checkpoint then say the same step.
            if par is None and saved_step != args.steps:
                save_checkpoint(ckpt_file, checkpoint(args.steps))
                saved_step = args.steps
    except KeyboardInterrupt:  # a second Ctrl-C: the step in flight is lost
        kept = (f"{ckpt_file} (step {saved_step}) is kept" if saved_step is not None else
                "no checkpoint was written (one Ctrl-C lets the step finish and saves it)")
        raise TrainInterrupted(f"interrupted during step {step + 1}; {kept}") from None
    finally:
        progress.close()

    result = TrainResult(
        losses=losses, steps=args.steps, peak_memory=memory_peak(device),
        peak_linear_grad_bytes=tracker.peak_linear, peak_other_grad_bytes=tracker.peak_other,
        tokens_per_s=timed_tokens / timed_s if timed_s else 0.0, optimizer=opt_label,
        out=args.out, grad_norms=grad_norms, nonfinite=nonfinite)
    if par is None or par.main:
        write_outputs(args, result, n_params, device, ckpt_file if par is None else None)
    return result


def _hf_tokenizer(model_path: str):
    from forge.tools import data as forge_data
    directory = os.path.dirname(model_path) if model_path.endswith(".json") else model_path
    if not any(os.path.isfile(os.path.join(directory, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return forge_data.HFTokenizer(AutoTokenizer.from_pretrained(directory))


def write_outputs(args, result: TrainResult, n_params: int, device: torch.device,
                  checkpoint_file: Optional[str] = None) -> None:
    """metrics.json, loss.png and the summary on stdout (naming checkpoint_file, the run's
    last checkpoint, where it wrote one)."""
    metrics = {"losses": result.losses, "grad_norms": result.grad_norms,
               "optimizer": result.optimizer, "model": args.model, "parameters": n_params,
               "device": str(device), "peak_memory_bytes": result.peak_memory,
               "peak_linear_weight_grad_bytes": result.peak_linear_grad_bytes,
               "peak_other_grad_bytes": result.peak_other_grad_bytes,
               "tokens_per_s": result.tokens_per_s, "nonfinite_skipped": result.nonfinite,
               "command": sys.argv}
    with open(os.path.join(args.out, METRICS_NAME), "w") as f:
        json.dump(metrics, f, indent=1)
    plot_note = "skipped (--no-plot)"
    if not args.no_plot:
        plot_note = plot_losses({result.optimizer: result.losses},
                                os.path.join(args.out, PLOT_NAME),
                                f"forge-train: {args.model}, {result.optimizer}")
    tail = result.losses[-10:]
    memory_kind = "GPU, max_memory_allocated" if device.type == "cuda" else "process peak RSS"
    lines = [
        f"\nforge-train: done, {len(result.losses)} steps with {result.optimizer}",
        f"  final loss            {result.losses[-1]:.4f} (mean of last {len(tail)}: "
        f"{sum(tail) / len(tail):.4f}; first {result.losses[0]:.4f})",
        f"  peak memory           {human_bytes(result.peak_memory)} ({memory_kind})",
        f"  weight gradients held nn.Linear weights {human_bytes(result.peak_linear_grad_bytes)},"
        f" other parameters {human_bytes(result.peak_other_grad_bytes)} (most alive at once, "
        "measured by hooks)"]
    if result.grad_norms:  # forge.optim: its by-products of the step
        lines.append(f"  non-finite gradients  {result.nonfinite} elements skipped "
                     "(their weights untouched)")
    lines += [f"  throughput            {result.tokens_per_s:,.0f} tokens/s",
              f"  loss curve            {plot_note}",
              f"  metrics               {os.path.join(args.out, METRICS_NAME)}"]
    if checkpoint_file is not None:
        lines.append(f"  checkpoint            {checkpoint_file} (step {result.steps}; "
                     f"forge-train --resume {args.out} --steps N goes on)")
    say("\n".join(lines))


def plot_losses(curves: Dict[str, List[float]], path: str, title: str) -> str:
    """Writes a loss-curve PNG; returns where, or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed (the losses are in metrics.json)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args, explicit = parse_args(argv)
    # NOTE: OpenMP threads that spin after every parallel region (libgomp's default when
    # OMP_WAIT_POLICY is unset) starve each other on a small machine with anything else
    # running: steps of the default run measured 3-10x slower than with passive waiting. Set
    # before torch loads its OpenMP runtime (it reads the variable then); a value the user
    # set wins, and a process that imported torch already keeps what it has.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        code = _run(args, explicit)
    except BaseException:
        _leave_process_group()
        raise
    return _leave_process_group(code)


def _run(args, explicit) -> int:
    """train(), its expected failures as an exit code and a message."""
    try:
        train(args, explicit)
    except TrainError as e:
        say(f"forge-train: error: {e}", sys.stderr)
        return 2
    except TrainInterrupted as e:
        say(f"forge-train: {e}", sys.stderr)
        return 130
    except KeyboardInterrupt:  # before the first step or after the last: nothing new to save
        say("\nforge-train: interrupted outside the training steps (nothing new to save)",
            sys.stderr)
        return 130
    except Exception as e:
        if not _out_of_memory(e):
            raise
        say("forge-train: error: out of memory; try a smaller --batch-size or --seq-len, "
            "--activation-checkpointing or --bf16", sys.stderr)
        return 2
    return 0


def _leave_process_group(code: Optional[int] = None) -> Optional[int]:
    """Under torchrun: parallel.leave (the process ends there when code is given)."""
    if "torch.distributed" not in sys.modules:
        return code
    from forge.tools import parallel
    return parallel.leave(code)


def _out_of_memory(e: Exception) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return isinstance(e, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))


if __name__ == "__main__":
    sys.exit(main())
