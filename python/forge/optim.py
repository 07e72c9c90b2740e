"""optim.py — forge.optim: drop-in torch.optim optimizers whose updates run inside backward.

    opt = forge.optim.AdamW(model, lr=3e-4, weight_decay=0.1, state_format="int8")
    loss.backward()   # every parameter is updated here, as soon as its gradient is complete
    opt.step()        # completes the step: bookkeeping, and anything not yet updated
    opt.zero_grad()

Constructors take the nn.Module first, then torch.optim's own keyword names and defaults.
Each optimized parameter takes one of three paths (a "slot" each):

  fused     the weight of an nn.Linear: its forward is rerouted to FusedLinearFunction
            (_linear.py), whose backward computes dX and hands (X, dY) to the slot. When
            autograd reaches the weight's AccumulateGrad node (all consumers of W in this
            backward are done), a pre-hook runs forge_wgrad_step: dW = dYᵀX tile by tile
            with the update applied in place; no dW tensor exists. If W had more than one
            use (a Linear applied twice, or W also read outside its Linear) the hook sums
            the full gradient in fp32 instead and applies forge_elementwise_step once.
  hook      any other parameter (bias, norm, embedding): a post-accumulate-grad hook
            (torch >= 2.1) applies forge_elementwise_step and frees .grad at once.
  deferred  a parameter registered in more than one place (tied embeddings), or every
            parameter when torch lacks the hooks: autograd accumulates its full .grad and
            step() applies the update, then frees the .grad.

Every update reads its hyper-parameters from the param_group at the time it runs (so LR
schedulers apply), uses the parameter's own 1-based step count (torch's state['step']),
and seeds stochastic rounding with seed + the parameter's index.

A second backward before step() raises, unless accumulate_grad=True: then no update runs
in backward, every parameter's full gradient is kept in .grad (as torch.optim does: one
gradient-sized buffer per parameter, the memory FORGE otherwise saves), and step()
applies them. That mode also makes global-norm clipping of .grad exact.

CUDA graphs (forge.graphs.CUDAGraphStep): while a step is captured, each update is
launched with hparams.run_scalars pointing at the parameter's 256-byte region of a device
buffer, from which the kernel reads its step, lr and seed dependent scalars when it runs;
the capture advances no step count. Before each replay _prepare_replay advances the counts,
fills the regions from the param groups of that moment (so an LR scheduler applies) and
copies them to the device in one transfer.
"""
from __future__ import annotations

import ctypes
import math
import operator
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import _lib
from . import _linear

__all__ = ["AdamW", "Adam", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "SGD",
           "param_groups_no_decay"]

# Load libforge now: `import forge.optim` fails here, with the places it looked, when the
# library cannot be found (forge._lib.LibraryNotFound, an ImportError).
_lib.get()

STATE_FORMATS = ("fp32", "bf16", "int8")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

# Tests set this to exercise the fallback for torch without the autograd hooks.
_FORCE_NO_HOOKS = False

# Entries of the optimizer's small caches (hyper-parameters, devices) before they are
# emptied: a scheduler's new lr every step, or a new CUDA stream every step, stays bounded.
_CACHE_LIMIT = 64


def _has_post_accumulate_hook() -> bool:
    return (not _FORCE_NO_HOOKS
            and hasattr(torch.Tensor, "register_post_accumulate_grad_hook"))


def _has_node_prehook() -> bool:
    return not _FORCE_NO_HOOKS and hasattr(torch.autograd.graph.Node, "register_prehook")


def param_groups_no_decay(model: nn.Module, weight_decay: float,
                          no_decay: Sequence[str] = ("bias", "norm")) -> List[Dict[str, Any]]:
    """Two param groups for `params=`: decayed (weights with ≥ 2 dims) and not decayed
    (biases, norm weights: any parameter with < 2 dims or whose name contains one of
    `no_decay`). Frozen parameters are left out; a shared parameter is listed once."""
    decay, keep = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        lowered = name.lower()
        if p.dim() < 2 or any(word in lowered for word in no_decay):
            keep.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class _Slot:
    """One optimized parameter: its path, names, and what backward left for it."""

    def __init__(self, opt: "_ForgeOptimizer", param: torch.Tensor, index: int,
                 names: List[str], mode: str):
        self.opt_ref = weakref.ref(opt)
        self.param = param
        self.index = index          # position in param_groups order (state_dict index)
        self.names = names
        self.name = names[0]
        self.mode = mode            # "fused" | "hook" | "deferred"
        self.dtype = param.dtype
        self.device = param.device
        shape = param.shape
        self.cols = int(shape[-1]) if param.dim() >= 1 else 1
        self.rows = param.numel() // self.cols if self.cols else 0
        # (x [T, cols], ldx, dy [T, rows], lddy, raw handle of the CUDA stream they were made
        # on, its device index); the last two are None on the CPU
        self.pending: List[Tuple[torch.Tensor, int, torch.Tensor, int,
                                 Optional[int], Optional[int]]] = []
        self.partial: Optional[torch.Tensor] = None  # fp32 dW sum, for weights with > 1 use
        self.uses = 0               # Linear backward calls seen since the last update
        self.updated_at = -1        # opt._step_id when last updated
        self.signature = None       # (rule, names of states) the states were made for
        self.handles: List[Any] = []
        self.acc_node = None        # W's AccumulateGrad node, held so its hook lives
        self.marker: Optional[torch.Tensor] = None  # stand-in dW of this backward (see below)
        self.stand_in: Optional[torch.Tensor] = None  # the marker, made once (a zero, expanded)
        # (formats and data pointers, forge_param) of the last update; rebuilt on any change
        self.param_cache: Optional[Tuple[tuple, Any]] = None
        self.modules: List[nn.Linear] = []
        self.warned_multi_use = False

    def is_live(self) -> bool:
        opt = self.opt_ref()
        return opt is not None and opt._attached

    def linear_backward(self, x, dy, weight):
        opt = self.opt_ref()
        if opt is None or not opt._attached:
            return _materialize_dw(x, dy, weight)  # plain nn.Linear behaviour
        return opt._linear_backward(self, x, dy, weight)


