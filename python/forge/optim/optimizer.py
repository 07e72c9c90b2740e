"""optimizer.py — _ForgeOptimizer: the torch.optim.Optimizer every forge optimizer is.

This class is torch.optim's surface (param groups, state, step(), zero_grad(), state_dict() /
load_state_dict(), the step's by-products grad_norm and nonfinite_count) and FORGE's own
(summary(), inspect(), mode, the CUDA-graph interface). The work is done by its parts, one per
concern, which share one record (shared.py) and never the optimizer itself:
    routing.py     Router: which path each parameter takes (a Slot each: slot.py), the hooks
    backward.py    Backward: the hooks' callbacks inside backward
    updater.py     Updater: the libforge calls (their structs: calls.py)
    store.py       Store: state formats, tensors, forge_param
    modes.py       Modes: immediate / deferred / auto, and the step's first callback
    stepping.py    Stepper: what step() does
    capture.py     Capture: a step captured as a CUDA graph, and its replays
    stats.py       Stats: the step's statistics
    checkpoint.py  the state dict's 'forge' entry and what a load checks
    summary.py     opt.inspect() and opt.summary()
The public classes (rules.py) only say which rule and which keys.
"""
from __future__ import annotations

import collections
import logging
import math
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .. import _lib
from . import checkpoint, distributed, summary
from .backward import Backward
from .calls import Devices, HparamsTable
from .capture import Capture, GraphCapture
from .modes import Modes
from .routing import Router, WrapperCheck, parameter_names
from .shared import Shared
from .stats import Stats
from .stepping import Stepper
from .store import MIN_8BIT_SIZE, Store, check_storage_options
from .updater import Updater

MODES = ("auto", "immediate", "deferred")
DEFERRED_STORES = ("auto", "factors", "grad")
# fp32's smallest normal value, 2^-126.
_FP32_MIN_NORMAL = 2.0 ** -126
# forge.h's FORGE_MAX_CPU_THREADS: the most threads a CPU step may ask for.
_MAX_CPU_THREADS = 1024
_log = logging.getLogger("forge")


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


class _Option:
    """A constructor option kept by the part that reads it: opt.<name> reads and sets it there."""

    def __init__(self, part: str):
        self.part = part

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, opt, owner=None):
        return self if opt is None else getattr(getattr(opt, self.part), self.name)

    def __set__(self, opt, value) -> None:
        setattr(getattr(opt, self.part), self.name, value)


