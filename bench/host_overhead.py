"""host_overhead.py — the host's cost of one Linear per training step, FORGE against torch.

A stack of LAYERS tiny nn.Linear (16 × 16, 4 tokens), so that the arithmetic is negligible and
what is timed is the host's work per layer: the forward call, autograd's backward, and the
optimizer (forge.optim.AdamW: the patched forward, the backward's hook and the C ABI call;
torch.optim.AdamW(foreach=True): one multi-tensor step for all layers). On a GPU each step ends
with a synchronize, so the figure is the wall time per step over LAYERS.
--dtype bf16 runs the stack in bf16 with forge.optim's default states (stochastically rounded
bf16), the configuration of forge-bench's forge-bf16 mode: on a Hopper GPU its steps take the
TMA kernel, whose call also encodes two tensor maps (fp32 takes the SIMT kernel).
--layer conv1d times transformers' Conv1D (GPT-2's transposed Linear, 16 × 16, with its bias)
instead of nn.Linear (needs transformers).
--layer scale times element-wise parameters instead: a stack of x * w with w a [1024]
parameter (what a norm's weight costs: forge.optim's post-accumulate-grad hook and
forge_elementwise_step per parameter, against torch's one multi-tensor step); its figure is
µs per parameter per step.
--hook-path (with --layer scale) puts those parameters on forge.optim's hook path (each applied
inside backward by its own hook, as parameters above forge.optim.routing.BATCHED_MAX_ELEMENTS
are) instead of the batched path (one library call at step()) that parameters this small take.
--compile runs both stacks' models under torch.compile (default mode, Inductor; the optimizers
as they are): the stack is one graph, and FORGE's backward calls its custom operators per
Linear (forge/_ops.py); the first warm-up step compiles.
--tokens T: rows of the input (default 4). Under --compile a hand-off keeps X and dY where they
take fewer bytes than dW and forms dW otherwise (then W is updated element-wise): with these
16 × 16 layers, --tokens 64 times that path.

    python bench/host_overhead.py [--device cpu|cuda] [--dtype fp32|bf16] [--layers 100]
                                  [--layer linear|conv1d|scale] [--hook-path] [--steps 200]
                                  [--compile] [--tokens 4]
                                  [--profile N] [--baseline DIR]
--profile N: then N more steps of each optimizer under cProfile (the top functions).
--baseline DIR: also measure the forge.optim.AdamW of another FORGE, whose `forge` package is in
DIR (a checkout's python/ directory: `git worktree add /tmp/base REV`, then /tmp/base/python),
in the same rounds and process as the two others: a change's before and after, compared where
the host's drift cannot come between them (it moves these figures by tens of percent between
processes). Both use the libforge this process loads. Not with --compile (two packages cannot
both define the forge:: operators): alternate the two checkouts' processes instead.

Prints microseconds per layer (or parameter) per step (median over the steps after 20
warm-ups); --json PATH also writes them for bench/record.py.
"""
import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import forge.optim  # noqa: E402

WARMUP = 20


