"""deferred.py — the gradient of a fused Linear weight as what it is made of, and the
sentinel left where the gradient was already applied.

FactoredGrad is what a fused Linear weight holds as `.grad` in deferred mode:

    dW = scale · Σ_k dY_kᵀ · X_k        X_k: [T_k, in], dY_k: [T_k, out]

(one (X_k, dY_k) pair per backward: micro-batches concatenate their tokens), or, where
those would take more bytes than dW in W's dtype, as that dense dW (`dense`): what it keeps
never costs more than the gradient torch would keep. The pairs
are the fused step's operands (x: [T, cols], dy: [T, rows] of a [rows, cols] weight, dW =
Σ dyᵀ·x): a Linear's (X, dY); a transformers Conv1D (W: [in, out], dW = Xᵀ·dY) hands its
pair over swapped, (dY, X), so everything here holds for it unchanged. It is a
torch.Tensor of W's shape, dtype and device that owns no storage of that size, so a training
loop's own code can work on it: torch.nn.utils.clip_grad_norm_ takes its norm
(linalg_vector_norm, computed exactly without forming dW) and scales it (mul_; a loop's own
p.grad /= steps, div_, alike), GradScaler's
unscale_ checks it for NaN/Inf and unscales it (_amp_foreach_non_finite_check_and_unscale_),
zero_grad(set_to_none=False) zeroes it. Any other operation forms dW once (in W's dtype, in
`dense`) and runs on that: always correct, and it says so with a warning naming the operation.
opt.step() then runs the fused GEMM + update once over all the tokens (or the element-wise
update on `dense`), with `scale` as the gradient scale (forge_hparams.grad_scale), and frees
what it held: a FactoredGrad the step consumed is `spent`, and any operation on it raises.

ConsumedGrad is the `.grad` of a parameter whose update already ran inside backward
(immediate mode), until opt.step(), and of a fused weight or an FSDP2 shard after opt.step()
(in either mode), where torch.optim would still hold the gradient it applied. Any operation
on it raises, naming the parameter and the way out, so a loop that clips, unscales or
accumulates is told instead of silently clipping nothing; but zero_grad: set_to_none=True
removes it, set_to_none=False marks it zeroed, which the next step reads (modes.py,
begin_step): a zeroed one is a zero gradient that this step's adds to (and one no backward
reaches steps on zeros, as torch.optim steps every parameter holding a gradient); onto one
left as it was torch would add the next gradient, so that gradient is held as a FactoredGrad
marked on_applied, which only zeroing may touch (modes.py, hold_step). A DTensor parameter's
(tensor parallel, FSDP2) is a DTensor of its layout whose local tensor is the ConsumedGrad
(consumed_of).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
import warnings
import weakref
from typing import List, Optional, Tuple

import torch

from .._linear import rows_2d

_aten = torch.ops.aten

# Operations that return their first argument unchanged in meaning (views of the gradient).
_ALIASES = {_aten.detach.default, _aten.alias.default}
# (DTensor.from_local's view of its local tensor: a new tensor standing for the same gradient)
_SAME_SHAPE_VIEWS = {_aten.view.default, _aten._unsafe_view.default}
_MUL = {_aten.mul_.Tensor, _aten.mul_.Scalar}
_DIV = {_aten.div_.Tensor, _aten.div_.Scalar}
_FOREACH_MUL = {_aten._foreach_mul_.Scalar, _aten._foreach_mul_.Tensor,
                _aten._foreach_mul_.List, _aten._foreach_mul_.ScalarList}
_FOREACH_DIV = {_aten._foreach_div_.Scalar, _aten._foreach_div_.Tensor,
                _aten._foreach_div_.List, _aten._foreach_div_.ScalarList}

# NOTE: ‖dYᵀX‖² = Σᵢⱼ (X Xᵀ)ᵢⱼ (dY dYᵀ)ᵢⱼ costs T²·(in + out) multiply-adds against the
# T·in·out of forming dW; the Gram identity is used where it is cheaper, in row blocks of at
# most this many tokens (two [block, T] products alive at a time).
_GRAM_BLOCK = 1024
# Rows of dW formed at a time where dW itself is formed (the max-norm, or a cheaper product).
_DENSE_ROWS = 1024
# Elements squared in fp64 at a time (sum_sq_fp64): 128 MiB of fp64 temporaries at most, where
# the whole tensor at once doubled an embedding's gradient in fp64 (8 GiB on Llama-3.1-8B).
_SQ_CHUNK = 1 << 24


def sum_sq_fp64(t: torch.Tensor) -> torch.Tensor:
    """Σ t² of a dense tensor as a 0-dim fp64 tensor, in chunks (non-finite where t is)."""
    flat = t.reshape(-1)
    if flat.numel() <= _SQ_CHUNK:
        return flat.double().square().sum()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for i in range(0, flat.numel(), _SQ_CHUNK):
        total += flat[i:i + _SQ_CHUNK].double().square().sum()
    return total


class FactoredGrad(torch.Tensor):
    """dW = scale · Σ_k dY_kᵀ X_k of a fused Linear weight (see the file header). Its own
    methods and attributes take names torch.Tensor does not have: one of Tensor's (norm, add,
    multiply) would be shadowed for the loop, whose g.norm() must be torch's."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor, name: str):
        return torch.Tensor._make_wrapper_subclass(
            cls, weight.shape, dtype=weight.dtype, device=weight.device, requires_grad=False)

    def __init__(self, weight: torch.Tensor, name: str):
        self.param_name = name               # the parameter's name, for messages
        # (x_k [T, cols], dy_k [T, rows]): a Linear's (X_k, dY_k), a Conv1D's (dY_k, X_k)
        self.parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.scale = 1.0                     # a float, or a 0-dim tensor (a clip coefficient)
        # dW in W's dtype, unscaled: where the factors would take more bytes, or once an
        # operation needed it
        self.dense: Optional[torch.Tensor] = None
        self._sum_sq: Optional[torch.Tensor] = None  # ‖Σ dY_kᵀ X_k‖² (fp64), unscaled
        self.touched = False                 # a training loop operated on it
        # the last step's gradient, applied and not kept, is under this one (torch's .grad
        # would be their sum): nothing but zeroing it may read or step on it
        self.on_applied = False
        # weak references to the FactoredGrads of the same optimizer step (this one among
        # them): the first norm asked of one computes every one's, batched (fill_sum_sqs)
        self.cohort: Optional[List["weakref.ReferenceType"]] = None
        self.spent = False                   # opt.step() applied it and freed what it held

    def __repr__(self, *, tensor_contents=None):
        tokens = sum(x.size(0) for x, _ in self.parts)
        return (f"FactoredGrad({self.param_name}: {list(self.shape)} {self.dtype}, {len(self.parts)} "
                f"part(s), {tokens} tokens{', materialized' if self.dense is not None else ''})")

    # ---------------------------------------------------------------- building it

    def add_factors(self, x2: torch.Tensor, dy2: torch.Tensor, keep: bool = True) -> None:
        """Adds dy2ᵀ·x2 (x2: [T, cols], dy2: [T, rows]) to the gradient: as one more pair
        where `keep` and nothing is dense or scaled yet, else into the dense dW (unscaled)."""
        if keep and self.dense is None and _is_one(self.scale):
            self.parts.append((x2, dy2))
        else:
            add_product(self.materialize(), x2, dy2, 1.0 / _scale_float(self.scale))
        self._sum_sq = None

    def factor_bytes(self) -> int:
        return sum(_nbytes(x) + _nbytes(dy) for x, dy in self.parts)

    def tokens(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(X, dY) over every part, tokens concatenated in the order they came."""
        if len(self.parts) == 1:
            return self.parts[0]
        xs, dys = zip(*self.parts)
        dtype_x, dtype_dy = _common_dtype(xs), _common_dtype(dys)
        return (torch.cat([x.to(dtype_x) for x in xs]), torch.cat([d.to(dtype_dy) for d in dys]))

    def materialize(self) -> torch.Tensor:
        """dW in W's dtype (unscaled: the scale stays in `scale`); kept in `dense`, the
        factors dropped."""
        if self.dense is None:
            parts, self.parts = self.parts, []
            if len(parts) == 1:
                x, dy = parts[0]
                self.dense = product(x, dy, self.dtype)
            else:
                self.dense = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
                for x, dy in parts:
                    add_product(self.dense, x, dy)
        return self.dense

    def add_dense(self, dw: torch.Tensor) -> None:
        """Adds a formed gradient (any float dtype, W's shape; nobody else's: a first one
        of W's dtype becomes `dense` itself, no copy) to the dense dW."""
        if (not self.parts and self.dense is None and _is_one(self.scale)
                and dw.dtype == self.dtype and dw.is_contiguous() and dw.shape == self.shape):
            self.dense = dw
        else:
            self.materialize().add_(dw, alpha=1.0 / _scale_float(self.scale))
        self._sum_sq = None

    def scaled_dense(self) -> torch.Tensor:
        """scale · dW as a plain tensor of W's dtype; the FactoredGrad is spent."""
        dense = self.materialize()
        if not _is_one(self.scale):
            dense.mul_(self.scale)
        self.spend()
        return dense

    def spend(self) -> None:
        """opt.step() applied it: what it held is freed, and it answers no operation."""
        self.parts, self.dense, self._sum_sq, self.spent = [], None, None, True

    # ---------------------------------------------------------------- what a loop asks of it

    def sum_sq(self) -> torch.Tensor:
        """‖Σ_k dY_kᵀ X_k‖² as a 0-dim fp64 tensor (non-finite when an element of dW is)."""
        if self._sum_sq is None:
            if self.dense is not None:
                self._sum_sq = sum_sq_fp64(self.dense)
            else:
                # NOTE: a loop's clip_grad_norm_ or GradScaler asks every weight in turn: the
                # first asks for all of them at once, as batched products
                cohort = self.cohort
                if cohort is not None and len(cohort) > 1:
                    fill_sum_sqs([g for g in map(_deref, cohort) if g is not None])
                if self._sum_sq is None:  # (not batchable: alone)
                    self._sum_sq = _factored_sum_sq(self.parts, self.shape, self.device)
        return self._sum_sq

    def norm_of(self, ord: float) -> torch.Tensor:
        """‖scale · dW‖_ord in W's dtype (the 2-norm without forming dW)."""
        scale = self.scale if torch.is_tensor(self.scale) else torch.tensor(
            self.scale, dtype=torch.float64, device=self.device)
        if ord == 2:
            value = self.sum_sq().sqrt() * scale.double().abs()
        else:
            value = torch.linalg.vector_norm(self.materialize().double(), ord) * scale.double().abs()
        return value.to(self.dtype)

    def is_all_finite(self) -> torch.Tensor:
        """A 0-dim bool tensor: every element of scale · dW finite."""
        finite = torch.isfinite(self.sum_sq())
        if torch.is_tensor(self.scale):
            finite = finite & torch.isfinite(self.scale)
        elif not math.isfinite(self.scale):
            finite = torch.zeros((), dtype=torch.bool, device=self.device)
        return finite

    def scale_by(self, factor) -> None:
        if torch.is_tensor(factor):
            factor = factor.to(device=self.device, dtype=torch.float64).reshape(())
            self.scale = factor * self.scale if torch.is_tensor(self.scale) else factor * float(
                self.scale)
        elif torch.is_tensor(self.scale):
            self.scale = self.scale * float(factor)
        else:
            self.scale = self.scale * float(factor)

    def zero(self) -> None:
        self.parts, self.dense, self.scale, self._sum_sq = [], None, 1.0, None
        self.on_applied = False

    # NOTE: `g.data = t` (torch.nn.utils.vector_to_parameters over gradients) is no dispatched
    # operation: torch's setter would swap the wrapper's empty storage and leave the factors
    # standing for the gradient. The gradient takes t's values instead.
    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self.shape):
            raise RuntimeError(
                f"forge: the gradient of {self.param_name} is {list(self.shape)}; .data cannot "
                f"take a tensor of shape {list(value.shape)}")
        self.zero()
        self.touched = True
        self.dense = value.detach().to(device=self.device, dtype=torch.float32, copy=True)

    # ---------------------------------------------------------------- dispatch

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES:
            return args[0]
        spent = [t.param_name for t in _flat(args) if isinstance(t, FactoredGrad) and t.spent]
        if spent:
            raise RuntimeError(
                f"forge: the gradient of {', '.join(spent[:3])} was applied by opt.step(), "
                f"which frees it (FORGE never keeps a weight's whole gradient), so {func} cannot "
                "read it: read p.grad again after backward, before opt.step()")
        if func not in (_aten.zero_.default, _aten._foreach_zero_.default):
            on_applied = [t.param_name for t in _flat(args)
                          if isinstance(t, FactoredGrad) and t.on_applied]
            if on_applied:
                raise RuntimeError(
                    f"forge: the gradient of {', '.join(on_applied[:3])} is this step's on top "
                    "of the one the last opt.step() applied (no zero_grad() since), which FORGE "
                    f"does not keep, so {func} cannot see their sum. Call opt.zero_grad() after "
                    "each opt.step().")
        if func is _aten.linalg_vector_norm.default:
            g = args[0]
            g.touched = True
            ord = kwargs.get("ord", args[1] if len(args) > 1 else 2)
            if args[2:] or kwargs.get("dim") is not None:
                return _materialized_op(func, args, kwargs)
            return g.norm_of(float(ord))
        # A scaling by one number (a clip coefficient, 1 / accumulation steps) goes into
        # `scale`: the fused step applies it as one multiply per element, where torch divides
        # (within an ulp, as GradScaler's unscale and the clip). By a tensor: formed dW.
        if (func in _MUL or func in _DIV) and not kwargs:
            g, factor = args[0], args[1]
            if isinstance(g, FactoredGrad) and _is_number(factor):
                g.touched = True
                g.scale_by(factor if func in _MUL else _reciprocal(factor))
                return g
        if (func in _FOREACH_MUL or func in _FOREACH_DIV) and not kwargs:
            grads, factors = args[0], args[1]
            per = factors if isinstance(factors, (list, tuple)) else [factors] * len(grads)
            if all(_is_number(f) for t, f in zip(grads, per) if isinstance(t, FactoredGrad)):
                for t, f in zip(grads, per):
                    if isinstance(t, FactoredGrad):
                        t.touched = True
                        t.scale_by(f if func in _FOREACH_MUL else _reciprocal(f))
                    elif func in _FOREACH_MUL:
                        t.mul_(f)
                    else:
                        t.div_(f)
                return None
        if func is _aten._amp_foreach_non_finite_check_and_unscale_.default:
            grads, found_inf, inv_scale = args
            plain = [t for t in grads if not isinstance(t, FactoredGrad)]
            if plain:
                func(plain, found_inf, inv_scale)
            for t in grads:
                if isinstance(t, FactoredGrad):
                    t.touched = True
                    bad = ~t.is_all_finite()
                    found_inf.copy_(torch.where(bad.to(found_inf.device),
                                                torch.ones_like(found_inf), found_inf))
                    t.scale_by(inv_scale)
            return None
        if func in (_aten.zero_.default, _aten._foreach_zero_.default):
            targets = args[0] if func is _aten._foreach_zero_.default else [args[0]]
            for t in targets:
                if isinstance(t, FactoredGrad):
                    t.zero()
                else:
                    t.zero_()
            return None if func is _aten._foreach_zero_.default else args[0]
        return _materialized_op(func, args, kwargs)


def _is_number(f) -> bool:
    """A Python number or a one-element tensor (not a gradient)."""
    if isinstance(f, (bool, int, float)):
        return True
    return torch.is_tensor(f) and f.numel() == 1 and not isinstance(f, (FactoredGrad, ConsumedGrad))


def _reciprocal(f):
    return 1.0 / f if not torch.is_tensor(f) else 1.0 / f.double()


def _materialized_op(func, args, kwargs):
    """Runs `func` with every FactoredGrad replaced by its dense dW, scale applied. An in-place
    operation on one writes its result into that dense dW (scale 1 from then on)."""
    inplace = not _returns_new(func)
    warned = []

    def dense_of(t):
        if isinstance(t, FactoredGrad):
            t.touched = True
            if t.dense is None:
                warned.append(t.param_name)
            dense = t.materialize()
            if not _is_one(t.scale):
                dense.mul_(t.scale)
                t.scale = 1.0
            t._sum_sq = None
            return dense
        if isinstance(t, (list, tuple)):
            return type(t)(dense_of(e) for e in t)
        return t

    new_args = [dense_of(a) for a in args]
    new_kwargs = {k: dense_of(v) for k, v in kwargs.items()}
    if warned:
        warnings.warn(f"forge: {func} on the deferred gradient of {', '.join(warned)}: formed "
                      "dW to run it (the memory of this weight's gradient in its dtype)",
                      stacklevel=3)
    out = func(*new_args, **new_kwargs)
    return args[0] if inplace and func._schema.name.endswith("_") else out


def _returns_new(func) -> bool:
    return not func._schema.name.endswith("_") and not any(
        a.is_out for a in func._schema.arguments)


def _common_dtype(tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def product(x2: torch.Tensor, dy2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dy2ᵀ·x2 ([rows, cols]; x2: [T, cols], dy2: [T, rows]) in `dtype`, accumulated in fp32
    and rounded once, as torch's Linear backward forms dW. Operands of `dtype` multiply as
    they are (no copies: the gradient in W's dtype is the only new tensor); others go
    through fp32."""
    x2, dy2 = rows_2d(x2), rows_2d(dy2)
    if x2.dtype == dtype and dy2.dtype == dtype:
        return dy2.t().matmul(x2)
    if x2.dtype in _LOW_PRECISION and x2.dtype == dy2.dtype and _has_fp32_out_mm(x2.device):
        return _mm_fp32_out(dy2.t(), x2).to(dtype)
    return dy2.float().t().matmul(x2.float()).to(dtype)


def add_product(dense: torch.Tensor, x2: torch.Tensor, dy2: torch.Tensor,
                alpha: float = 1.0) -> None:
    """dense += alpha · dy2ᵀ·x2, in place (one GEMM into dense where the dtypes agree)."""
    x2, dy2 = rows_2d(x2), rows_2d(dy2)
    if x2.dtype == dense.dtype and dy2.dtype == dense.dtype:
        dense.addmm_(dy2.t(), x2, alpha=alpha)
    else:
        dense.add_(product(x2, dy2, torch.float32), alpha=alpha)


def _is_one(scale) -> bool:
    return not torch.is_tensor(scale) and scale == 1.0


def _deref(ref):
    return ref()


def _scale_float(scale) -> float:
    return float(scale.item()) if torch.is_tensor(scale) else float(scale)


_LOW_PRECISION = {torch.bfloat16, torch.float16}
# CUDA device index -> whether torch.mm and torch.bmm take out_dtype=fp32 for bf16 operands
# there (asked once per device: older torch lacks it, and it has no CPU kernel)
_FP32_OUT_MM: dict = {}


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


def _bmm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b, out_dtype=torch.float32)


def _has_fp32_out_mm(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    known = _FP32_OUT_MM.get(index)
    if known is None:
        probe = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
        try:
            known = (_mm_fp32_out(probe, probe).dtype == torch.float32 and
                     _bmm_fp32_out(probe[None], probe[None]).dtype == torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            known = False
        _FP32_OUT_MM[index] = known
    return known


# Bytes of stacked factors one batched Gram product takes at a time (fill_sum_sqs).
_BATCH_BYTES = 1 << 28


def _gram_work(dtype: Optional[torch.dtype], device: torch.device, batched: bool):
    """(operand dtype, product) of the norm's products for factors of `dtype` (None: mixed):
    fp64 on the CPU (cheap, and the tests' reference precision); on a GPU, bf16 / fp16 factors
    go to the tensor cores as they are, with fp32 results (torch.mm / torch.bmm out_dtype):
    every product of two such values is exact in fp32, and fp32 accumulates them, the
    precision of fp32 operands without their copies and SIMT products; other dtypes, or a
    torch without out_dtype, take fp32 operands.
    NOTE: not TF32 for the fp32 case: that means changing torch's global TF32 setting around
    the products, which torch >= 2.9 refuses to see mixed with its legacy setting
    (docs/design.md §5.4)."""
    if device.type == "cpu":
        return torch.float64, torch.bmm if batched else torch.mm
    if dtype in _LOW_PRECISION and _has_fp32_out_mm(device):
        return dtype, _bmm_fp32_out if batched else _mm_fp32_out
    return torch.float32, torch.bmm if batched else torch.mm


def fill_sum_sqs(grads) -> None:
    """Computes ‖dW‖² (FactoredGrad.sum_sq) of many FactoredGrads at once where it can: weights
    whose factors have the same shapes and dtype, one Gram block each (T ≤ _GRAM_BLOCK, and
    the Gram identity the cheaper way), get their X Xᵀ and dY dYᵀ as batched products, and an
    X shared by several weights (a transformer's q, k and v projections; gate and up) is
    multiplied once. The sums are _factored_sum_sq's, terms in another order; the rest is
    left to each sum_sq().
    NOTE: a clipped step asks for the norm of every weight: one weight at a time costs ~8
    launches and their host time per weight, which the GPU waits for."""
    groups = {}
    for g in grads:
        if not isinstance(g, FactoredGrad) or g._sum_sq is not None or g.dense is not None \
                or not g.parts:
            continue
        rows, cols = g.shape
        tokens = sum(x.size(0) for x, _ in g.parts)
        dtypes = {t.dtype for part in g.parts for t in part}
        if tokens > _GRAM_BLOCK or tokens * (rows + cols) > rows * cols or len(dtypes) != 1:
            continue
        groups.setdefault((g.device, dtypes.pop(), tokens, rows, cols), []).append(g)
    for (device, dtype, tokens, rows, cols), grads_of_shape in groups.items():
        if len(grads_of_shape) < 2:
            continue
        members = [(g, *g.tokens()) for g in grads_of_shape]  # (g, X [T, cols], dY [T, rows])
        work, bmm = _gram_work(dtype, device, batched=True)
        per = tokens * (rows + cols) * torch.empty((), dtype=work).element_size()
        step = max(1, _BATCH_BYTES // per)
        for i in range(0, len(members), step):
            _fill_group(members[i:i + step], work, bmm)


def _fill_group(members, work, bmm) -> None:
    """fill_sum_sqs for weights of one shape: [n] sums from one X and one dY Gram batch."""
    xs, which, seen = [], [], {}
    for _, x, _ in members:
        key = (x.data_ptr(), x.stride(), x.shape)  # the same X handed to several weights
        if key not in seen:
            seen[key] = len(xs)
            xs.append(x)
        which.append(seen[key])
    x = torch.stack(xs).to(work)                                   # [u, T, cols]
    dy = torch.stack([d for _, _, d in members]).to(work)          # [n, T, rows]
    gx = bmm(x, x.transpose(1, 2))                                 # [u, T, T]
    gy = bmm(dy, dy.transpose(1, 2))                               # [n, T, T]
    if len(xs) < len(members):
        gx = gx[torch.tensor(which, device=gx.device)]             # [n, T, T]
    sums = torch.sum(gx * gy, dim=(1, 2), dtype=torch.float64)     # [n]
    for (g, _, _), sq in zip(members, sums.unbind()):
        g._sum_sq = sq


def _factored_sum_sq(parts, shape, device) -> torch.Tensor:
    """‖Σ_k dY_kᵀ X_k‖², exactly up to rounding, without forming dW where the Gram identity
    is cheaper: ‖dYᵀX‖² = Σᵢⱼ (X Xᵀ)ᵢⱼ (dY dYᵀ)ᵢⱼ over the concatenated tokens."""
    rows, cols = shape
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    dtypes = {t.dtype for part in parts for t in part}
    work, mm = _gram_work(dtypes.pop() if len(dtypes) == 1 else None, device, batched=False)
    xs, dys = [x.to(work) for x, _ in parts], [dy.to(work) for _, dy in parts]
    x = xs[0] if len(xs) == 1 else torch.cat(xs)
    dy = dys[0] if len(dys) == 1 else torch.cat(dys)
    tokens = x.size(0)
    if tokens == 0:  # (backwards of no tokens: an expert no token was routed to)
        return torch.zeros((), dtype=torch.float64, device=device)
    # NOTE: a weight's sum in as few launches as its blocks allow (the host issues these for
    # every weight of a clipped step): the products, one multiply, one reduction into fp64.
    sums = []
    if tokens * (rows + cols) <= rows * cols:
        for t0 in range(0, tokens, _GRAM_BLOCK):
            gx = mm(x[t0:t0 + _GRAM_BLOCK], x.t())      # [block, T]
            gy = mm(dy[t0:t0 + _GRAM_BLOCK], dy.t())    # [block, T]
            sums.append(torch.sum(gx * gy, dtype=torch.float64))
    else:
        for r0 in range(0, rows, _DENSE_ROWS):
            block = mm(dy[:, r0:r0 + _DENSE_ROWS].t(), x)  # [rows block, cols] of dW
            sums.append(block.double().square().sum())
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


class ConsumedGrad(torch.Tensor):
    """The .grad of a parameter whose update already ran (see the file header): made once per
    parameter (Slot.consumed_grad); `zeroed` once a zero_grad(set_to_none=False) zeroed it
    after its step."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, slot):
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False)

    def __init__(self, param: torch.Tensor, slot):
        self.param_name = slot.name
        self.slot_ref = weakref.ref(slot)
        self.zeroed = False

    def __repr__(self, *, tensor_contents=None):
        return f"ConsumedGrad({self.param_name}: applied{', zeroed' if self.zeroed else ''})"

    def _like(self, dtype=None, device=None) -> "ConsumedGrad":
        """Another ConsumedGrad standing for the same applied gradient (a view, a copy after
        the model was moved or cast)."""
        other = ConsumedGrad(SimpleNamespace(shape=self.shape, dtype=dtype or self.dtype,
                                             device=device or self.device), self.slot_ref())
        other.zeroed = self.zeroed
        return other

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:  # (no dispatched operation: FactoredGrad's)
        if isinstance(value, ConsumedGrad):  # (Module._apply's cast of .grad: its _to_copy)
            torch.Tensor.data.__set__(self, value)
        else:
            self._refuse("the assignment of .data")

    def _refuse(self, what) -> None:
        """Raises: this applied gradient cannot be read or changed by `what`."""
        before_step, mode = self._before_step()
        if before_step:
            raise RuntimeError(
                f"forge: the gradient of '{self.param_name}' was already applied to the weight "
                f"inside backward (mode='{mode}'), so {what} cannot see or change it. Clipping: "
                "pass max_grad_norm= to the forge optimizer; clipping by hand, GradScaler, "
                "gradient accumulation or reading gradients before opt.step(): build the "
                "optimizer with mode='deferred' (or 'auto').")
        raise RuntimeError(
            f"forge: the gradient of '{self.param_name}' was applied by opt.step() and is not "
            f"kept (FORGE never holds a weight's whole gradient), so {what} cannot see or "
            "change it. Read gradients between backward and opt.step(), with mode='deferred' "
            "(or 'auto').")

    def _before_step(self) -> Tuple[bool, str]:
        """(whether the update ran in the step not yet closed by opt.step(), the optimizer's
        mode)."""
        slot = self.slot_ref()
        backward = slot.backward_ref() if slot is not None else None
        if backward is None:
            return False, "?"
        shared = backward.shared
        return slot.updated_at == shared.step_id, shared.mode

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES:
            return args[0]
        if func in _SAME_SHAPE_VIEWS and tuple(args[1]) == tuple(args[0].shape):
            return args[0]._like()
        if func in (_aten.zero_.default, _aten._foreach_zero_.default):
            targets = args[0] if func is _aten._foreach_zero_.default else [args[0]]
            for t in targets:  # (every one checked before any is zeroed)
                if isinstance(t, ConsumedGrad) and t._before_step()[0]:
                    raise RuntimeError(
                        f"forge: the gradient of '{t.param_name}' was zeroed before opt.step(), "
                        f"but it was already applied to the weight inside backward (mode="
                        f"'{t._before_step()[1]}'), where torch.optim would step on zeros. "
                        "Call zero_grad() after opt.step() (or before backward), or build the "
                        "optimizer with mode='deferred' (or 'auto').")
            for t in targets:
                if isinstance(t, ConsumedGrad):
                    t.zeroed = True
                else:
                    t.zero_()
            return None if func is _aten._foreach_zero_.default else args[0]
        first = next(a for a in _flat(args) if isinstance(a, ConsumedGrad))
        if func is _aten._to_copy.default and not first._before_step()[0]:
            # (a model moved or cast after its step: Module._apply converts each .grad too, as
            # it would torch's gradient; the moved one stands for the same applied gradient)
            return first._like(kwargs.get("dtype"), kwargs.get("device"))
        first._refuse(func)


def consumed_of(grad) -> Optional[ConsumedGrad]:
    """The ConsumedGrad a .grad is (or, a DTensor's, holds as its local tensor); None for
    any other gradient."""
    if type(grad) is ConsumedGrad:
        return grad
    local = getattr(grad, "_local_tensor", None)
    return local if type(local) is ConsumedGrad else None


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a