class _ForgeOptimizer(torch.optim.Optimizer):
    """The shared surface; the public classes only say which rule and which keys.

    FORGE options, keyword-only on every optimizer:
      params               param groups (dicts, as torch.optim takes) over the model's
                           parameters; default: every parameter with requires_grad, one group.
                           See param_groups_no_decay().
      state_format         "fp32" | "bf16" | "int8" (block-64 dynamic map + fp32 absmax) |
                           "fp8" (e4m3 / e5m2 codes) | "int4" (4-bit codes; CPU parameters
                           only), each block format under an fp32 absmax per 64; a param
                           group may carry its own "state_format" (store.py).
      min_8bit_size        with a block format, a parameter of fewer elements keeps fp32
                           states (bitsandbytes' name and default, 4096); per group too.
      master_weights       bf16 parameters keep an fp32 master copy (state "master"); the
                           bf16 weight is its nearest rounding. No effect on fp32 parameters.
      stochastic_rounding  bf16 weight and state stores round stochastically (default True);
                           the bits come from (seed + parameter index, step, element).
      seed                 see stochastic_rounding.
      mode                 where the update runs (see MODES below); default "auto".
      max_grad_norm        clip the global L2 norm of the gradient to this (torch's
                           clip_grad_norm_ formula): exact in deferred and auto mode; in
                           immediate mode lagged: step t uses the norm of step t - 1 (its first
                           step is not clipped; after a step whose norm overflowed fp32, the
                           last finite one), saved in state_dict() so a resumed run clips as
                           it would have. opt.grad_norm reports the norm before clipping.
      deferred_store       deferred mode, per fused Linear: "auto" (its X and dY while they are
                           smaller than dW, else a dense gradient), "factors", or "grad".
      accumulate_grad      True is mode="deferred", deferred_store="grad": a full .grad per
                           parameter, as torch.optim keeps.
      num_threads          CPU backend threads (0: torch.get_num_threads()).

    MODES (modes.py)
      immediate  every update runs inside backward, as soon as its gradient is complete: the
                 least memory. No gradient is visible before opt.step(): clip_grad_norm_,
                 GradScaler, a second backward (accumulation) or a step pre-hook raise an
                 error naming the parameter (the backward that preceded it has updated the
                 weights).
      deferred   torch.optim's contract: backward leaves each parameter's gradient in .grad
                 (a fused Linear weight's as FactoredGrad: its X and dY, or a dense gradient
                 where that is smaller), the loop may clip, unscale (GradScaler) and
                 accumulate micro-batches (their tokens concatenate), and opt.step() runs the
                 fused GEMM + update with everything known.
      auto       the first step is deferred; if the loop used the gradient before opt.step()
                 (clipping, GradScaler, accumulation, step pre-hooks, max_grad_norm), every
                 step stays deferred, else the optimizer runs immediate from the second step
                 on (logged once on the "forge" logger). A loop that first needs the gradient
                 later gets immediate mode's error.
    """

    _torch_name = "?"
    # Whether each parameter's state keeps a running 'mu_product' beside its step (NAdam's
    # momentum factors, multiplied as torch.optim.NAdam multiplies them: calls.py,
    # mu_product_through), which every update passes as hparams.mu_product.
    _keeps_mu_product = False
    # Whether torch.optim's own state of this rule holds a 'step' (SGD's does not: a torch
    # checkpoint's momentum_buffer, which its first step makes, then stands for step 1).
    _torch_keeps_step = True

    state_format = _Option("_store")  # the default of every param group
    min_8bit_size = _Option("_store")
    master_weights = _Option("_store")
    stochastic_rounding = _Option("_store")
    seed = _Option("_updater")
    num_threads = _Option("_devices")
    max_grad_norm = _Option("_stepper")

    def __init__(self, model: nn.Module, params, defaults: Dict[str, Any], *,
                 state_format: str = "fp32", min_8bit_size: int = MIN_8BIT_SIZE,
                 master_weights: bool = False,
                 stochastic_rounding: Optional[bool] = None, seed: int = 0,
                 mode: str = "auto", max_grad_norm: Optional[float] = None,
                 deferred_store: str = "auto", accumulate_grad: bool = False,
                 num_threads: int = 0):
        self._shared = shared = Shared("deferred" if accumulate_grad else mode,
                                       deferring=accumulate_grad or mode != "immediate")
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self._torch_name}: the first argument must be the nn.Module to "
                            f"train, got {type(model).__name__} (forge.optim takes the model, "
                            "not model.parameters(); param groups go in params=, after it)")
        _check_options(state_format, min_8bit_size, master_weights, stochastic_rounding, seed,
                       num_threads, mode, deferred_store, max_grad_norm, accumulate_grad)
        lib = _lib.get()
        keeps_mu = self._keeps_mu_product
        # (the group keys the rule's hyper-parameters read: its defaults, and the base's)
        self._hparams = hparams = HparamsTable(
            lib, type(self), tuple(sorted(set(defaults) | {"lr", "weight_decay", "maximize"})))
        self._devices = devices = Devices(num_threads)
        self._store = store = Store(
            shared, lib, hparams, devices, state_format=state_format,
            min_8bit_size=min_8bit_size, master_weights=master_weights,
            stochastic_rounding=True if stochastic_rounding is None else stochastic_rounding,
            keeps_mu_product=keeps_mu)
        names = parameter_names(model)
        if params is None:
            params = _unique([p for p in model.parameters() if p.requires_grad])
            if not params:
                raise ValueError(f"{self._torch_name}: the model has no trainable parameters "
                                 "(none with requires_grad=True)")
        # (the storage keys join the group defaults; the hyper-parameters' keys leave them out;
        # so does checkpoint.GROUP_KEY, None in every live group: torch.distributed.checkpoint's
        # flattened dicts carry only the keys the live groups have)
        super().__init__(params, dict(defaults, state_format=state_format,
                                      min_8bit_size=min_8bit_size,
                                      **{checkpoint.GROUP_KEY: None}))  # validates each group
        all_params = [p for g in self.param_groups for p in g["params"]]
        # A model spread over ranks (DTensor parameters: tensor parallel, FSDP2): the step's
        # statistics are summed over the ranks.
        spread = distributed.world_size() > 1 and any(distributed.is_dtensor(p)
                                                      for p in all_params)
        self._model_ref = weakref.ref(model)
        self._stats = stats = Stats()
        self._capture = Capture(shared, lib, hparams, stats, keeps_mu)
        self._modes = modes = Modes(shared, hparams, mode, deferred_store, accumulate_grad)
        self._updater = updater = Updater(shared, lib, hparams, devices, store, stats,
                                          self._capture, modes.begin_step, self._model_ref,
                                          seed=seed, keeps_mu_product=keeps_mu)
        self._backward = backward = Backward(shared, updater, modes)
        self._router = router = Router(
            shared, lib, backward, modes, self._torch_name, spread,
            muon_group=lambda group, rules=type(self): rules._rule(group) == _lib.RULE_MUON)
        self._stepper = Stepper(shared, router, backward, updater, modes, stats,
                                None if max_grad_norm is None else float(max_grad_norm), spread)
        router.check_params(model, all_params, names)
        if distributed.world_size() > 1:
            distributed.check_no_replicating_wrapper(model)
            # A DDP / FSDP1 wrapper made after the optimizer: refused at the model's first
            # training forward too, before backward starts the wrapper's all-reduces that an
            # error raised inside backward would leave in flight.
            router.wrapper_check = model.register_forward_pre_hook(
                WrapperCheck(weakref.ref(router)))
        # Everything is checked: only now is the model touched.
        shared.attached = True
        router.attach(model, all_params, names)
        if _log.isEnabledFor(logging.INFO):
            _log.info("%s", summary.one_line(self.inspect()))

    # torch.optim.Optimizer's containers are the parts' (shared.py)
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self._shared.param_groups

    @param_groups.setter
    def param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self._shared.param_groups = groups

    @property
    def state(self) -> Dict[Any, Dict[str, Any]]:
        return self._shared.state

    @state.setter
    def state(self, state: Dict[Any, Dict[str, Any]]) -> None:
        self._shared.state = state

    # ------------------------------------------------------------------ what it does

    def summary(self, verbose: bool = False) -> str:
        """Which parameters are fused, which take the element-wise path and why (not an
        nn.Linear / Conv1D forward, shared/tied, frozen, ...), the bytes of each, the gradient
        bytes never allocated and the state bytes by format, as readable lines (summary.py).
        verbose: every parameter's name, not the first few of each line."""
        return summary.describe(self.inspect(), verbose)

    def inspect(self) -> summary.Inspection:
        """What summary() reports, as data: a read-only snapshot of every parameter (its path
        and why, its bytes, its states' format, its step count, which hooks update it),
        indexable by name or by the parameter (summary.py)."""
        return summary.inspect(self._shared, self._store, self._model_ref(), self._torch_name)

    @property
    def mode(self) -> str:
        """Where updates run now: "deferred" or "immediate" (an "auto" optimizer is deferred
        for its first step, then one of the two; see MODES). Any optimizer is deferred for a
        step whose backward met the last step's gradient still in .grad (modes.py)."""
        return "deferred" if self._shared.deferring else "immediate"

    @property
    def accumulate_grad(self) -> bool:
        """True: mode="deferred" with dense gradients (deferred_store="grad"). May be
        switched between steps."""
        return self._modes.accumulate_grad

    @accumulate_grad.setter
    def accumulate_grad(self, value: bool) -> None:
        if self._stepper.in_progress():
            raise RuntimeError("accumulate_grad can only be switched between steps (call "
                               "opt.step() first)")
        self._modes.set_accumulate_grad(value)
        self._stepper.set_backward_scale()  # (immediate again: the lagged clip resumes)

    @property
    def grad_norm(self) -> Optional[float]:
        """Global L2 norm of the last step's gradient: with max_grad_norm, the norm before
        clipping (what clip_grad_norm_ returns); otherwise that of the gradients the update
        consumed (after any scaling the loop applied), a by-product of the update. Finite
        elements only; None before the first step()."""
        clip_norm = self._stepper.last_clip_norm
        if clip_norm is not None:
            return float(clip_norm)
        return self._stats.grad_norm()

    @property
    def nonfinite_count(self) -> Optional[int]:
        """Gradient elements of the last step that were NaN/Inf (or whose update would not
        be finite): their weight and states were left untouched. None before the first
        step()."""
        return self._stats.nonfinite_count()

    @torch.no_grad()
    def state_fp32(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The optimizer states of `param` decoded to fp32 tensors of its shape (bf16
        widened, int8 / fp8 codes decoded through forge_state_to_fp32), for inspection."""
        return self._store.state_fp32(param)

    # ------------------------------------------------------------------ torch.optim's surface

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters (deferred mode):
        returns the total norm before clipping."""
        params = [p for g in self.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def register_step_pre_hook(self, hook):
        """torch.optim's; in immediate mode the updates have run before step() is called, so
        a pre-hook cannot run before them: refused there, and an auto optimizer stays
        deferred."""
        self._modes.allow_step_pre_hook()
        return super().register_step_pre_hook(hook)

    @torch.no_grad()
    def step(self, closure=None):
        """Completes the step. Deferred: applies every gradient held in .grad (fused Linear
        weights through one fused GEMM + update over all their tokens), clipped first with
        max_grad_norm. Immediate: updates what backward did not (shared weights), drops (with
        a warning) what a backward left for a weight it never reached. Then closes the
        step's statistics (grad_norm, nonfinite_count). (stepping.py)"""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepper.step(pre_hooks=bool(self._optimizer_step_pre_hooks))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._backward.settle_all()
        for slot in self._shared.slots.values():
            slot.clear_backward()
            slot.held = None
        super().zero_grad(set_to_none=set_to_none)
        self._modes.zeroed(set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            if self._shared.attached:
                model = self._model_ref()
                if model is None:
                    raise RuntimeError("forge: the model of this optimizer no longer exists")
                names = parameter_names(model)
                self._router.check_params(model, group["params"], names)
                self._router.attach(model, group["params"], names)
        except Exception:
            self.param_groups.pop()
            raise

    def __getstate__(self):
        # torch.optim.Optimizer pickles defaults, state and param_groups only: a copy (deepcopy,
        # pickle) would miss the slots and raise on its first step. Refused here, by name.
        raise TypeError(
            f"forge.optim.{type(self).__name__} cannot be copied or pickled: it is bound to its "
            "model's layers (patched forwards, autograd hooks, states in the library's formats). "
            "Save opt.state_dict() and load it with load_state_dict into an optimizer made over "
            "the model")

    def state_dict(self) -> Dict[str, Any]:
        """torch's layout ('state' by parameter index, 'param_groups') holding the raw
        state buffers (fp32, bf16, or int8 / fp8 codes + fp32 absmax, and the fp32 master), each
        parameter's 'step', and a 'forge' entry with the storage options (checkpoint.py),
        whose run values every param group also carries (checkpoint.GROUP_KEY)."""
        self._backward.settle_all()
        # torch.optim's post-hooks (register_state_dict_post_hook) run below, on the whole
        # dict, 'forge' entry included
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = collections.OrderedDict()
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        sd["forge"] = checkpoint.entry(self._shared, self._store, self._modes, self.seed,
                                       self._stepper.lagged_norm)
        carried = checkpoint.group_entry(sd["forge"])
        for group in sd["param_groups"]:  # (a dict of their own: super() packed copies)
            group[checkpoint.GROUP_KEY] = dict(
                carried, state_steps=checkpoint.group_steps(sd["state"], group))
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores states bit for bit (copied into buffers of the exact dtype; nothing is
        cast) and the group hyper-parameters. Refuses a mismatching layout. A state dict
        without forge's own entry (torch.distributed.checkpoint's, which keeps only 'state'
        and 'param_groups': the run values its groups carry are read, or torch.optim's of the
        same rule with fp32 states) loads when every state matches this optimizer's names,
        dtypes and shapes. torch.optim's load pre-hooks (register_load_state_dict_pre_hook)
        see, and may replace, a shallow copy of the dict first; its post-hooks run after a
        load."""
        shared = self._shared
        self._backward.settle_all()
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        meta = checkpoint.saved_entry(state_dict)
        # (everything checked before anything is written: a load is all or nothing)
        loaded = checkpoint.check_load(state_dict, meta, shared, self._store, type(self),
                                       self._check_group)
        checkpoint.apply_load(loaded, shared, self._store)
        self._modes.learned(meta)  # (what the saved auto optimizer learned of the loop)
        self._stepper.lagged_norm = loaded.lagged_norm
        self._stepper.set_backward_scale()
        self._capture.states_loaded += 1  # new state tensors: a captured step no longer reads them
        shared.checked_step = shared.begun_step = -1
        shared.lapse_ready()
        for slot in shared.slots.values():
            slot.updated_at = -1
            slot.struct_step = -1  # (the step count restarts: no struct of before is reused)
            slot.clear_backward()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ------------------------------------------------------------------ the model

    def rebind_streams(self) -> None:
        """Binds the gradient nodes of the fused nn.Linear weights to the current CUDA stream.

        FORGE holds each fused weight's AccumulateGrad node to hook it; torch (2.11) records
        in that node the stream current when it was made (this optimizer's construction).
        Backward on another stream then syncs with that stream and warns that "the
        AccumulateGrad node's stream does not match", and a CUDA-graph capture on another
        stream fails (cudaErrorStreamCaptureInvalidated). Call this, between steps, under the
        stream the steps will run on; forge.graphs.CUDAGraphStep does."""
        self._router.rebind_streams()

    def detach(self) -> None:
        """Gives the model back: plain nn.Linear forwards, no hooks. The optimizer is
        unusable afterwards (except state_dict())."""
        self._router.detach()

    def __del__(self):
        try:
            self.detach()
        except Exception:  # interpreter shutdown, or a constructor that failed early
            pass

    # ------------------------------------------------------------------ CUDA graphs (capture.py)

    def begin_graph_capture(self) -> None:
        """forge.graphs calls this before it captures a step: the updates launched until
        end_graph_capture read their scalars from this optimizer's run-scalars buffers."""
        if not self._shared.attached:
            raise RuntimeError("forge: this optimizer was detached from its model")
        if self._shared.deferring:
            raise RuntimeError(
                "forge: a CUDA-graph step needs the optimizer in immediate mode (mode='immediate',"
                " or 'auto' after a first step that used no gradient before opt.step()); this "
                "one is deferred")
        if self.max_grad_norm is not None:
            raise RuntimeError("forge: max_grad_norm is not supported in a CUDA-graph step")
        muon = [slot.name for slot in self._shared.slots.values() if slot.muon]
        if muon:
            raise RuntimeError(f"forge: Muon's steps are not captured in CUDA graphs (its "
                               f"Newton-Schulz step runs outside libforge): '{muon[0]}'"
                               + (f" and {len(muon) - 1} more" if len(muon) > 1 else ""))
        self._backward.settle_all()
        self._capture.begin()

    def end_graph_capture(self) -> GraphCapture:
        """Ends the capture begun by begin_graph_capture (also after a failed one) and returns
        what it recorded (the step it went through is not a step taken: the first replay is)."""
        return self._capture.end()

    def prepare_graph_replay(self, capture: Optional[GraphCapture] = None) -> None:
        """Before every replay of a captured step (`capture`, end_graph_capture's; default the
        last), on the replay's stream: that step's scalars, from the param groups as they are
        now (a scheduler's new lr), copied to the device; the step is counted."""
        self._capture.prepare_replay(capture, self.seed)

    # ------------------------------------------------------------------ per rule (rules.py)

    @classmethod
    def _rule(cls, group: Dict[str, Any]) -> int:
        raise NotImplementedError

    @classmethod
    def _fill(cls, hp: _lib.Hparams, group: Dict[str, Any]) -> None:
        """Copies the group's hyper-parameters into hp (lr, weight_decay, maximize done).
        Reads only keys of the defaults: the cache of calls.HparamsTable is keyed on them."""
        raise NotImplementedError

    @classmethod
    def _layout_key(cls, group: Dict[str, Any]) -> tuple:
        """What decides the rule and its states; a change after the states exist is refused."""
        return (cls._rule(group),)

    @classmethod
    def _check_group_rule(cls, group: Dict[str, Any]) -> None:
        """torch.optim's own checks for this optimizer, with its messages."""

    def _check_group(self, group: Dict[str, Any]) -> None:
        """A param group's values, each refused by name: its hyper-parameters (torch.optim's
        checks and the rule's), its storage keys, then the library's own validation."""
        self._hparams.check(group)
        self._store.check_group_storage(group)
        self._hparams.check_in_library(group, self._torch_name)


def _check_options(state_format, min_8bit_size, master_weights, stochastic_rounding, seed,
                   num_threads, mode, deferred_store, max_grad_norm, accumulate_grad) -> None:
    """The constructor's FORGE options, each refused by name where it is out of range."""
    check_storage_options(state_format, min_8bit_size)
    if stochastic_rounding is not None and not isinstance(stochastic_rounding, bool):
        raise TypeError(f"stochastic_rounding: must be a bool or None, got "
                        f"{type(stochastic_rounding).__name__}")
    if not isinstance(master_weights, bool):
        raise TypeError(f"master_weights: must be a bool, got {type(master_weights).__name__}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed: must be an int in [0, 2**63), got {seed!r}")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) \
            or not 0 <= num_threads <= _MAX_CPU_THREADS:
        raise ValueError(f"num_threads: must be an int in [0, {_MAX_CPU_THREADS}] (0: torch's "
                         f"thread count), got {num_threads!r}")
    if mode not in MODES:
        raise ValueError(f"mode: unknown value {mode!r}; choose one of {', '.join(MODES)}")
    if deferred_store not in DEFERRED_STORES:
        raise ValueError(f"deferred_store: unknown value {deferred_store!r}; choose one of "
                         f"{', '.join(DEFERRED_STORES)}")
    # (at least fp32's smallest normal: below it the fp32 clip coefficient max_grad_norm /
    # norm is 0 for any norm above 1, a grad_scale the library refuses at every step)
    if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool)
            and _FP32_MIN_NORMAL <= max_grad_norm < math.inf):
        raise ValueError(f"max_grad_norm: must be a finite number >= {_FP32_MIN_NORMAL:.3g} "
                         f"(fp32's smallest normal; or None), got {max_grad_norm!r}")
    if not isinstance(accumulate_grad, bool):
        raise TypeError(f"accumulate_grad: must be a bool, got {type(accumulate_grad).__name__}")
    if accumulate_grad and mode == "immediate":
        raise ValueError("accumulate_grad=True keeps every gradient until opt.step(); it "
                         "cannot be combined with mode='immediate'")


def _unique(params) -> List[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out

