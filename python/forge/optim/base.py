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

import collections
import functools
import logging
import math
import operator
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .. import _lib, _linear
from .call import _CallMixin, _as_float, _fp32, _nadam_mu
from .capture import _CaptureMixin, GraphCapture
from .routing import BATCHED_MAX_ELEMENTS, _RoutingMixin, _Slot, _owner_of
from . import distributed
from .deferred import FactoredGrad, consumed_of, fill_sum_sqs, sum_sq_fp64
from . import summary as _summary
from .states import (BLOCK_FORMATS, MIN_8BIT_SIZE, STORAGE_KEYS, _StatesMixin,
                     check_storage_options)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
MODES = ("auto", "immediate", "deferred")
DEFERRED_STORES = ("auto", "factors", "grad")
_log = logging.getLogger("forge")


def _bad_fp8_codes(codes: torch.Tensor, unsigned: bool) -> bool:
    """Whether fp8 state codes (uint8) hold what no step stores: e4m3's NaN (S.1111.111) for a
    signed state; for an unsigned one (e5m2) an infinity or NaN (exponent 11111) or a negative
    value (-0, 0x80, is stored)."""
    c = codes.to(torch.int16)
    if not unsigned:
        return bool(((c & 0x7F) == 0x7F).any())
    return bool((((c & 0x7C) == 0x7C) | (c > 0x80)).any())


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
      state_format         "fp32" | "bf16" | "int8" (block-64 dynamic map + fp32 absmax) |
                           "fp8" (e4m3 / e5m2 scaled per block of 64 by an fp32 absmax); a
                           param group may carry its own "state_format" (states.py).
      min_8bit_size        with "int8" / "fp8", a parameter of fewer elements keeps fp32 states
                           (bitsandbytes' name and default, 4096); a group may carry its own.
      master_weights       bf16 parameters keep an fp32 master copy (state "master"); the
                           bf16 weight is its nearest rounding. No effect on fp32 parameters.
      stochastic_rounding  bf16 weight and state stores round stochastically (default True);
                           the bits come from (seed + parameter index, step, element).
      seed                 see stochastic_rounding.
      mode                 where the update runs (see MODES below); default "auto".
      max_grad_norm        clip the global L2 norm of the gradient to this (torch's
                           clip_grad_norm_ formula): exact in deferred and auto mode; in
                           immediate mode lagged: step t uses the norm of step t - 1 (its first
                           step is not clipped). opt.grad_norm reports the norm before clipping.
      deferred_store       deferred mode, per fused Linear: "auto" (its X and dY while they are
                           smaller than dW, else a dense gradient), "factors", or "grad".
      accumulate_grad      True is mode="deferred", deferred_store="grad": a full .grad per
                           parameter, as torch.optim keeps.
      num_threads          CPU backend threads (0: torch.get_num_threads()).

    MODES
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
    # momentum factors, multiplied as torch.optim.NAdam multiplies them: call.py,
    # _mu_product_through), which every update passes as hparams.mu_product.
    _keeps_mu_product = False
    # Whether torch.optim's own state of this rule holds a 'step' (SGD's does not: a torch
    # checkpoint's momentum_buffer, which its first step makes, then stands for step 1).
    _torch_keeps_step = True

    def __init__(self, model: nn.Module, params, defaults: Dict[str, Any], *,
                 state_format: str = "fp32", min_8bit_size: int = MIN_8BIT_SIZE,
                 master_weights: bool = False,
                 stochastic_rounding: Optional[bool] = None, seed: int = 0,
                 mode: str = "auto", max_grad_norm: Optional[float] = None,
                 deferred_store: str = "auto", accumulate_grad: bool = False,
                 num_threads: int = 0):
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
                            "not model.parameters(); param groups go in params=, after it)")
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
        self.state_format = state_format  # the default of every param group (states.py)
        self.min_8bit_size = min_8bit_size
        self.master_weights = master_weights
        self.stochastic_rounding = True if stochastic_rounding is None else stochastic_rounding
        self.seed = seed
        self.num_threads = num_threads
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._mode = "deferred" if accumulate_grad else mode
        self._deferred_store = "grad" if accumulate_grad else deferred_store
        self._requested = (mode, deferred_store)  # what accumulate_grad=False returns to
        self._deferring = self._mode != "immediate"
        # mode="auto": whether its loop needs the gradients before step() (every step then
        # deferred), as learned at its first step or loaded with a state dict; None: to learn
        self._auto_deferring: Optional[bool] = None
        self._clip_norm: Optional[torch.Tensor] = None  # this step's norm before clipping
        self._loop_needs_grads = False  # a step pre-hook was registered (auto mode)
        self._graphed_grads = False  # a backward with create_graph=True reached a fused weight
        # The gradient scale of updates that run inside backward: the lagged clip coefficient
        # in immediate mode with max_grad_norm, else 1.
        self._backward_scale = 1.0
        self._checked_step = -1  # the step _check_step last passed (call.py)
        # The C++ records' readiness epoch (forge/_prehook.py; made with the first record):
        # advanced wherever the calls readied by _check_step lapse (_lapse_ready)
        self._clock = None
        self._last_clip_norm: Optional[torch.Tensor] = None
        self._model_ref = weakref.ref(model)

        names = _parameter_names(model)
        if params is None:
            params = _unique([p for p in model.parameters() if p.requires_grad])
            if not params:
                raise ValueError(f"{self._torch_name}: the model has no trainable parameters "
                                 "(none with requires_grad=True)")
        # (the storage keys join the group defaults; _hparam_keys above leaves them out)
        super().__init__(params, dict(defaults, state_format=state_format,
                                      min_8bit_size=min_8bit_size))  # validates each group
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._check_params(model, all_params, names)

        # A model spread over ranks (DTensor parameters: tensor parallel, FSDP2): the step's
        # statistics are summed over the ranks.
        self._distributed = distributed.world_size() > 1 and any(
            distributed.is_dtensor(p) for p in all_params)
        self._wrapper_check = None
        self._backward_start = None  # the model's forward hook with FSDP2 shards (routing.py)
        if distributed.world_size() > 1:
            distributed.check_no_replicating_wrapper(model)
            # A DDP / FSDP1 wrapper made after the optimizer: refused at the model's first
            # training forward too, before backward starts the wrapper's all-reduces that an
            # error raised inside backward would leave in flight.
            self._wrapper_check = model.register_forward_pre_hook(
                _WrapperCheck(weakref.ref(self)))
        # Everything is checked: only now is the model touched.
        self._slots: Dict[int, _Slot] = {}
        self._step_id = 0                 # number of completed step() calls
        self._cohort: list = []           # this step's FactoredGrads, weakly (routing.py)
        # What steps leave in .grad (deferred.py, ConsumedGrad): the parameters whose
        # ConsumedGrad the last step() left (_Slot.keeps_consumed), and whether the loop
        # zeroed them keeping them (set_to_none=False); the step whose first callback ran
        # _begin_step
        self._left: list = []
        self._grads_zeroed = False
        # A held step's (_hold_step) mode outside it (_deferring's value), None outside one
        self._mode_outside_hold: Optional[bool] = None
        self._begun_step = -1
        # Each group's hyper-parameters as the step's first backward saw them: [(group, bytes
        # of its forge_hparams, or None where the values are refused later)]
        self._backward_hparams: list = []
        self._cohort_step = -1
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
        if _log.isEnabledFor(logging.INFO):
            _log.info("%s", _summary.one_line(self))

    # ------------------------------------------------------------------ public surface

    def summary(self, verbose: bool = False) -> str:
        """Which parameters are fused, which take the element-wise path and why (not an
        nn.Linear / Conv1D forward, shared/tied, frozen, ...), the bytes of each, the gradient
        bytes never allocated and the state bytes by format, as readable lines (summary.py).
        verbose: every parameter's name, not the first few of each line."""
        return _summary.describe(self, verbose)

    @property
    def mode(self) -> str:
        """Where updates run now: "deferred" or "immediate" (an "auto" optimizer is deferred
        for its first step, then one of the two; see MODES). Any optimizer is deferred for a
        step whose backward met the last step's gradient still in .grad (_hold_step)."""
        return "deferred" if self._deferring else "immediate"

    @property
    def accumulate_grad(self) -> bool:
        """True: mode="deferred" with dense gradients (deferred_store="grad"). May be
        switched between steps."""
        return self._deferring and self._deferred_store == "grad"

    @accumulate_grad.setter
    def accumulate_grad(self, value: bool) -> None:
        if self._step_in_progress():
            raise RuntimeError("accumulate_grad can only be switched between steps (call "
                               "opt.step() first)")
        if value:
            self._mode, self._deferred_store = "deferred", "grad"
        else:
            self._mode, self._deferred_store = self._requested
        deferring = self._mode == "deferred" or (
            self._mode == "auto" and self._auto_deferring is not False)
        if self._mode_outside_hold is not None:  # (a held step: its mode after it)
            self._mode_outside_hold = deferring
        else:
            self._deferring = deferring
        self._lapse_ready()

    @property
    def grad_norm(self) -> Optional[float]:
        """Global L2 norm of the last step's gradient: with max_grad_norm, the norm before
        clipping (what clip_grad_norm_ returns); otherwise that of the gradients the update
        consumed (after any scaling the loop applied), a by-product of the update. Finite
        elements only; None before the first step()."""
        if self._last_clip_norm is not None:
            return float(self._last_clip_norm)
        if self._last_stats is None:
            return None
        return math.sqrt(sum(float(sq.item()) for sq, _ in self._last_stats.values()))

    @property
    def nonfinite_count(self) -> Optional[int]:
        """Gradient elements of the last step that were NaN/Inf (or whose update would not
        be finite): their weight and states were left untouched. None before the first
        step()."""
        if self._last_stats is None:
            return None
        return sum(int(nf.item()) for _, nf in self._last_stats.values())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters (deferred mode):
        returns the total norm before clipping."""
        params = [p for g in self.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def register_step_pre_hook(self, hook):
        """torch.optim's; in immediate mode the updates have run before step() is called, so
        a pre-hook cannot run before them: refused there, and an auto optimizer stays
        deferred."""
        if not self._deferring or self._mode_outside_hold is False:
            raise RuntimeError(
                "forge: a step pre-hook runs before the update, but this optimizer updates "
                f"inside backward (mode='{self._mode_name()}'); build it with "
                "mode='deferred' (or 'auto') to use step pre-hooks")
        self._loop_needs_grads = True
        return super().register_step_pre_hook(hook)

    @torch.no_grad()
    def step(self, closure=None):
        """Completes the step. Deferred: applies every gradient held in .grad (fused Linear
        weights through one fused GEMM + update over all their tokens), clipped first with
        max_grad_norm. Immediate: updates what backward did not (shared weights), drops (with
        a warning) what a backward left for a weight it never reached. Then closes the
        step's statistics (grad_norm, nonfinite_count)."""
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
        if self._begun_step != self._step_id:
            self._begin_step()
        if not self._deferring and self._checked_step != self._step_id:
            self._check_step()  # (a refusal first: before the warning below, or any update)
        self._settle_all()  # (calls the C++ pre-hook made, or ones it never reached)
        self._lapse_ready()
        if not self._deferring and not self._capturing:
            self._refuse_hparams_changed_after_updates()
        missed = [s for s in self._slots.values() if s.pending or s.partial is not None]
        missed = [s.name for s in missed if not self._recover_replaced_node(s)]
        if missed:
            warnings.warn(
                "forge: backward ran through the nn.Linear of " + ", ".join(missed) + " but "
                "never reached the weight's gradient node, so it was not updated this step",
                stacklevel=2)
        for slot in self._slots.values():
            slot.clear_backward()
            self._restore_held(slot)
        deferred = self._deferring
        if deferred:
            self._step_deferred()
        else:
            self._step_immediate()
        if self._grads_zeroed:
            self._step_on_zeros()
        self._grads_zeroed = False
        if not deferred and self.max_grad_norm is not None and self._stats:
            # lagged clipping: the true norm is the consumed one over the coefficient used
            consumed = math.sqrt(sum(float(sq.item()) for sq, _ in self._stats.values()))
            self._clip_norm = torch.tensor(consumed / self._backward_scale)
        if self._distributed and not self._capturing:
            self._reduce_stats()
        self._last_stats = self._stats
        self._stats = {}
        self._stats_outputs = {}
        self._last_clip_norm, self._clip_norm = self._clip_norm, None
        for slot in self._slots.values():
            if slot.updated_at == self._step_id:
                slot.grad_kept = True  # (torch's gradient stays until a zero_grad)
        self._end_hold()
        self._backward_scale = self._lagged_clip_scale() if not self._deferring else 1.0
        self._step_id += 1
        return loss

    def _step_immediate(self) -> None:
        batch = []  # (slot, grad, scale) of the plain gradients: one library call
        for slot in self._slots.values():
            p = slot.param
            grad = p.grad
            if grad is None:
                continue
            if consumed_of(grad) is not None:
                if slot.keeps_consumed:
                    self._left.append(slot)  # (kept: where torch's gradient would stay)
                else:
                    p.grad = None
                continue
            if slot.updated_at == self._step_id:
                raise RuntimeError(
                    f"forge: parameter '{slot.name}' was already updated in this step's "
                    "backward but holds a .grad again; set it to None, or use mode='deferred' "
                    "to apply gradients in step()")
            if grad.is_sparse:
                raise RuntimeError(f"forge: parameter '{slot.name}' has a sparse gradient, "
                                   "which FORGE does not support")
            if slot.dtensor:
                self._update(slot, grad=distributed.grad_as_param(grad, p))
                p.grad = None
            else:
                batch.append((slot, distributed.grad_as_param(grad, p), None))
        self._update_batch(batch)
        for slot, _, _ in batch:  # (only once applied: a refused batch keeps them)
            slot.param.grad = None

    def _hparams_snapshot(self) -> list:
        snapshot = []
        for group in self.param_groups:
            try:
                snapshot.append((group, bytes(self._group_hparams(group)[0])))
            except (KeyError, TypeError, ValueError, RuntimeError):
                snapshot.append((group, None))  # (refused, by name, where an update reads it)
        return snapshot

    def _hparams_changed(self) -> Optional[str]:
        """What a loop changed in a group's hyper-parameters since the step's first backward
        (a scheduler stepped before opt.step(), an lr set there), in words; None if nothing."""
        for group, before in self._backward_hparams:
            if before is None:
                continue
            try:
                now = self._group_hparams(group)[0]
            except (KeyError, TypeError, ValueError, RuntimeError):
                continue
            if bytes(now) == before:
                continue
            old = _lib.Hparams.from_buffer_copy(before)
            index = next((i for i, g in enumerate(self.param_groups) if g is group), "?")
            return ", ".join(f"{name} of param group {index} ({getattr(old, name)!r} -> "
                             f"{getattr(now, name)!r})" for name, _ in _lib.Hparams._fields_
                             if getattr(old, name) != getattr(now, name))
        return None

    def _refuse_hparams_changed_after_updates(self) -> None:
        """Updates ran inside this step's backward with the hyper-parameters set then; torch
        applies those of opt.step(). Where the loop changed one in between, refused."""
        changed = self._hparams_changed() if self._backward_hparams else None
        if changed is None or not any(s.updated_at == self._step_id
                                      for s in self._slots.values()):
            return
        auto = (" (mode='auto' went immediate after its first step, where nothing changed "
                "there)" if self._mode == "auto" else "")
        raise RuntimeError(
            f"forge: {changed} changed between backward and opt.step(): the weights were "
            f"updated inside backward with the values set then{auto}, where torch.optim applies "
            "those of opt.step(). Change hyper-parameters before backward or after opt.step() "
            "(an LR scheduler's step() after opt.step(), as torch asks), or use mode='deferred', "
            "which applies them at opt.step()")

    def _leave_consumed(self, slot) -> None:
        """After a parameter's update in step(): a fused weight or an FSDP2 shard keeps its
        ConsumedGrad in .grad, where torch.optim's gradient would stay until zero_grad; any
        other gets None (_Slot.keeps_consumed)."""
        consumed = slot.consumed_grad() if slot.keeps_consumed else None
        slot.param.grad = consumed
        if consumed is not None:
            self._left.append(slot)

    def _begin_step(self) -> None:
        """At a step's first callback (a Linear's backward, a gradient hook, the fused head's
        backward, the first update, or step()), before anything of the step is read or
        updated, or where an update runs decided: what the last step left in the fused
        weights' .grad. torch.optim would add this step's gradients to the ones it applied
        unless the loop zeroed them: where the loop set them to None nothing is left; where it
        zeroed them (set_to_none=False) the weight starts this step from a zero gradient, and
        the step then also updates, on zeros, the parameters that had a gradient before and
        that no backward of it reaches (_step_on_zeros). Where one is left as it was, torch
        would add this step's gradients to it, which matters only if the loop steps before
        it zeroes them (another model's loss reaching these weights, as a GAN's generator
        loss reaches the discriminator, is zeroed first): the step holds every gradient until
        step() (_hold_step), and a weight's lands on top of the applied one (FactoredGrad's
        on_applied), refused where read or stepped on. A DTensor shard's is refused here,
        before anything is updated."""
        stale = []
        for slot in self._left:
            g = consumed_of(slot.param.grad)
            if g is None:
                slot.grad_kept = False  # (set to None, or replaced by the loop)
                continue
            if g.zeroed:
                g.zeroed = False
                slot.param.grad = None
                self._grads_zeroed = True
            else:
                stale.append(slot)
        self._left = []
        self._begun_step = self._step_id
        self._backward_hparams = self._hparams_snapshot()
        if stale:
            shards = [slot.name for slot in stale if slot.dtensor]
            if shards:
                raise RuntimeError(_applied_still_held(shards, "Nothing was updated."))
            self._hold_step()
        elif not self._deferring:
            self._hold_for_own_grads()

    def _hold_for_own_grads(self) -> None:
        """A fused weight may hold a gradient no step of this optimizer made: from a backward
        before it was built or before the parameter was added to it, or one the loop put in
        .grad. torch adds this step's gradient to it; an update inside backward would drop it.
        The step runs deferred instead (_hold_step), which sums the two. (Not for DTensor
        shards: under tensor parallel their .grad was found set at every step's first
        callback, a case not examined further.)"""
        if any(slot.mode == "fused" and not slot.dtensor and _own_grad(slot.param.grad)
               for slot in self._slots.values()):
            self._hold_step()

    def _hold_step(self) -> None:
        """This step runs deferred, whatever the mode: every gradient waits in .grad until
        step() (or zero_grad). An immediate optimizer is immediate again after it, or from
        the zero_grad(set_to_none=True) that leaves nothing held."""
        if self._mode_outside_hold is None:
            self._mode_outside_hold = self._deferring
            self._deferring = True
            self._lapse_ready()

    def _end_hold(self) -> None:
        if self._mode_outside_hold is not None:
            self._deferring, self._mode_outside_hold = self._mode_outside_hold, None
            self._lapse_ready()

    def _step_on_zeros(self) -> None:
        """The loop zeroed the last step's gradients keeping them (zero_grad(set_to_none=False)):
        torch.optim steps every parameter that holds a gradient tensor, so each parameter
        updated before (a gradient tensor in torch's place) that no backward of this step
        reached steps on zeros: its moments decay and weight decay applies. (One whose
        gradient a zero_grad set to None before is not: torch holds none for it.)"""
        batch = []
        for slot in self._slots.values():
            p = slot.param
            if not slot.grad_kept or slot.updated_at == self._step_id or p.grad is not None:
                continue
            if slot.keeps_consumed or slot.dtensor:  # (one parameter's zeros at a time)
                self._update(slot, grad=distributed.grad_as_param(torch.zeros_like(p), p),
                             scale=1.0)
                self._leave_consumed(slot)
                if p.grad is not None:
                    consumed_of(p.grad).zeroed = True  # (zeros, as torch's gradient is now)
            else:
                batch.append((slot, torch.zeros_like(p), None))
        self._update_batch(batch)

    def _step_deferred(self) -> None:
        held = [(slot, slot.param.grad) for slot in self._slots.values()
                if slot.param.grad is not None]
        for slot, grad in held:
            if consumed_of(grad) is not None and slot.updated_at == self._step_id:
                raise RuntimeError(f"forge: parameter '{slot.name}' holds the gradient of an "
                                   "update that already ran inside backward")
        applied = [slot.name for slot, grad in held if consumed_of(grad) is not None
                   or (isinstance(grad, FactoredGrad) and grad.on_applied)]
        if applied:  # (the last step's gradient, with or without this step's on top)
            raise RuntimeError(_applied_still_held(applied, "Nothing was updated; the "
                                                   "gradients stay as they are."))
        for slot, grad in held:
            if not isinstance(grad, FactoredGrad) and grad.is_sparse:
                raise RuntimeError(f"forge: parameter '{slot.name}' has a sparse gradient, "
                                   "which FORGE does not support")
        self._check_step()  # nothing is written unless every update of the step can run
        if self._mode == "auto" and self._auto_deferring is None:
            self._decide_auto(held)
        clip = 1.0
        if self.max_grad_norm is not None and held:
            total = _global_norm([g for _, g in held])
            self._clip_norm = total
            # torch's clip_grad_norm_: max_norm / (total + 1e-6), at most 1, in fp32
            clip = torch.clamp(self.max_grad_norm / (total.float() + 1e-6), max=1.0)
            clip = float(clip)  # NOTE: one host synchronization per step
        # NOTE: each gradient is freed as soon as its update ran, so the step's peak is what is
        # held plus the states made so far, never every gradient and every state at once (on
        # the first step the states are made here, weight by weight, in the memory the
        # gradients leave). The small plain gradients (biases, norm scales) go in one call.
        batch = []  # (slot, grad, scale) of the small plain gradients: one library call
        for i in range(len(held)):
            (slot, grad), held[i] = held[i], None
            if isinstance(grad, FactoredGrad):
                scale = clip * _host_scale(grad.scale)
                if grad.dense is not None:
                    self._update(slot, grad=grad.dense, scale=scale)
                elif any(x.size(0) for x, _ in grad.parts):
                    x2, dy2 = grad.tokens()
                    self._update(slot, x=(x2, x2.stride(0)), dy=(dy2, dy2.stride(0)),
                                 scale=scale)
                    del x2, dy2
                else:  # zeroed (zero_grad(set_to_none=False)), or backwards of no tokens (an
                    # empty batch, an expert no token was routed to): torch steps on zeros
                    self._update(slot, grad=torch.zeros_like(slot.param), scale=1.0)
                grad.spend()
            elif slot.dtensor or grad.numel() > BATCHED_MAX_ELEMENTS:
                self._update(slot, grad=distributed.grad_as_param(grad, slot.param), scale=clip)
            else:
                batch.append((slot, distributed.grad_as_param(grad, slot.param), clip))
                continue
            del grad
            self._leave_consumed(slot)
        self._update_batch(batch)
        for slot, _, _ in batch:
            self._leave_consumed(slot)

    def _reduce_stats(self) -> None:
        """The step's statistics summed over every rank (each element was counted by one)."""
        import torch.distributed as dist
        for slot in self._slots.values():
            self._outputs(slot.device)  # every rank reduces the same tensors
        for sq, nf in self._stats.values():
            dist.all_reduce(sq)
            dist.all_reduce(nf)

    def _decide_auto(self, held) -> None:
        """End of an auto optimizer's first step: stay deferred if the loop used a gradient
        before opt.step() (or may have: a DTensor's use is not seen), else run immediate from
        the next step."""
        touched = [slot.name for slot, g in held
                   if (slot.mode in ("fused", "hook") and slot.grad_arrivals > 1)
                   or (slot.grad_left is not None and slot.grad_left() is not g)
                   or (isinstance(g, FactoredGrad) and (g.touched or len(g.parts) > 1))
                   or (slot.mode == "hook" and slot.grad_version is not None
                       and g._version != slot.grad_version)]
        # A gradient a backward made and the loop set aside before opt.step() (zero_grad
        # between a backward and the step: a clean pass for an adversarial input, a skipped
        # batch): immediate mode would have applied it inside that backward.
        kept = {id(slot) for slot, _ in held}
        discarded = [slot.name for slot in self._slots.values()
                     if slot.mode in ("fused", "hook") and slot.grad_arrivals == 1
                     and id(slot) not in kept]
        reasons = []
        if touched:
            reasons.append("the gradient of " + ", ".join(touched[:3])
                           + (" ..." if len(touched) > 3 else "")
                           + " was used, accumulated, replaced or made anew")
        if discarded:
            reasons.append("the gradient of " + ", ".join(discarded[:3])
                           + (" ..." if len(discarded) > 3 else "")
                           + " was zeroed between a backward and opt.step()")
        if any(slot.dtensor for slot in self._slots.values()):
            # NOTE: an in-place op on a DTensor gradient (clip_grad_norm_'s _foreach_mul_)
            # may leave both its and its local tensor's version counters as they were
            reasons.append("the model has DTensor parameters (tensor parallel, FSDP2), whose "
                           "gradients' use by the loop cannot be seen; build the optimizer with "
                           "mode='immediate' where the loop never reads a gradient")
        if self._graphed_grads:
            reasons.append("a backward with create_graph=True made gradients to differentiate")
        changed = self._hparams_changed()
        if changed:
            reasons.append(f"{changed} changed between backward and opt.step()")
        if self.max_grad_norm is not None:
            reasons.append("max_grad_norm is set")
        if self._loop_needs_grads or getattr(self, "_optimizer_step_pre_hooks", None) \
                or _global_pre_hooks():
            reasons.append("a step pre-hook is registered")
        self._auto_deferring = bool(reasons)
        if reasons:
            _log.info("forge: mode='auto' stays deferred: %s", "; ".join(reasons))
        else:
            self._deferring = False
            self._lapse_ready()
            _log.info("forge: mode='auto': the loop does not use gradients before opt.step(); "
                      "updates run inside backward from the next step on")

    def _lagged_clip_scale(self) -> float:
        """Immediate mode with max_grad_norm: the clip coefficient of the previous step's
        norm (1 for the first step)."""
        if self.max_grad_norm is None or self._last_clip_norm is None:
            return 1.0
        return min(1.0, self.max_grad_norm / (float(self._last_clip_norm) + 1e-6))

    def _step_in_progress(self) -> bool:
        """A backward ran since the last step() (an update ran, or a gradient is held)."""
        self._settle_all()
        return any(s.updated_at == self._step_id or s.pending or s.partial is not None
                   or s.held is not None
                   or (s.param.grad is not None and consumed_of(s.param.grad) is None)
                   for s in self._slots.values())

    def _lapse_ready(self) -> None:
        """The calls _check_step readied are no longer this step's: the C++ Linear backward
        arms none until the next check readies them again."""
        if self._clock is not None:
            self._clock.advance()

    def _mode_name(self) -> str:
        return self._mode

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._settle_all()
        for slot in self._slots.values():
            slot.clear_backward()
            slot.held = None
        super().zero_grad(set_to_none=set_to_none)
        if not set_to_none:  # (torch keeps zeros: _step_on_zeros)
            self._grads_zeroed = True
        else:  # nothing is held: a held step goes on in the optimizer's mode
            for slot in self._slots.values():
                slot.grad_kept = False
            self._end_hold()

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
        parameter's 'step', and a 'forge' entry with the storage options."""
        self._settle_all()
        # torch.optim's post-hooks (register_state_dict_post_hook) run below, on the whole
        # dict, 'forge' entry included
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = collections.OrderedDict()
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        # format_version 2 added state_formats: {parameter index: format} of every
        # parameter with states (version 1: state_format held for all of them)
        sd["forge"] = {"format_version": 2, "state_format": self.state_format,
                       "state_formats": self._state_formats_by_index(),
                       "master_weights": self.master_weights,
                       "stochastic_rounding": self.stochastic_rounding, "seed": self.seed,
                       "step_id": self._step_id, "mode": self._requested[0],
                       "auto_deferring": self._auto_deferring}
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores states bit for bit (copied into buffers of the exact dtype; nothing is
        cast) and the group hyper-parameters. Refuses a mismatching layout. A state dict
        without forge's own entry (torch.distributed.checkpoint's, which keeps only 'state'
        and 'param_groups', or torch.optim's of the same rule with fp32 states) loads when
        every state matches this optimizer's names, dtypes and shapes. torch.optim's load
        pre-hooks (register_load_state_dict_pre_hook) see, and may replace, a shallow copy of
        the dict first; its post-hooks run after a load."""
        self._settle_all()
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        meta = state_dict.get("forge") or {}
        if "master_weights" in meta and meta["master_weights"] != self.master_weights:
            raise ValueError(f"load_state_dict: saved with master_weights="
                             f"{meta['master_weights']!r}, this optimizer has "
                             f"master_weights={self.master_weights!r}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: {len(saved_groups)} param groups saved, "
                             f"{len(self.param_groups)} here")
        # The groups as they will be (hyper-parameters from the dict, our params).
        new_groups = []
        index_to_param = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("load_state_dict: a param group's size differs from the saved one")
            _check_saved_group_options(saved, i)
            index_to_param.update(zip(saved["params"], group["params"]))
            new = dict(group)
            # (a group's storage keys stay this optimizer's: the formats are checked below)
            new.update({k: v for k, v in saved.items()
                        if k not in ("params", "param_names") + STORAGE_KEYS})
            self._check_group(new)
            new_groups.append(new)
        group_of = {id(p): new for new in new_groups for p in new["params"]}
        # (checked per parameter below)
        saved_formats = self._saved_state_formats(meta, saved_groups, index_to_param)
        step_id = _saved_count(meta.get("step_id", self._step_id), "the 'forge' entry's step_id")
        # Check every state before writing anything: a load is all or nothing.
        plans = []
        for index, saved_state in state_dict["state"].items():
            if index not in index_to_param:
                raise ValueError(f"load_state_dict: state for unknown parameter index {index}")
            p = index_to_param[index]
            slot = self._slots[id(p)]
            fmt = self._check_saved_format(slot, group_of[id(p)], index, saved_formats)
            expected = self._state_spec(slot, group_of[id(p)], fmt=fmt)
            counters = ("step", "mu_product") if self._keeps_mu_product else ("step",)
            keys = set(saved_state) - set(counters)
            if "step" not in saved_state and not self._torch_keeps_step and keys == set(expected):
                saved_state = dict(saved_state, step=1)  # (torch.optim.SGD's, stepped)
            if keys != set(expected) or "step" not in saved_state:
                raise ValueError(f"load_state_dict: parameter '{slot.name}': saved states "
                                 f"{sorted(saved_state)}, expected {sorted(expected)} + "
                                 f"{' + '.join(map(repr, counters))} (rule or state_format "
                                 "differs)")
            for key, (dtype, shape) in expected.items():
                t = saved_state[key]
                if not torch.is_tensor(t) or t.dtype != dtype or tuple(t.shape) != shape:
                    raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                     f"must be {dtype} {list(shape)}, got "
                                     f"{getattr(t, 'dtype', type(t))} "
                                     f"{list(getattr(t, 'shape', []))}")
            self._check_loaded_values(slot, group_of[id(p)], saved_state, fmt)
            step = _saved_count(saved_state["step"], f"parameter '{slot.name}': state 'step'")
            mu_product = self._saved_mu_product(slot, group_of[id(p)], saved_state, step) \
                if self._keeps_mu_product else None
            plans.append((slot, saved_state, step, mu_product))
        for new, group in zip(new_groups, self.param_groups):
            group.update({k: v for k, v in new.items() if k != "params"})
        self.state.clear()
        for slot, saved_state, step, mu_product in plans:
            st = self._allocate_state(slot, self._group_of(slot), init=False)
            for key in self._state_spec(slot, self._group_of(slot)):
                st[key].copy_(saved_state[key])
            st["step"] = step
            if mu_product is not None:
                st["mu_product"] = mu_product
        self._step_id = step_id
        if self._mode == "auto":  # (what the saved auto optimizer learned of the loop, or learn)
            learned = meta.get("auto_deferring") if meta.get("mode") == "auto" else None
            self._auto_deferring = learned if isinstance(learned, bool) else None
            self._deferring = self._auto_deferring is not False
        self._states_loaded += 1  # new state tensors: a captured step no longer reads them
        self._checked_step = self._begun_step = -1
        self._lapse_ready()
        for slot in self._slots.values():
            slot.updated_at = -1
            slot.struct_step = -1  # (the step count restarts: no struct of before is reused)
            slot.clear_backward()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _saved_mu_product(self, slot, group, saved_state, step: int) -> float:
        """NAdam's saved 'mu_product' (torch.optim.NAdam's: a one-element tensor; forge's: a
        float), as the fp32 value it holds, in [0, 1]. A state without one (saved by a forge
        that computed it from the step) gets the product a constant beta1 gives, as torch's
        fp32 state multiplies it."""
        what = f"load_state_dict: parameter '{slot.name}': state 'mu_product'"
        value = saved_state.get("mu_product")
        if value is None:
            return _constant_mu_product(_as_float(group["betas"][0], "betas"),
                                        _as_float(group["momentum_decay"], "momentum_decay"),
                                        step)
        if torch.is_tensor(value):
            if value.numel() != 1 or not value.is_floating_point():
                raise ValueError(f"{what} must be one float, got a {value.dtype} tensor of "
                                 f"shape {list(value.shape)}")
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0.0 <= value <= 1.0:
            raise ValueError(f"{what} must be a number in [0, 1] (a product of momentum "
                             f"factors), got {value!r}")
        return _fp32(float(value))

    def _check_loaded_values(self, slot, group, saved_state, fmt: str) -> None:
        """Values a step could never have stored are refused: NaN/Inf anywhere (states,
        int8 / fp8 absmax, master weights, fp8 codes), magnitudes above the largest bf16 (the
        bound of every value a step stores: forge.h, "Skipped elements"), a negative second
        moment or absmax."""
        layout = self._layout(slot, group, fmt)
        for i in range(layout.num_states):
            name = layout.names[i].decode()
            unsigned = not layout.is_signed[i]
            if fmt in BLOCK_FORMATS:
                checks = [(name + "_absmax", True)]
            else:
                checks = [(name, unsigned)]
            for key, non_negative in checks:
                t = saved_state[key]
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                     "holds NaN or Inf")
                if bool((t.abs() > _BF16_MAX).any()):
                    raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                     "holds values above the largest bf16 (no step stores one)")
                if non_negative and bool((t < 0).any()):
                    raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{key}' "
                                     "holds negative values (it can only be >= 0)")
            if fmt == "fp8" and _bad_fp8_codes(saved_state[name], unsigned):
                raise ValueError(f"load_state_dict: parameter '{slot.name}': state '{name}' "
                                 "holds fp8 codes no step stores (NaN, infinity"
                                 f"{', or negative' if unsigned else ''})")
        master = saved_state.get("master")
        if master is not None and not bool((master.abs() <= _BF16_MAX).all()):
            raise ValueError(f"load_state_dict: parameter '{slot.name}': state 'master' holds "
                             "NaN, Inf or values above the largest bf16 (no step stores one)")

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
        self._check_group_storage(group)
        # The library's own validation, as a backstop (the message names the field).
        try:
            self._lib.state_layout(self._hparams(group, step=1, seed=0), _lib.STATE_FP32, 1, 1)
        except _lib.ForgeInvalidArgument as e:
            raise ValueError(f"{self._torch_name}: {e}") from None

    def _check_params(self, model: nn.Module, params: Sequence[torch.Tensor],
                      names: Dict[int, List[str]]) -> None:
        sparse = {id(_linear.registered_weight(m)) for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        for p in params:
            if id(p) not in names:
                raise ValueError(f"{self._torch_name}: a parameter of shape {list(p.shape)} in "
                                 "the param groups is not a parameter of the model")
            name = names[id(p)][0]
            if not isinstance(p, nn.Parameter) and not p.is_leaf:
                raise ValueError(f"parameter '{name}': not a leaf tensor")
            # (a frozen parameter of another dtype, e.g. a quantized base layer's uint8
            # storage, is accepted as torch.optim accepts it: it is never stepped)
            if p.dtype not in _SUPPORTED_DTYPES and p.requires_grad:
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


def _own_grad(grad) -> bool:
    """Whether a .grad is a gradient of the parameter's own (a tensor autograd or the loop
    put there), not one this optimizer left (ConsumedGrad) or holds (FactoredGrad)."""
    if grad is None or consumed_of(grad) is not None:
        return False
    return not isinstance(getattr(grad, "_local_tensor", grad), FactoredGrad)


def _applied_still_held(names, then: str) -> str:
    return (f"forge: the gradient of {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
            "applied by the last opt.step() is still in .grad (under any this step's backward "
            "added): no zero_grad() since, so torch.optim would step on their sum, and FORGE "
            "keeps no weight gradient to add to. Call opt.zero_grad() (or model.zero_grad()) "
            "after each opt.step(); to accumulate micro-batches, run their backwards before "
            f"one opt.step() with mode='deferred' (or 'auto'). {then}")


class _WrapperCheck:
    """The model's forward pre-hook on several ranks (see __init__): checks once, at the first
    forward that records a graph before the first step, then removes itself (a wrapper made
    later still meets the first update's check)."""

    def __init__(self, opt_ref):
        self.opt_ref = opt_ref

    def __call__(self, module, args) -> None:
        opt = self.opt_ref()
        if opt is None or not torch.is_grad_enabled():
            return
        if opt._step_id == 0:
            distributed.check_no_replicating_wrapper(module)  # (raises: the hook stays)
        if opt._wrapper_check is not None:
            opt._wrapper_check.remove()
            opt._wrapper_check = None


def _global_norm(grads) -> torch.Tensor:
    """The global L2 norm of a step's gradients (FactoredGrad or dense), fp64, on the first
    gradient's device."""
    device = grads[0].device
    fill_sum_sqs(grads)  # (the factored ones batched where their shapes allow)
    squares = []
    for g in grads:
        if isinstance(g, FactoredGrad):
            sq = sum_sq_fp64(g.dense) if g.dense is not None else g.sum_sq()
            scale = g.scale
            if torch.is_tensor(scale):
                sq = sq * scale.double() ** 2
            elif scale != 1:
                sq = sq * float(scale) ** 2
        elif distributed.is_dtensor(g):  # a shard's sum: summed over the ranks once
            sq = g.double().square().sum().full_tensor()
        else:
            sq = sum_sq_fp64(g)
        squares.append(sq.to(device))
    # NOTE: one stack and one sum, not an addition launched per gradient
    return torch.stack(squares).sum().sqrt()


def _host_scale(scale) -> float:
    return float(scale.item()) if torch.is_tensor(scale) else float(scale)


def _global_pre_hooks() -> bool:
    import torch.optim.optimizer as torch_optimizer
    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    return bool(hooks)


# Steps _constant_mu_product multiplies out one by one (a few ms); beyond, the closed form.
_MU_PRODUCT_LOOP_STEPS = 1 << 16


@functools.lru_cache(maxsize=64)
def _constant_mu_product(beta1: float, momentum_decay: float, step: int) -> float:
    """NAdam's fp32 state['mu_product'] after `step` steps with these constant
    hyper-parameters: through 2^16 steps as torch.optim.NAdam's state multiplies it, step by
    step in fp32 (call.py, _CallMixin._mu_product_through), and beyond, where that loop would
    cost a second at step 3·10^6, the library's closed form (forge_hparams.mu_product = -1's,
    in double) rounded to fp32. The loop also ends where the product stops changing: at 0,
    or where multiplying by the momentum factor, which only grows with the step, rounds back
    to it."""
    if step > _MU_PRODUCT_LOOP_STEPS:
        return _fp32(_nadam_mu_product_closed(beta1, momentum_decay, step))
    product = 1.0
    for t in range(1, step + 1):
        before = product
        product = _fp32(product * _fp32(_nadam_mu(beta1, momentum_decay, t)))
        if product == before and t > 1:
            break
    return product


def _nadam_mu_product_closed(beta1: float, momentum_decay: float, t: int) -> float:
    """Π_{i=1..t} β1 (1 − ½ q^i), q = 0.96^ψ, in constant time: src/core/hparams.h's
    nadam_mu_product, the same series in the same order."""
    ln_q = momentum_decay * math.log(0.96)
    one_minus_q = -math.expm1(ln_q)
    if not one_minus_q > 0.0:
        return (0.5 * beta1) ** t
    q, q_t, one_minus_q_t = math.exp(ln_q), math.exp(t * ln_q), -math.expm1(t * ln_q)
    a, b, q_k, q_kt, total, half_k = one_minus_q, one_minus_q_t, q, q_t, 0.0, 1.0
    for k in range(1, 65):
        half_k *= 0.5
        term = half_k / k * q_k * (b / a)
        total += term
        if term <= total * 2.0 ** -54:
            break
        a += q_k * one_minus_q
        b += q_kt * one_minus_q_t
        q_k *= q
        q_kt *= q_t
    return beta1 ** t * math.exp(-total)


# fp32's smallest normal value, 2^-126.
_FP32_MIN_NORMAL = 2.0 ** -126

# forge.h's FORGE_MAX_CPU_THREADS: the most threads a CPU step may ask for.
_MAX_CPU_THREADS = 1024

# The largest finite bf16, 0x1.FEp127: no step stores a value of larger magnitude (formats.h).
_BF16_MAX = float.fromhex("0x1.FEp127")

# The largest saved step count: the next step's number, one more, must fit the library's int64.
_MAX_SAVED_COUNT = 2 ** 63 - 2


def _saved_count(value, what: str) -> int:
    """A saved step count: an int (or a one-element integral tensor) in [0, 2**63 - 2]."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"load_state_dict: {what} must be one integer, got a tensor of "
                             f"shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SAVED_COUNT:
        raise ValueError(f"load_state_dict: {what} must be an integer in [0, 2**63 - 2] (the "
                         f"next step's number must fit int64), got {value!r}")
    return value


# torch.optim options a saved param group may carry that FORGE does not do (rules.py refuses
# them in the constructors): loading one would drop it without a word.
_UNSUPPORTED_GROUP_OPTIONS = ("amsgrad", "capturable", "differentiable")


def _check_saved_group_options(saved: Dict[str, Any], index: int) -> None:
    for key in _UNSUPPORTED_GROUP_OPTIONS:
        if saved.get(key):
            raise ValueError(f"load_state_dict: saved param group {index}: {key}=True, which "
                             f"FORGE does not do (its constructors refuse it too)")