def _materialize_dw(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ·X in the compute dtype, as torch's linear backward, cast to W's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    return dy2.t().matmul(x2).to(weight.dtype)


class _RunScalars:
    """One device's run-scalars buffer: RUN_SCALARS_BYTES per parameter (by slot index), read
    by captured kernels, and two pinned host staging buffers _prepare_replay fills in turn.

    NOTE: two staging buffers, each with an event recorded after its copy: the host fills
    one while the copy from the other may still be pending, and waits on a buffer's event
    only before refilling it, so filling step n+1 never writes bytes step n's copy reads."""

    def __init__(self, count: int, device: torch.device):
        nbytes = count * _lib.RUN_SCALARS_BYTES
        self.count = count
        self.device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.device_address = self.device.data_ptr()  # 512-byte aligned (caching allocator)
        self.staging = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.current = 1
        self.host_address = 0

    def next_staging(self) -> None:
        """The other staging buffer, once its last copy is done: host_address is its start."""
        self.current ^= 1
        self.events[self.current].synchronize()  # (returns at once if never recorded)
        self.host_address = self.staging[self.current].data_ptr()

    def upload(self) -> None:
        """Copies the current staging buffer to the device on the device's current stream."""
        self.device.copy_(self.staging[self.current], non_blocking=True)
        self.events[self.current].record(torch.cuda.current_stream(self.device.device))


class _Capture:
    """What one capture of an optimizer's step recorded (_begin_capture .. _end_capture)."""

    def __init__(self, step_id: int, states_loaded: int, last_stats):
        self.step_id = step_id              # opt._step_id when the capture began
        self.states_loaded = states_loaded  # opt._states_loaded then
        self.last_stats = last_stats        # opt._last_stats then (restored after)
        self.run_scalars: Dict[int, _RunScalars] = {}  # device index -> buffers it reads
        # (slot, its hyper-parameters but step/lr/seed, its buffers) per update captured
        self.slots: List[Tuple[_Slot, tuple, _RunScalars]] = []
        self.seen: set = set()              # id(slot) of those
        self.fixed: Dict[tuple, tuple] = {}  # the distinct _fixed_hparams of those, interned
        self.steps = 0                      # opt.step() calls captured
        self.stats = None                   # the statistics tensors the captured step writes


# What a captured update keeps: every field but these, which are read at each replay.
_REPLAY_FIELDS = ("step", "lr", "seed", "run_scalars")


def _fixed_hparams(hp: _lib.Hparams) -> tuple:
    return tuple(getattr(hp, name) for name, _ in hp._fields_ if name not in _REPLAY_FIELDS)


class _ForgeOptimizer(torch.optim.Optimizer):
    """The shared machinery; the public classes only say which rule and which keys.

    FORGE options, keyword-only on every optimizer:
      params               param groups (dicts, as torch.optim takes) over the model's
                           parameters; default: every parameter with requires_grad, one group.
                           See param_groups_no_decay().
      state_format         "fp32" | "bf16" | "int8" (block-64 dynamic map + fp32 absmax).
      master_weights       bf16 parameters keep an fp32 master copy (state "master"); the
                           bf16 weight is its nearest rounding. No effect on fp32 parameters.
      stochastic_rounding  bf16 weight and state stores round stochastically (default True);
                           the bits come from (seed + parameter index, step, element).
      seed                 see stochastic_rounding.
      accumulate_grad      no update in backward: .grad accumulates (memory: one full
                           gradient per parameter, as torch.optim) and step() applies it.
      num_threads          CPU backend threads (0: torch.get_num_threads()).
    """

    _torch_name = "?"

    def __init__(self, model: nn.Module, params, defaults: Dict[str, Any], *,
                 state_format: str = "fp32", master_weights: bool = False,
                 stochastic_rounding: Optional[bool] = None, seed: int = 0,
                 accumulate_grad: bool = False, num_threads: int = 0):
        self._attached = False
        self._lib = _lib.get()
        self._default_hparams: Dict[int, _lib.Hparams] = {}
        self._group_cache: Dict[int, Dict[str, Any]] = {}
        # The group keys _hparams reads (the rule's defaults, and what the base class reads),
        # and the cache over their values; see _group_hparams.
        self._hparam_keys = tuple(sorted(set(defaults) | {"lr", "weight_decay", "maximize"}))
        self._hparam_values = operator.itemgetter(*self._hparam_keys)  # (3 keys at least)
        self._hparams_cache: Dict[tuple, Tuple[_lib.Hparams, tuple]] = {}
        # (device index, raw stream handle) or (-1, CPU threads) -> forge_device; see
        # _device_struct
        self._devices: Dict[Tuple[int, int], _lib.Device] = {}
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self._torch_name}: the first argument must be the nn.Module to "
                            f"train, got {type(model).__name__} (forge.optim takes the model, "
                            "not model.parameters())")
        if state_format not in STATE_FORMATS:
            raise ValueError(f"state_format: unknown value {state_format!r}; choose one of "
                             f"{', '.join(STATE_FORMATS)}")
        if stochastic_rounding is not None and not isinstance(stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding: must be a bool or None, got "
                            f"{type(stochastic_rounding).__name__}")
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights: must be a bool, got {type(master_weights).__name__}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed: must be an int in [0, 2**63), got {seed!r}")
        if not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads: must be an int >= 0, got {num_threads!r}")
        self.state_format = state_format
        self.master_weights = master_weights
        self.stochastic_rounding = True if stochastic_rounding is None else stochastic_rounding
        self.seed = seed
        self.num_threads = num_threads
        self._accumulate_grad = bool(accumulate_grad)
        self._model_ref = weakref.ref(model)

        names = _parameter_names(model)
        if params is None:
            params = _unique([p for p in model.parameters() if p.requires_grad])
            if not params:
                raise ValueError(f"{self._torch_name}: the model has no trainable parameters "
                                 "(none with requires_grad=True)")
        super().__init__(params, defaults)  # validates each group (add_param_group below)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._check_params(model, all_params, names)

        # Everything is checked: only now is the model touched.
        self._slots: Dict[int, _Slot] = {}
        self._step_id = 0                 # number of completed step() calls
        self._stats: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._stats_outputs: Dict[torch.device, _lib.StepOutputs] = {}  # pointers into _stats
        self._last_stats: Optional[Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]]] = None
        # CUDA graphs (see forge.graphs): the capture in progress (its updates read their
        # scalars from run-scalars buffers), the last one ended, the buffers by device index,
        # and a count of load_state_dict calls (they replace the state tensors a graph reads).
        self._capturing = False
        self._capture: Optional[_Capture] = None
        self._last_capture: Optional[_Capture] = None
        self._run_scalars: Dict[int, _RunScalars] = {}
        self._states_loaded = 0
        self._any_cuda = False  # a parameter on CUDA (set by _attach)
        self._attached = True
        self._attach(model, all_params, names)

    # ------------------------------------------------------------------ public surface

    @property
    def accumulate_grad(self) -> bool:
        """True: backward only accumulates .grad (full gradients, torch.optim's memory);
        step() applies them. May be switched between steps."""
        return self._accumulate_grad

    @accumulate_grad.setter
    def accumulate_grad(self, value: bool) -> None:
        if any(s.updated_at == self._step_id or s.pending or s.partial is not None
               for s in self._slots.values()):
            raise RuntimeError("accumulate_grad can only be switched between steps (call "
                               "opt.step() first)")
        self._accumulate_grad = bool(value)

    @property
    def grad_norm(self) -> Optional[float]:
        """Global L2 norm of the gradients the last step() consumed (every parameter,
        finite elements), a by-product of the update; None before the first step()."""
        if self._last_stats is None:
            return None
        return math.sqrt(sum(float(sq.item()) for sq, _ in self._last_stats.values()))

    @property
    def nonfinite_count(self) -> Optional[int]:
        """Gradient elements of the last step that were NaN/Inf: their weight and states
        were left untouched. None before the first step()."""
        if self._last_stats is None:
            return None
        return sum(int(nf.item()) for _, nf in self._last_stats.values())

    @torch.no_grad()
    def step(self, closure=None):
        """Completes the step: updates every parameter that still holds a .grad (deferred
        ones, accumulate_grad mode), drops (with a warning) what a backward left for a
        weight it never reached, and closes the step's stats (grad_norm, nonfinite_count)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._capturing and self._any_cuda and torch.cuda.is_current_stream_capturing():
            warnings.warn(
                "forge: this step is being captured into a CUDA graph, but not by a "
                "forge.graphs.CUDAGraphStep given this optimizer: every replay would repeat this "
                "step's step number, lr and rounding seed; capture it with "
                "forge.graphs.CUDAGraphStep(fn, optimizers=[..., this optimizer])", stacklevel=2)
        missed = [s.name for s in self._slots.values() if s.pending or s.partial is not None]
        if missed:
            warnings.warn(
                "forge: backward ran through the nn.Linear of " + ", ".join(missed) + " but "
                "never reached the weight's gradient node (torch.autograd.grad or "
                "backward(inputs=...) without it?), so it was not updated this step", stacklevel=2)
        for slot in self._slots.values():
            slot.pending.clear()
            slot.partial = None
            slot.uses = 0
            p = slot.param
            if p.grad is None:
                continue
            if slot.updated_at == self._step_id:
                raise RuntimeError(
                    f"forge: parameter '{slot.name}' was already updated in this step's "
                    "backward but holds a .grad again; set it to None, or use "
                    "accumulate_grad=True to apply gradients in step()")
            if p.grad.is_sparse:
                raise RuntimeError(f"forge: parameter '{slot.name}' has a sparse gradient, "
                                   "which FORGE does not support")
            self._update(slot, grad=p.grad)
            p.grad = None
        self._last_stats = self._stats
        self._stats = {}
        self._stats_outputs = {}
        self._step_id += 1
        return loss

    @torch.no_grad()
    def state_fp32(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The optimizer states of `param` decoded to fp32 tensors of its shape (bf16
        widened, int8 codes × absmax through forge_state_to_fp32), for inspection."""
        slot = self._slots.get(id(param))
        if slot is None or slot.param is not param:
            raise ValueError("state_fp32: not a parameter of this optimizer")
        st = self.state.get(param)
        if not st or slot.signature is None:
            return {}
        group = self._group_of(slot)
        hp = self._hparams(group, step=max(1, st["step"]), seed=0)
        fp = self._param_struct(slot, st)
        out = {}
        for i, name in enumerate(slot.signature[1]):
            t = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            self._lib.state_to_fp32(fp, hp, i, t.data_ptr(), self._device_struct(param))
            out[name] = t
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for slot in self._slots.values():
            slot.pending.clear()
            slot.partial = None
            slot.uses = 0
        super().zero_grad(set_to_none=set_to_none)

    def rebind_streams(self) -> None:
        """Binds the gradient nodes of the fused nn.Linear weights to the current CUDA stream.

        FORGE holds each fused weight's AccumulateGrad node to hook it; torch (2.11) records
        in that node the stream current when it was made (this optimizer's construction).
        Backward on another stream then syncs with that stream and warns that "the
        AccumulateGrad node's stream does not match", and a CUDA-graph capture on another
        stream fails (cudaErrorStreamCaptureInvalidated). Call this, between steps, under the
        stream the steps will run on; forge.graphs.CUDAGraphStep does."""
        if not self._attached:
            return
        for slot in self._slots.values():
            if slot.mode != "fused":
                continue
            for h in slot.handles:
                h.remove()
            slot.handles.clear()
            slot.acc_node = None  # the only reference: the node goes, the next one is new
            self._hook_weight_node(slot)

    def detach(self) -> None:
        """Gives the model back: plain nn.Linear forwards, no hooks. The optimizer is
        unusable afterwards (except state_dict())."""
        if not self._attached:
            return
        for slot in self._slots.values():
            for h in slot.handles:
                h.remove()
            slot.handles.clear()
            slot.acc_node = None
            for m in slot.modules:
                _linear.unpatch(m, slot.param)
            slot.modules.clear()
            if _OWNERS.get(id(slot.param)) is not None and _owner_of(slot.param) is self:
                del _OWNERS[id(slot.param)]
        self._attached = False

    def __del__(self):
        try:
            self.detach()
        except Exception:  # interpreter shutdown: nothing left to restore
            pass

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            if self._attached:
                model = self._model_ref()
                if model is None:
                    raise RuntimeError("forge: the model of this optimizer no longer exists")
                names = _parameter_names(model)
                self._check_params(model, group["params"], names)
                self._attach(model, group["params"], names)
        except Exception:
            self.param_groups.pop()
            raise

    def state_dict(self) -> Dict[str, Any]:
        """torch's layout ('state' by parameter index, 'param_groups') holding the raw
        state buffers (fp32, bf16, or int8 codes + fp32 absmax, and the fp32 master), each
        parameter's 'step', and a 'forge' entry with the storage options."""
        sd = super().state_dict()
        sd["forge"] = {"format_version": 1, "state_format": self.state_format,
                       "master_weights": self.master_weights,
                       "stochastic_rounding": self.stochastic_rounding, "seed": self.seed,
                       "step_id": self._step_id}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores states bit for bit (copied into buffers of the exact dtype; nothing is
        cast) and the group hyper-parameters. Refuses a mismatching layout."""
        meta = state_dict.get("forge")
        if meta is None:
            raise ValueError("load_state_dict: not a forge.optim state dict (no 'forge' entry)")
        for key in ("state_format", "master_weights"):
            if meta.get(key) != getattr(self, key):
                raise ValueError(f"load_state_dict: saved with {key}={meta.get(key)!r}, this "
                                 f"optimizer has {key}={getattr(self, key)!r}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: {len(saved_groups)} param groups saved, "
                             f"{len(self.param_groups)} here")
        # The groups as they will be (hyper-parameters from the dict, our params).
        new_groups = []
        index_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("load_state_dict: a param group's size differs from the saved one")
            index_to_param.update(zip(saved["params"], group["params"]))
            new = dict(group)
            new.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
            self._check_group(new)
            new_groups.append(new)
        group_of = {id(p): new for new in new_groups for p in new["params"]}
        # Check every state before writing anything.
        plans = []
        for index, saved_state in state_dict["state"].items():
            if index not in index_to_param:
                raise ValueError(f"load_state_dict: state for unknown parameter index {index}")
            p = index_to_param[index]
            slot = self._slots[id(p)]
            expected = self._state_spec(slot, group_of[id(p)])
            keys = set(saved_state) - {"step"}
            if keys != set(expected) or "step" not in saved_state:
                raise ValueError(f"load_state_dict: parameter '{slot.name}': saved states "
                                 f"{sorted(saved_state)}, expected {sorted(expected)} + 'step' "
                                 "(rule or state_format differs)")
            for key, (dtype, shape) in expected.items():
                t = saved_state[key]
                if not torch.is_tensor(t) or t.dtype != dtype or tuple(t.shape) != shape:
                    raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                     f"must be {dtype} {list(shape)}, got "
                                     f"{getattr(t, 'dtype', type(t))} "
                                     f"{list(getattr(t, 'shape', []))}")
            plans.append((slot, saved_state))
        for new, group in zip(new_groups, self.param_groups):
            group.update({k: v for k, v in new.items() if k != "params"})
        self.state.clear()
        for slot, saved_state in plans:
            st = self._allocate_state(slot, self._group_of(slot), init=False)
            for key in self._state_spec(slot, self._group_of(slot)):
                st[key].copy_(saved_state[key])
            step = saved_state["step"]
            st["step"] = int(step.item() if torch.is_tensor(step) else step)
        self._step_id = int(meta.get("step_id", 0))
        self._states_loaded += 1  # new state tensors: a captured step no longer reads them
        for slot in self._slots.values():
            slot.updated_at = -1
            slot.pending.clear()
            slot.partial = None
            slot.uses = 0

    # ------------------------------------------------------------------ per rule (subclasses)

    def _rule(self, group: Dict[str, Any]) -> int:
        raise NotImplementedError

    def _fill(self, hp: _lib.Hparams, group: Dict[str, Any]) -> None:
        """Copies the group's hyper-parameters into hp (lr, weight_decay, maximize done).
        Reads only keys of the defaults: the cache of _group_hparams is keyed on them."""
        raise NotImplementedError

    def _check_group_rule(self, group: Dict[str, Any]) -> None:
        """torch.optim's own checks for this optimizer, with its messages."""

    # ------------------------------------------------------------------ checks

    def _check_group(self, group: Dict[str, Any]) -> None:
        lr = _as_float(group["lr"], "lr")
        if not 0.0 <= lr < math.inf:
            raise ValueError(f"Invalid learning rate: {group['lr']} (must be finite and >= 0)")
        wd = _as_float(group["weight_decay"], "weight_decay")
        if not 0.0 <= wd < math.inf:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        if "betas" in group:
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"Invalid betas: {betas!r} (a pair of floats)")
            for i, b in enumerate(betas):
                if not 0.0 <= _as_float(b, "betas") < 1.0:
                    raise ValueError(f"Invalid beta parameter at index {i}: {b} "
                                     "(must be in [0, 1))")
        if "eps" in group and not 0.0 < _as_float(group["eps"], "eps") < math.inf:
            raise ValueError(f"Invalid epsilon value: {group['eps']} (FORGE needs eps > 0)")
        self._check_group_rule(group)
        # The library's own validation, as a backstop (the message names the field).
        try:
            self._lib.state_layout(self._hparams(group, step=1, seed=0), _lib.STATE_FP32, 1, 1)
        except _lib.ForgeInvalidArgument as e:
            raise ValueError(f"{self._torch_name}: {e}") from None

    def _check_params(self, model: nn.Module, params: Sequence[torch.Tensor],
                      names: Dict[int, List[str]]) -> None:
        sparse = {id(m.weight) for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        for p in params:
            if id(p) not in names:
                raise ValueError(f"{self._torch_name}: a parameter of shape {list(p.shape)} in "
                                 "the param groups is not a parameter of the model")
            name = names[id(p)][0]
            if not isinstance(p, nn.Parameter) and not p.is_leaf:
                raise ValueError(f"parameter '{name}': not a leaf tensor")
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"parameter '{name}': dtype {p.dtype} is not supported by FORGE "
                                "(float32 or bfloat16)")
            if p.device.type == "cuda":
                if not self._lib.has_cuda:
                    raise ValueError(
                        f"parameter '{name}' is on {p.device}, but this libforge "
                        f"({self._lib.path}) was built without the CUDA backend; rebuild with "
                        "nvcc available (-DFORGE_CUDA=ON) or keep the model on the CPU")
            elif p.device.type != "cpu":
                raise ValueError(f"parameter '{name}': device {p.device} is not supported by "
                                 "FORGE (cpu or cuda)")
            if p.is_sparse or not p.is_contiguous():
                raise ValueError(f"parameter '{name}': must be a dense contiguous tensor")
            if p.numel() == 0:
                raise ValueError(f"parameter '{name}': is empty")
            if id(p) in sparse:
                raise ValueError(f"parameter '{name}': nn.Embedding(sparse=True) gives sparse "
                                 "gradients, which FORGE does not support")
            owner = _owner_of(p)
            if owner is not None:
                raise ValueError(f"parameter '{name}': already driven by "
                                 f"{'this' if owner is self else 'another'} forge optimizer"
                                 f"{'' if owner is self else '; call its .detach() first'}")

    # ------------------------------------------------------------------ attaching

    def _attach(self, model: nn.Module, params: Sequence[torch.Tensor],
                names: Dict[int, List[str]]) -> None:
        index_of = {id(p): i for i, p in enumerate(p for g in self.param_groups
                                                   for p in g["params"])}
        linears: Dict[int, List[nn.Linear]] = {}
        for m in model.modules():
            if isinstance(m, nn.Linear):
                linears.setdefault(id(m.weight), []).append(m)
        post_hook, pre_hook = _has_post_accumulate_hook(), _has_node_prehook()
        self._any_cuda = self._any_cuda or any(p.is_cuda for p in params)
        shared = []
        for p in params:
            p_names = names[id(p)]
            mods = linears.get(id(p), [])
            if len(p_names) > 1:
                mode = "deferred"
                shared.append(" = ".join(p_names))
            elif mods and pre_hook and all(_linear.can_patch(m) for m in mods):
                mode = "fused"
            elif post_hook:
                mode = "hook"
            else:
                mode = "deferred"
            slot = _Slot(self, p, index_of[id(p)], p_names, mode)
            self._slots[id(p)] = slot
            _OWNERS[id(p)] = weakref.ref(slot)
            if mode == "fused":
                self._hook_weight_node(slot)
                for m in mods:
                    _linear.patch(m, slot)
                    slot.modules.append(m)
            elif mode == "hook":
                ref = weakref.ref(slot)
                slot.handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, ref=ref: _param_grad_ready(ref)))
        if shared:
            warnings.warn(
                "forge: parameters used in more than one place take the materialized-gradient "
                "path (their full gradient is accumulated and applied in opt.step()): "
                + "; ".join(shared), stacklevel=4)  # the user's constructor call

    def _hook_weight_node(self, slot: _Slot) -> None:
        """Holds W's AccumulateGrad node (torch makes it now if none exists, for the current
        stream) and hooks it: the pre-hook runs the fused step (_on_weight_grad_ready)."""
        p = slot.param
        with torch.enable_grad():
            slot.acc_node = p.view_as(p).grad_fn.next_functions[0][0]
        ref = weakref.ref(slot)
        slot.handles.append(slot.acc_node.register_prehook(
            lambda grads, ref=ref: _weight_grad_ready(ref, grads)))
        # Fallback: torch 2.4's non-reentrant checkpoint runs W's AccumulateGrad without its
        # pre-hooks (but with its post-hooks); see _on_weight_grad_done.
        slot.handles.append(slot.acc_node.register_hook(
            lambda grad_inputs, grad_outputs, ref=ref: _weight_grad_done(ref)))

    # ------------------------------------------------------------------ backward callbacks

    def _second_update_error(self, slot: _Slot) -> RuntimeError:
        return RuntimeError(
            f"forge: parameter '{slot.name}' got a second gradient before opt.step(): FORGE "
            "applies the update inside backward, so call opt.step() after every backward(), "
            "or build the optimizer with accumulate_grad=True to accumulate micro-batches "
            "(keeps a full .grad per parameter). A parameter used in several reentrant "
            "checkpoint segments also does this: use use_reentrant=False.")

    def _linear_backward(self, slot: _Slot, x, dy, weight):
        if self._accumulate_grad:
            return _materialize_dw(x, dy, weight)
        if slot.updated_at == self._step_id:
            raise self._second_update_error(slot)
        x2, ldx = _linear.as_rows(x, slot.cols)
        dy2, lddy = _linear.as_rows(dy, slot.rows)
        if dy.is_cuda:
            index = dy.get_device()  # NOTE: an int, without building a torch.device
            handle = _linear.current_stream_handle(index)
        else:
            index = handle = None
        slot.uses += 1
        if not slot.pending and slot.partial is None:
            slot.pending.append((x2, ldx, dy2, lddy, handle, index))
        else:  # a second use in this backward: sum this one and the pending one in fp32
            for px, _, pdy, *_ in slot.pending + [(x2, ldx, dy2, lddy, handle, index)]:
                slot.partial = _add_dw(slot.partial, px, pdy)
            slot.pending.clear()
        if slot.uses > 1:
            return None
        # NOTE: W's AccumulateGrad pre-hook is where the fused step runs, and torch 2.4's
        # non-reentrant checkpoint skips that hook when dW is None. So the first use of W in
        # a backward returns a defined stand-in: one zero expanded to W's shape (no memory).
        # The hook knows it by identity and drops it; a sum with a dW from another use is a
        # new tensor and takes the materialized path, as it must.
        # NOTE: made once per weight and reused: a fresh one cost a fill kernel and ~50 µs of
        # host time per Linear per step on the H200's host (forge-bench --profile, run 16).
        # Nothing writes to it: autograd copies an expanded gradient before accumulating it.
        # (Remade if the weight moved: _update then says what changed.)
        stand_in = slot.stand_in
        if stand_in is None or stand_in.dtype != weight.dtype or stand_in.device != weight.device:
            slot.stand_in = torch.zeros((), dtype=weight.dtype,
                                        device=weight.device).expand(weight.shape)
        slot.marker = slot.stand_in
        return slot.marker

    def _on_weight_grad_ready(self, slot: _Slot, grads) -> Optional[tuple]:
        """W's AccumulateGrad pre-hook: every use of W in this backward is done."""
        if self._accumulate_grad:
            return None  # the Linear returned dW; autograd accumulates it into .grad
        arrived = grads[0] if grads else None
        outside = None if arrived is None or arrived is slot.marker else arrived
        slot.marker = None
        consumed = (None,) if arrived is not None else None  # nothing reaches .grad
        if not slot.pending and slot.partial is None and outside is None:
            return consumed
        if slot.updated_at == self._step_id:
            raise self._second_update_error(slot)
        uses = slot.uses + (1 if outside is not None else 0)
        if len(slot.pending) == 1 and slot.partial is None and outside is None \
                and slot.pending[0][0].size(0) > 0:
            x2, ldx, dy2, lddy, handle, index = slot.pending[0]
            # NOTE: X and dY are ready on the stream backward made them on: the step runs
            # there. Autograd normally runs this hook on that same stream; switching streams
            # (a context manager around a wrapper of the raw handle) only when it did not
            # saves host time on every Linear. Handle 0 is the legacy default stream, a real
            # stream: only None means the CPU.
            if handle is None or handle == _linear.current_stream_handle(index):
                self._update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=handle)
            else:
                with torch.cuda.stream(_linear.stream_of_handle(handle, index)):
                    self._update(slot, x=(x2, ldx), dy=(dy2, lddy), stream=handle)
        else:
            if uses > 1 and not slot.warned_multi_use:
                slot.warned_multi_use = True
                warnings.warn(
                    f"forge: weight '{slot.name}' had {uses} uses in one backward (a Linear "
                    "applied more than once, or its weight also used outside the Linear); it "
                    "takes the materialized-gradient path: its full gradient is summed in fp32, "
                    "then updated once", stacklevel=2)
            grad = slot.partial
            for x2, _, dy2, *_ in slot.pending:
                grad = _add_dw(grad, x2, dy2)
            if outside is not None:
                grad = outside.float() if grad is None else grad.add_(outside)
            self._update(slot, grad=grad.reshape(slot.param.shape))
        slot.pending.clear()
        slot.partial = None
        slot.uses = 0
        return consumed

    def _on_weight_grad_done(self, slot: _Slot) -> None:
        """W's AccumulateGrad post-hook. Normally the pre-hook has already run the update
        and nothing is left; where the pre-hook was skipped (torch 2.4, non-reentrant
        checkpoint) the stand-in dW (and any dW from a use outside the Linear) has been
        accumulated into W.grad: take it back out and run the update from here."""
        if self._accumulate_grad or (not slot.pending and slot.partial is None):
            return
        arrived = slot.param.grad
        slot.param.grad = None  # W never keeps a .grad
        # The stand-in was copied (a dense zero tensor); an all-zero sum is no outside use.
        if arrived is not None and not bool(arrived.any()):
            arrived = None
        slot.marker = None  # what arrived is the sum, never the stand-in itself
        self._on_weight_grad_ready(slot, (arrived,))

    def _on_param_grad_ready(self, slot: _Slot) -> None:
        p = slot.param
        if self._accumulate_grad or p.grad is None:
            return
        if slot.updated_at == self._step_id:
            raise self._second_update_error(slot)
        self._update(slot, grad=p.grad)
        p.grad = None

    # ------------------------------------------------------------------ CUDA graphs

    def _begin_capture(self) -> None:
        """forge.graphs calls this before it captures a step: the updates launched until
        _end_capture read their scalars from this optimizer's run-scalars buffers. (The
        caller has checked that every parameter is on CUDA.)"""
        if not self._attached:
            raise RuntimeError("forge: this optimizer was detached from its model")
        # NOTE: no statistics tensors yet: the capture makes its own with torch.zeros, whose
        # fill is captured, so every replay adds into zeros (the step's grad_norm).
        if self._stats or any(s.pending or s.partial is not None for s in self._slots.values()):
            raise RuntimeError("forge: a step is in progress (a backward ran without "
                               "opt.step()); finish it before capturing a step")
        cap = _Capture(self._step_id, self._states_loaded, self._last_stats)
        # NOTE: the buffers are made here, outside the capture (allocations inside it come
        # from the graph's private pool); a graph keeps the ones it reads through its _Capture.
        count = 1 + max((slot.index for slot in self._slots.values()), default=0)
        for index in {slot.device.index for slot in self._slots.values()}:
            rs = self._run_scalars.get(index)
            if rs is None or rs.count < count:  # (parameters added since: a larger one)
                rs = self._run_scalars[index] = _RunScalars(count, torch.device("cuda", index))
            cap.run_scalars[index] = rs
        self._capture, self._capturing = cap, True

    def _end_capture(self) -> "_Capture":
        """Ends the capture begun by _begin_capture (also after a failed one) and returns what
        it recorded. The capture ran nothing, so this undoes its bookkeeping: the step it went
        through is not a step taken (the first replay is)."""
        cap, self._capture, self._capturing = self._capture, None, False
        cap.steps = self._step_id - cap.step_id
        cap.stats = self._last_stats if cap.steps == 1 else None
        cap.slots.sort(key=lambda entry: entry[0].index)  # NOTE: a group's slots adjacent
        self._step_id, self._last_stats = cap.step_id, cap.last_stats
        self._stats, self._stats_outputs = {}, {}
        for slot in self._slots.values():
            slot.pending.clear()
            slot.partial = None
            slot.uses = 0
            if slot.updated_at >= cap.step_id:
                slot.updated_at = cap.step_id - 1
        self._last_capture = cap
        return cap

    def _capture_region(self, slot: _Slot, hparams: _lib.Hparams) -> int:
        """The device address of slot's run-scalars region, for an update being captured
        with the group's hyper-parameters `hparams`; records the slot for _prepare_replay."""
        cap = self._capture
        if id(slot) in cap.seen:
            raise RuntimeError(f"forge: parameter '{slot.name}' was updated twice in one "
                               "captured step; a CUDA graph step holds one optimizer step")
        fixed = _fixed_hparams(hparams)
        fixed = cap.fixed.setdefault(fixed, fixed)  # one object per value: compared by identity
        rs = cap.run_scalars[slot.device.index]
        cap.seen.add(id(slot))
        cap.slots.append((slot, fixed, rs))
        return rs.device_address + slot.index * _lib.RUN_SCALARS_BYTES

    def _prepare_replay(self, capture: Optional["_Capture"] = None) -> None:
        """Before a replay of a captured step (`capture`, _end_capture's; default the last):
        advances every captured parameter's step count, fills its run-scalars region for that
        step from its param group as it is now (a scheduler's new lr), copies the regions to
        the device in one transfer on the current stream, and closes the step's bookkeeping
        (the statistics are the tensors the replay writes)."""
        cap = capture if capture is not None else self._last_capture
        if cap is None:
            raise RuntimeError("forge: no captured step to replay")
        if cap.states_loaded != self._states_loaded:
            raise RuntimeError("forge: load_state_dict replaced the optimizer states after this "
                               "step was captured; capture it again (a new CUDAGraphStep)")
        for rs in cap.run_scalars.values():
            rs.next_staging()
        step_id, nbytes = self._step_id, _lib.RUN_SCALARS_BYTES
        base = fixed_checked = hp = None
        for slot, fixed, rs in cap.slots:
            group_hp = self._group_hparams(self._group_of(slot))[0]
            if group_hp is not base or fixed is not fixed_checked:  # NOTE: once per group
                if _fixed_hparams(group_hp) != fixed:
                    raise RuntimeError(
                        f"forge: the hyper-parameters of parameter '{slot.name}' changed since "
                        "its step was captured; between replays only lr may change (capture "
                        "again for other changes)")
                base, fixed_checked = group_hp, fixed
                hp = _lib.Hparams.from_buffer_copy(group_hp)
            st = self.state[slot.param]
            step = st["step"] + 1
            hp.step, hp.seed = step, self.seed + slot.index
            self._lib.run_scalars_fill(hp, rs.host_address + slot.index * nbytes, nbytes)
            st["step"] = step
            slot.updated_at = step_id
        for rs in cap.run_scalars.values():
            rs.upload()
        self._last_stats = cap.stats
        self._step_id = step_id + 1

    # ------------------------------------------------------------------ the update

    def _group_of(self, slot: _Slot) -> Dict[str, Any]:
        cached = self._group_cache.get(id(slot.param))
        if cached is not None:
            for g in self.param_groups:  # NOTE: a plain loop, ~0.2 µs less than any(<genexpr>)
                if g is cached:
                    return cached
        for g in self.param_groups:  # param_groups were replaced or extended: look again
            for q in g["params"]:
                self._group_cache[id(q)] = g
                if q is slot.param:
                    cached = g
        if cached is None:
            raise RuntimeError(f"forge: parameter '{slot.name}' is in no param group")
        return cached

    def _hparams(self, group: Dict[str, Any], step: int, seed: int) -> _lib.Hparams:
        """group's forge_hparams for one call (a copy: the caller may change it)."""
        hp = _lib.Hparams.from_buffer_copy(self._group_hparams(group)[0])
        hp.step = step
        hp.seed = seed
        return hp

    def _group_hparams(self, group: Dict[str, Any]) -> Tuple[_lib.Hparams, tuple]:
        """(forge_hparams of group's current values, step and seed 0; its _layout_key).
        The pair is shared and never changed: callers copy the struct (_hparams, or a ctypes
        field assignment, which copies).

        NOTE: cached on the values of every key _hparams reads (self._hparam_keys), read
        from the group on every call, so a scheduler's new lr or a user's new betas is
        honoured at the next update; the cache only skips the ~10 conversions and ctypes
        stores (1.0 µs per update for the old _hparams, 0.2 µs for this on a hit, 2-core CPU
        dev host). Values that could change in place without the key changing (a tensor lr,
        a list of betas) are never cached."""
        try:
            key = self._hparam_values(group)  # NOTE: one C call: 1/3 of tuple(map(group.get))
        except KeyError:  # a key deleted from the group by hand (maximize defaults to False)
            key = tuple(map(group.get, self._hparam_keys))
        try:
            cached = self._hparams_cache.get(key)
        except TypeError:  # an unhashable value (betas given as a list): never cached
            cached = None
        if cached is not None:
            return cached
        rule = self._rule(group)
        default = self._default_hparams.get(rule)
        if default is None:
            default = self._default_hparams[rule] = self._lib.hparams_default(rule)
        hp = _lib.Hparams.from_buffer_copy(default)
        hp.lr = _as_float(group["lr"], "lr")
        hp.weight_decay = _as_float(group["weight_decay"], "weight_decay")
        hp.maximize = int(bool(group.get("maximize", False)))
        self._fill(hp, group)
        cached = (hp, self._layout_key(group))
        if _immutable_values(key):
            if len(self._hparams_cache) >= _CACHE_LIMIT:  # e.g. a new lr every step
                self._hparams_cache.clear()
            self._hparams_cache[key] = cached
        return cached

    def _weight_format(self, slot: _Slot) -> int:
        if slot.dtype == torch.float32:
            return _lib.WEIGHT_FP32
        if self.master_weights:
            return _lib.WEIGHT_BF16_MASTER
        return _lib.WEIGHT_BF16_STOCHASTIC if self.stochastic_rounding else _lib.WEIGHT_BF16

    def _state_format_code(self) -> int:
        if self.state_format == "fp32":
            return _lib.STATE_FP32
        if self.state_format == "int8":
            return _lib.STATE_INT8_BLOCK64
        return _lib.STATE_BF16_STOCHASTIC if self.stochastic_rounding else _lib.STATE_BF16

    def _layout(self, slot: _Slot, group: Dict[str, Any]) -> _lib.StateLayout:
        hp = self._hparams(group, step=1, seed=0)
        return self._lib.state_layout(hp, self._state_format_code(), slot.rows, slot.cols)

    def _state_spec(self, slot: _Slot,
                    group: Dict[str, Any]) -> Dict[str, Tuple[torch.dtype, tuple]]:
        """Every state tensor this parameter keeps: key -> (dtype, shape)."""
        layout = self._layout(slot, group)
        shape = tuple(slot.param.shape)
        spec = {}
        for i in range(layout.num_states):
            name = layout.names[i].decode()
            if self.state_format == "fp32":
                spec[name] = (torch.float32, shape)
            elif self.state_format == "bf16":
                spec[name] = (torch.bfloat16, shape)
            else:
                spec[name] = (torch.uint8, shape)
                spec[name + "_absmax"] = (torch.float32,
                                          (slot.rows, -(-slot.cols // _lib.INT8_BLOCK)))
        if self._weight_format(slot) == _lib.WEIGHT_BF16_MASTER:
            spec["master"] = (torch.float32, shape)
        return spec

    def _layout_key(self, group: Dict[str, Any]) -> tuple:
        """What decides the rule and its states; a change after the states exist is refused."""
        return (self._rule(group),)

    def _signature(self, slot: _Slot, group: Dict[str, Any]) -> tuple:
        layout = self._layout(slot, group)
        return (self._layout_key(group),
                tuple(layout.names[i].decode() for i in range(layout.num_states)))

    def _allocate_state(self, slot: _Slot, group: Dict[str, Any], init: bool) -> Dict[str, Any]:
        p = slot.param
        st = self.state[p]
        st.clear()
        for key, (dtype, shape) in self._state_spec(slot, group).items():
            st[key] = torch.empty(shape, dtype=dtype, device=p.device)
        st["step"] = 0
        slot.signature = self._signature(slot, group)
        if init:
            if "master" in st:
                st["master"].copy_(p.detach())
            hp = self._hparams(group, step=1, seed=0)
            self._lib.state_init(self._param_struct(slot, st), hp, self._device_struct(p))
        return st

    def _param_struct(self, slot: _Slot, st: Dict[str, Any]) -> _lib.Param:
        """slot's forge_param: built once and kept while the formats, the weight and every
        state tensor stay the same (a state replaced by load_state_dict, or by hand, has a new
        data pointer, and the struct is rebuilt)."""
        # NOTE: the options the formats derive from (slot.dtype is fixed), not the formats
        # themselves, and a list comprehension with isinstance instead of a generator with
        # torch.is_tensor: 0.86 -> 0.53 µs per update (2-core CPU dev host).
        key = [self.state_format, self.master_weights, self.stochastic_rounding,
               slot.param.data_ptr()]
        key += [t.data_ptr() for t in st.values() if isinstance(t, torch.Tensor)]
        cached = slot.param_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        fp = self._build_param_struct(slot, st)
        slot.param_cache = (key, fp)
        return fp

    def _build_param_struct(self, slot: _Slot, st: Dict[str, Any]) -> _lib.Param:
        p = slot.param
        fp = _lib.Param()
        fp.rows, fp.cols = slot.rows, slot.cols
        fp.weight_format = self._weight_format(slot)
        fp.weight = p.data_ptr()
        if "master" in st:
            fp.master = _lib.float_ptr(st["master"].data_ptr())
        fp.state_format = self._state_format_code()
        for i, name in enumerate(slot.signature[1]):
            fp.state[i] = st[name].data_ptr()
            if self.state_format == "int8":
                fp.state_absmax[i] = _lib.float_ptr(st[name + "_absmax"].data_ptr())
        return fp

    def _device_struct(self, t: torch.Tensor, stream: Optional[int] = None) -> _lib.Device:
        """Where a call on t runs: its CUDA device and `stream` (the raw cudaStream_t handle,
        as _linear.current_stream_handle gives; None: the device's current stream), or the
        CPU with num_threads.

        NOTE: one struct per (device index, stream) or thread count, made once: the callers
        pass it on by value (a ctypes Structure assigned to a field, or passed as an argument,
        is copied) and never change it."""
        if t.is_cuda:
            index = t.get_device()
            if stream is None:
                stream = _linear.current_stream_handle(index)
            key = (index, stream)
        else:
            key = (-1, self.num_threads or torch.get_num_threads())
        d = self._devices.get(key)
        if d is None:
            d = _lib.Device()
            if key[0] >= 0:
                d.kind, d.index, d.stream = _lib.DEVICE_CUDA, key[0], key[1]
            else:
                d.kind, d.num_threads = _lib.DEVICE_CPU, key[1]
            if len(self._devices) >= _CACHE_LIMIT:  # streams made and dropped by the user
                self._devices.clear()
            self._devices[key] = d
        return d

    def _outputs(self, device: torch.device) -> _lib.StepOutputs:
        """This step's statistics outputs on `device` (made at its first update)."""
        out = self._stats_outputs.get(device)
        if out is not None:
            return out
        stats = (torch.zeros((), dtype=torch.float64, device=device),
                 torch.zeros((), dtype=torch.int64, device=device))
        self._stats[device] = stats
        out = _lib.StepOutputs()
        out.grad_sq_sum = ctypes.cast(stats[0].data_ptr(), ctypes.POINTER(ctypes.c_double))
        out.nonfinite_count = ctypes.cast(stats[1].data_ptr(), ctypes.POINTER(ctypes.c_int64))
        self._stats_outputs[device] = out
        return out

    def _update(self, slot: _Slot, grad: Optional[torch.Tensor] = None, x=None, dy=None,
                stream=None) -> None:
        """One step of slot's parameter, from a gradient tensor or from (X, dY), on `stream`
        (the raw handle of a CUDA stream, _linear.current_stream_handle's; None: the current
        one)."""
        p = slot.param
        if p.dtype != slot.dtype or p.device != slot.device or not p.is_contiguous():
            raise RuntimeError(f"forge: parameter '{slot.name}' changed dtype, device or layout "
                               f"after the optimizer was built ({slot.dtype} on {slot.device} -> "
                               f"{p.dtype} on {p.device}); build the optimizer after moving "
                               "the model")
        group = self._group_of(slot)
        st = self.state.get(p)
        capturing = self._capturing
        if not st:
            if capturing:  # the states' initialization would be replayed with every step
                raise RuntimeError(f"forge: parameter '{slot.name}' has no optimizer state yet: "
                                   "run at least one step eagerly before capturing one "
                                   "(CUDAGraphStep's warmup)")
            st = self._allocate_state(slot, group, init=True)
        elif slot.signature is None:
            slot.signature = self._signature(slot, group)
        hparams, layout_key = self._group_hparams(group)  # shared: copied into args below
        if slot.signature[0] != layout_key:
            raise RuntimeError(f"forge: parameter '{slot.name}': its group's settings changed "
                               "the update rule or its states (e.g. momentum 0 <-> > 0, centered) "
                               "after the states were created")
        step = st["step"] + 1
        param = self._param_struct(slot, st)
        device = self._device_struct(p, stream)
        outputs = self._outputs(slot.device)  # NOTE: == p.device (checked), no new object
        if x is not None:
            # NOTE: no torch.no_grad() here (host time on every Linear): forge_dtype's only
            # tensor op, a cast, works on a detached tensor.
            (x2, ldx), (dy2, lddy) = x, dy
            x2, x_code = _linear.forge_dtype(x2)
            dy2, dy_code = _linear.forge_dtype(dy2)
            args = _lib.WgradArgs()
            args.abi_version = _lib.ABI_VERSION
            args.device = device
            args.tokens = x2.size(0)
            args.x, args.x_dtype, args.ldx = x2.data_ptr(), x_code, ldx
            args.dy, args.dy_dtype, args.lddy = dy2.data_ptr(), dy_code, lddy
            args.param, args.hparams, args.outputs = param, hparams, outputs
            # NOTE: step and seed set in args' own copy of the hyper-parameters (a view of
            # args), not in a fresh struct copied in: half the time.
            hp = args.hparams
            hp.step, hp.seed = step, self.seed + slot.index
            if capturing:
                hp.run_scalars = self._capture_region(slot, hparams)
            self._lib.wgrad_step(args)
        else:
            with torch.no_grad():
                if grad.device != p.device:
                    grad = grad.to(p.device)
                grad, code = _linear.forge_dtype(grad.contiguous())
            args = _lib.ElementwiseArgs()
            args.abi_version = _lib.ABI_VERSION
            args.device = device
            args.grad, args.grad_dtype = grad.data_ptr(), code
            args.param, args.hparams, args.outputs = param, hparams, outputs
            hp = args.hparams
            hp.step, hp.seed = step, self.seed + slot.index
            if capturing:
                hp.run_scalars = self._capture_region(slot, hparams)
            self._lib.elementwise_step(args)
        if not capturing:  # a captured update runs at each replay: _prepare_replay counts it
            st["step"] = step
        slot.updated_at = self._step_id


def _weight_grad_done(ref) -> None:
    slot = ref()
    opt = slot.opt_ref() if slot is not None else None
    if opt is not None and opt._attached:
        opt._on_weight_grad_done(slot)


def _weight_grad_ready(ref, grads):
    slot = ref()
    opt = slot.opt_ref() if slot is not None else None
    if opt is None or not opt._attached:
        return None
    return opt._on_weight_grad_ready(slot, grads)


def _param_grad_ready(ref) -> None:
    slot = ref()
    opt = slot.opt_ref() if slot is not None else None
    if opt is not None and opt._attached:
        opt._on_param_grad_ready(slot)


def _add_dw(acc: Optional[torch.Tensor], x2: torch.Tensor, dy2: torch.Tensor) -> torch.Tensor:
    """acc += dYᵀ·X in fp32 ([rows, cols])."""
    dw = dy2.float().t().matmul(x2.float())
    return dw if acc is None else acc.add_(dw)


def _as_float(value, name: str) -> float:
    if type(value) is float:  # NOTE: the common case first: ~7 calls per update
        return value
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"{name}: a tensor hyper-parameter must have one element")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__}")
    return float(value)


_IMMUTABLE_TYPES = (float, int, bool, type(None))


def _immutable_values(values: tuple) -> bool:
    """Every value a number, None, or a tuple of them: nothing that can change in place
    (a tensor, a list) and so leave a cache key equal while the value it stands for moves."""
    for v in values:
        if type(v) is tuple:
            if not all(type(e) in _IMMUTABLE_TYPES for e in v):
                return False
        elif type(v) not in _IMMUTABLE_TYPES:
            return False
    return True


def _unique(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _parameter_names(model: nn.Module) -> Dict[int, List[str]]:
    """id(param) -> every name it is registered under (two or more: shared/tied)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


# id(param) -> weakref to the slot of the live optimizer that drives it (one at a time:
# two would both update it in backward).
_OWNERS: Dict[int, "weakref.ReferenceType"] = {}


def _owner_of(p: torch.Tensor) -> Optional["_ForgeOptimizer"]:
    ref = _OWNERS.get(id(p))
    slot = ref() if ref is not None else None
    if slot is None or slot.param is not p or not slot.is_live():
        return None
    return slot.opt_ref()


def _refuse(**flags) -> None:
    """torch.optim options FORGE does not implement: a clear error instead of ignoring."""
    reasons = {"amsgrad": "amsgrad=True is not supported by FORGE (no max-of-second-moment "
                          "state); use amsgrad=False",
               "differentiable": "differentiable=True is not supported: FORGE updates weights "
                                 "in place outside autograd",
               "capturable": "capturable=True is not supported: capture FORGE steps as CUDA "
                             "graphs with forge.graphs.CUDAGraphStep, which gives every "
                             "replay its step number and lr"}
    for key, value in flags.items():
        if value:
            raise ValueError(reasons[key])


# ============================================================================ the optimizers


class AdamW(_ForgeOptimizer):
    """torch.optim.AdamW (decoupled weight decay), fused into backward."""

    _torch_name = "AdamW"

    def __init__(self, model: nn.Module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, *, maximize=False, foreach=None,
                 capturable=False, differentiable=False, fused=None, params=None, **forge):
        _refuse(amsgrad=amsgrad, differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, maximize=maximize), **forge)

    def _rule(self, group):
        return _lib.RULE_ADAMW

    def _fill(self, hp, group):
        hp.beta1, hp.beta2 = (_as_float(b, "betas") for b in group["betas"])
        hp.eps = _as_float(group["eps"], "eps")
        hp.decoupled_weight_decay = 1


class Adam(AdamW):
    """torch.optim.Adam (L2 weight decay added to the gradient), fused into backward."""

    _torch_name = "Adam"

    def __init__(self, model: nn.Module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, *, maximize=False, foreach=None,
                 capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, params=None, **forge):
        _refuse(amsgrad=amsgrad, differentiable=differentiable, capturable=capturable)
        _ForgeOptimizer.__init__(self, model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay), **forge)

    def _fill(self, hp, group):
        super()._fill(hp, group)
        hp.decoupled_weight_decay = int(bool(group["decoupled_weight_decay"]))


class NAdam(_ForgeOptimizer):
    """torch.optim.NAdam (momentum_decay, decoupled_weight_decay), fused into backward."""

    _torch_name = "NAdam"

    def __init__(self, model: nn.Module, lr=2e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, momentum_decay=4e-3, decoupled_weight_decay=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False,
                 params=None, **forge):
        _refuse(differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize), **forge)

    def _check_group_rule(self, group):
        if not 0.0 <= _as_float(group["momentum_decay"], "momentum_decay") < math.inf:
            raise ValueError(f"Invalid momentum_decay value: {group['momentum_decay']}")

    def _rule(self, group):
        return _lib.RULE_NADAM

    def _fill(self, hp, group):
        hp.beta1, hp.beta2 = (_as_float(b, "betas") for b in group["betas"])
        hp.eps = _as_float(group["eps"], "eps")
        hp.momentum_decay = _as_float(group["momentum_decay"], "momentum_decay")
        hp.decoupled_weight_decay = int(bool(group["decoupled_weight_decay"]))


class RAdam(_ForgeOptimizer):
    """torch.optim.RAdam (decoupled_weight_decay), fused into backward."""

    _torch_name = "RAdam"

    def __init__(self, model: nn.Module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, decoupled_weight_decay=False, *, foreach=None,
                 maximize=False, capturable=False, differentiable=False, params=None, **forge):
        _refuse(differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
            weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize), **forge)

    def _rule(self, group):
        return _lib.RULE_RADAM

    def _fill(self, hp, group):
        hp.beta1, hp.beta2 = (_as_float(b, "betas") for b in group["betas"])
        hp.eps = _as_float(group["eps"], "eps")
        hp.decoupled_weight_decay = int(bool(group["decoupled_weight_decay"]))


class Lion(_ForgeOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
        c = β1·m + (1 − β1)·g;  w ← w·(1 − lr·wd) − lr·sign(c);  m ← β2·m + (1 − β2)·g
    torch.optim has no Lion; the defaults are the paper's (lr 1e-4, betas (0.9, 0.99))."""

    _torch_name = "Lion"

    def __init__(self, model: nn.Module, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, params=None, **forge):
        super().__init__(model, params, dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
            weight_decay=weight_decay, maximize=maximize), **forge)

    def _rule(self, group):
        return _lib.RULE_LION

    def _fill(self, hp, group):
        hp.beta1, hp.beta2 = (_as_float(b, "betas") for b in group["betas"])


class RMSprop(_ForgeOptimizer):
    """torch.optim.RMSprop (alpha, momentum, centered), fused into backward."""

    _torch_name = "RMSprop"

    def __init__(self, model: nn.Module, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0,
                 momentum=0.0, centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False, *, params=None, **forge):
        _refuse(differentiable=differentiable, capturable=capturable)
        super().__init__(model, params, dict(
            lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
            centered=centered, maximize=maximize), **forge)

    def _check_group_rule(self, group):
        if not 0.0 <= _as_float(group["momentum"], "momentum") < 1.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']} (must be in [0, 1))")
        if not 0.0 <= _as_float(group["alpha"], "alpha") < 1.0:
            raise ValueError(f"Invalid alpha value: {group['alpha']} (must be in [0, 1))")

    def _rule(self, group):
        return _lib.RULE_RMSPROP

    def _layout_key(self, group):
        return (_lib.RULE_RMSPROP, bool(group["centered"]),
                _as_float(group["momentum"], "momentum") > 0)

    def _fill(self, hp, group):
        hp.alpha = _as_float(group["alpha"], "alpha")
        hp.eps = _as_float(group["eps"], "eps")
        hp.momentum = _as_float(group["momentum"], "momentum")
        hp.centered = int(bool(group["centered"]))


class Adagrad(_ForgeOptimizer):
    """torch.optim.Adagrad (lr_decay, initial_accumulator_value), fused into backward."""

    _torch_name = "Adagrad"

    def __init__(self, model: nn.Module, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, params=None, **forge):
        _refuse(differentiable=differentiable)
        super().__init__(model, params, dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize),
            **forge)

    def _check_group_rule(self, group):
        if not 0.0 <= _as_float(group["lr_decay"], "lr_decay") < math.inf:
            raise ValueError(f"Invalid lr_decay value: {group['lr_decay']}")
        if not 0.0 <= _as_float(group["initial_accumulator_value"], "initial_accumulator_value") \
                < math.inf:
            raise ValueError(f"Invalid initial_accumulator_value value: "
                             f"{group['initial_accumulator_value']}")

    def _rule(self, group):
        return _lib.RULE_ADAGRAD

    def _fill(self, hp, group):
        hp.lr_decay = _as_float(group["lr_decay"], "lr_decay")
        hp.eps = _as_float(group["eps"], "eps")
        hp.initial_accumulator_value = _as_float(group["initial_accumulator_value"],
                                                 "initial_accumulator_value")