class Scale(torch.nn.Module):
    """x * w: one element-wise parameter, as a norm's weight."""

    def __init__(self, width: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.w


def load_baseline(directory: str):
    """The forge.optim of the FORGE package in directory/forge, imported as forge_baseline
    (beside this checkout's forge: its modules import each other relatively)."""
    import importlib
    import importlib.util
    package = os.path.join(directory, "forge")
    init = os.path.join(package, "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"--baseline: no FORGE package at {package} (give a checkout's python/)")
    # (the library this process loaded, wherever the baseline's own search would look)
    os.environ.setdefault("FORGE_LIBRARY", str(forge._lib.get().path))
    spec = importlib.util.spec_from_file_location("forge_baseline", init,
                                                  submodule_search_locations=[package])
    module = importlib.util.module_from_spec(spec)
    sys.modules["forge_baseline"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("forge_baseline.optim")


def baseline_label(directory: str) -> str:
    """The commit of the checkout whose python/ directory is `directory` (short hash), else
    the directory itself."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", directory, *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        top = git("rev-parse", "--show-toplevel")
        if os.path.realpath(os.path.join(top, "python")) == os.path.realpath(directory):
            return git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pass
    return directory


def train_step(model, opt, x) -> None:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def per_layer_us(model, opt, x, steps: int, layers: int, warmup: int = WARMUP) -> float:
    cuda = x.is_cuda
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        train_step(model, opt, x)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times) / layers * 1e6


def profile_steps(model, opt, x, steps: int, label: str) -> None:
    """`steps` more steps under cProfile: the host's time by Python function (cProfile's own
    overhead inflates it), the top 15 by own time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        train_step(model, opt, x)
    if x.is_cuda:
        torch.cuda.synchronize()
    pr.disable()
    print(f"--- {label}: {steps} steps under cProfile, top 15 by own time")
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--layer", choices=("linear", "conv1d", "scale"), default="linear",
                   help="linear: 16x16 nn.Linear; conv1d: 16x16 transformers Conv1D; scale: "
                        "x * w, w of 1024 elements (see above)")
    p.add_argument("--hook-path", action="store_true",
                   help="--layer scale: the parameters on the hook path (see the file header)")
    p.add_argument("--compile", action="store_true",
                   help="both models under torch.compile (see the file header)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="measure each optimizer N times, alternating (order reversed every other "
                        "round), and report the median of the rounds: on a busy host a single "
                        "pass of each measures the load as much as the code")
    p.add_argument("--baseline", metavar="DIR",
                   help="also measure the FORGE whose package is in DIR (see the file header)")
    p.add_argument("--tokens", type=int, default=4, metavar="T",
                   help="rows of the input (default 4). Under --compile a hand-off keeps X and dY "
                        "while they are smaller than dW (T * 32 < 256 elements for 16 x 16 "
                        "layers) and forms dW otherwise: --tokens 64 times that path")
    p.add_argument("--json", metavar="PATH", help="also write the figures there (bench/record.py "
                   "appends them to the results table)")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    width = 1024 if args.layer == "scale" else 16
    x = torch.randn(args.tokens, width, device=device, dtype=dtype)
    if args.layer == "conv1d":
        try:
            from transformers.pytorch_utils import Conv1D
        except ImportError as e:
            p.error(f"--layer conv1d: needs transformers ({e})")

    def layer():
        if args.layer == "linear":
            return torch.nn.Linear(16, 16, bias=False)
        return Conv1D(16, 16) if args.layer == "conv1d" else Scale(width)

    def stack():
        return torch.nn.Sequential(*[layer() for _ in range(args.layers)]).to(device, dtype)

    if args.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {args.rounds}")
    if args.baseline and args.compile:
        # (both packages would define the forge:: operators, and the second one's definition
        # is refused: its compiled model would break the graph at every Linear)
        p.error("--baseline with --compile: two FORGE packages in one process cannot both "
                "register their operators; run each checkout's --compile in its own process")
    if args.hook_path:
        if args.layer != "scale":
            p.error("--hook-path: for --layer scale (a Linear's weight is fused)")
        forge.optim.routing.BATCHED_MAX_ELEMENTS = 0
    torch_model = stack()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-6, foreach=True)
    forge_model = stack()
    states = {"state_format": "fp32"} if dtype == torch.float32 else {}  # bf16: the default
    forge_opt = forge.optim.AdamW(forge_model, lr=1e-6, mode="immediate", **states)
    if args.compile:
        torch_model, forge_model = torch.compile(torch_model), torch.compile(forge_model)
    runs = {"torch": (torch_model, torch_opt), "forge": (forge_model, forge_opt)}
    if args.baseline:
        baseline_optim = load_baseline(args.baseline)
        if args.hook_path:
            baseline_optim.routing.BATCHED_MAX_ELEMENTS = 0
        baseline_model = stack()
        baseline_model.load_state_dict(forge_model.state_dict())
        runs["baseline"] = (baseline_model, baseline_optim.AdamW(baseline_model, lr=1e-6,
                                                                 mode="immediate", **states))
    measured = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            model, opt = runs[name]
            measured[name].append(per_layer_us(model, opt, x, args.steps, args.layers,
                                                warmup=WARMUP if r < 2 else 2))
    torch_us, forge_us = (statistics.median(measured[k]) for k in ("torch", "forge"))
    baseline_us = statistics.median(measured["baseline"]) if args.baseline else None
    baseline = f"forge.optim.AdamW at {baseline_label(args.baseline)}" if args.baseline else None
    if args.profile:
        profile_steps(*runs["torch"], x, args.profile, "torch AdamW(foreach)")
        profile_steps(*runs["forge"], x, args.profile, "forge.optim.AdamW")
    compiled = (", hook path" if args.hook_path else "") + \
        (", torch.compile" if args.compile else "")
    what = {"linear": ("Linear", f"{args.layers} Linears of 16x16"),
            "conv1d": ("Conv1D", f"{args.layers} Conv1Ds of 16x16 with bias"),
            "scale": ("parameter", f"{args.layers} element-wise parameters of 1024")}[args.layer]
    tokens = f" {args.tokens} tokens" if args.tokens != 4 else ""  # (default: unnamed)
    print(f"host cost per {what[0]} per step ({what[1]}{',' if tokens else ''}{tokens}, "
          f"{args.dtype}, {device}"
          f"{compiled}, torch {torch.__version__}, median of {args.rounds} round(s)): torch "
          f"AdamW(foreach) {torch_us:.1f} us, forge.optim.AdamW {forge_us:.1f} us"
          + (f", {baseline} {baseline_us:.1f} us" if args.baseline else ""))
    if args.json:
        shape = {"linear": "Linears 16x16", "conv1d": "Conv1Ds 16x16 with bias",
                 "scale": "element-wise params 1024"}[args.layer]
        case = f"{args.layers} {shape}{tokens} {args.dtype} {device.type}{compiled}"
        metric = "us_per_param" if args.layer == "scale" else "us_per_linear"
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        with open(args.json, "w") as f:
            json.dump({"benchmark": "host_overhead", "gpu": gpu,
                       "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                       "command": " ".join(["python3", "bench/host_overhead.py"] + sys.argv[1:]),
                       "torch": torch.__version__,
                       "results": [{"case": case, "variant": "torch AdamW(foreach)",
                                    metric: torch_us},
                                   {"case": case, "variant": "forge.optim.AdamW",
                                    metric: forge_us}]
                       + ([{"case": case, "variant": baseline, metric: baseline_us}]
                          if args.baseline else [])}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
