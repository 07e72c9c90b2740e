"""base.py — _ForgeOptimizer: the torch.optim.Optimizer every forge optimizer is.

It is assembled from one class per concern, each in its own file:
    routing.py   which path each parameter takes (fused / hook / deferred), the hooks and
                 the backward callbacks that run its update
    states.py    state storage and formats, the forge_param struct
    call.py      building and making the libforge call of one update
    capture.py   the optimizer's part in a CUDA-graph capture (a public interface)
This file holds the constructor and its checks and torch.optim's public surface: step(),
zero_grad(), state_dict() / load_state_dict(), param groups, and the step's by-products
(grad_norm, nonfinite_count). The public classes (rules.py) only say which rule and keys.
"""
from __future__ import annotations

import math
import operator
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .. import _lib
from .call import _CallMixin, _as_float
from .capture import _CaptureMixin, GraphCapture
from .routing import _RoutingMixin, _Slot, _owner_of
from .states import STATE_FORMATS, _StatesMixin

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


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


class _ForgeOptimizer(_RoutingMixin, _StatesMixin, _CallMixin, _CaptureMixin,
                      torch.optim.Optimizer):
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
        self._capture: Optional[GraphCapture] = None
        self._last_capture: Optional[GraphCapture] = None
        self._run_scalars: Dict[int, Any] = {}  # capture.py's _RunScalars
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        for slot in self._slots.values():
            slot.pending.clear()
            slot.partial = None
            slot.uses = 0
        super().zero_grad(set_to_none=set_to_none)

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