class SGD(_ForgeOptimizer):
    """torch.optim.SGD (momentum > 0: SGD with momentum, dampening, nesterov), fused into
    backward."""

    _torch_name = "SGD"

    def __init__(self, model: nn.Module, lr=1e-3, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False, *, maximize=False, foreach=None,
                 differentiable=False, fused=None, params=None, **forge):
        _refuse(differentiable=differentiable)
        super().__init__(model, params, dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize), **forge)

    def _check_group_rule(self, group):
        momentum = _as_float(group["momentum"], "momentum")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']} "
                             "(FORGE: must be in [0, 1))")
        if not 0.0 <= _as_float(group["dampening"], "dampening") <= 1.0:
            raise ValueError(f"Invalid dampening value: {group['dampening']} (must be in [0, 1])")
        if group["nesterov"] and (momentum <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _rule(self, group):
        return _lib.RULE_SGD_MOMENTUM if _as_float(group["momentum"], "momentum") > 0 \
            else _lib.RULE_SGD

    def _fill(self, hp, group):
        if hp.rule == _lib.RULE_SGD_MOMENTUM:
            hp.momentum = _as_float(group["momentum"], "momentum")
            hp.dampening = _as_float(group["dampening"], "dampening")
            hp.nesterov = int(bool(group["nesterov"]))
