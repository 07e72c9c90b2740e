"""_ops.py — a fused Linear's backward inside a torch.compile graph.

Dynamo traces an autograd.Function's backward into the graph and refuses Python side
effects there; the hand-off of (X, dY) to the optimizer's slot (optim/slot.py) is one.
So when torch.compile traces FusedLinearFunction or FusedConv1DFunction (_linear.py), their
backward calls two custom operators (torch.library, torch >= 2.4), opaque calls to Dynamo,
AOTAutograd and Inductor:

  forge::wgrad_hand_off(x, dy, weight, key, keep) -> W's gradient stand-in
      runs, when the compiled backward reaches it, the slot's own hand-off
      (Slot.hand_off_in_graph) for the slot registered under `key` (slot_of_key, below);
      keep: decided when the backward is traced, whether the slot may keep x and dy until
      W's update (they take fewer bytes than dW in W's dtype), else dW is formed at once;
      where the C++ part of fused Linears is built, its kernel first arms the slot's record
      if the update is ready (forge/csrc/prehook.cpp), without Python. Its output is W's
      gradient in the graph, so it is never dead code: the slot's stand-in, one zero
      expanded to W's shape (the fake gives the same layout; a new tensor, never an alias
      of an input). W's AccumulateGrad pre-hook runs the fused step after the compiled
      backward, as in eager.
  forge::bias_grad(dy) -> Σ_t dY, summed by aten as the eager backward sums it (an
      Inductor reduction sums in its own order), so db has eager's bits.

A hand-off with keep keeps x and dy (the slot's pending pair) after the op returns, which
Inductor cannot see: past a buffer's last use it recycles its storage for a later buffer of
the same graph, and a saved activation donated to the backward is such a buffer too. ready(),
run once when Dynamo first traces a fused Linear, registers an Inductor lowering of the
hand-off that adds those inputs to the graph's never-reuse set (Inductor's own mechanism for
buffers it must keep, which also keeps them to the graph's end). A compiled backward's
hand-offs all run before the first update (W's AccumulateGrad comes after the graph), so
keeping every weight's x and dY would cost more than the gradients they stand for: a
hand-off without keep forms dW in W's dtype and lets them go, freed as Inductor frees any
buffer. Where torch lacks what this needs, ready() is False and the Linear's
backward stays outside the graph (one graph break per Linear), with a warning once.

The hand-off is tagged cudagraph_unsafe where torch has the tag (a CUDA graph replay would
run the kernels around it but not the hand-off); without the tag, a replay that skipped the
hand-off is caught at W's AccumulateGrad and raised (optim/slot.py, outside_grad).
"""
import itertools
import warnings
import weakref

import torch

from . import _prehook

_READY = None  # ready()'s answer, once known
_LIB = None    # the torch.library.Library holding the operators (kept alive)

# key -> slot, for forge::wgrad_hand_off; weak: a slot's entry goes with it, and keys are
# never reused (a graph compiled for an optimizer now gone finds none)
_BY_KEY: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def new_key(slot) -> int:
    """A key for `slot` (the int a compiled graph holds), never given twice."""
    key = next(_KEYS)
    _BY_KEY[key] = slot
    return key


def slot_of_key(key: int):
    """The slot registered under key, or None once it is gone."""
    return _BY_KEY.get(key)


def _define_ops() -> None:
    """Registers the two operators: defined by schema, one kernel for every device
    (CompositeExplicitAutograd) and a fake one. (torch.library.custom_op would wrap each call
    in its own Python dispatch layers: 13 against 3 µs a call, docs/design.md §5.6.) Where the
    C++ part of fused Linears is built (forge/_prehook.py), the hand-off's kernel is its:
    it arms a weight whose update is ready as the C++ Linear backward does, and calls the
    Python one below for everything else."""
    global _LIB
    lib = torch.library.Library("forge", "FRAGMENT")
    tags = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
    lib.define("wgrad_hand_off(Tensor x, Tensor dy, Tensor weight, int key, bool keep) -> Tensor",
               tags=tags)
    lib.define("bias_grad(Tensor dy) -> Tensor")

    def wgrad_hand_off(x, dy, weight, key, keep):
        slot = slot_of_key(key)
        if slot is None:
            raise RuntimeError(
                "forge: a compiled backward reached a fused Linear whose optimizer is gone "
                "(garbage-collected since the forward); keep the optimizer alive until "
                "backward() returns")
        return slot.hand_off_in_graph(x, dy, weight, keep)

    def bias_grad(dy):
        return dy.reshape(-1, dy.shape[-1]).sum(0)

    cpp = _prehook.get()
    if cpp is not None:  # (its kernel arms a ready weight's record, this one for the rest)
        cpp.register_hand_off(wgrad_hand_off)
    else:
        lib.impl("wgrad_hand_off", wgrad_hand_off, "CompositeExplicitAutograd")
    lib.impl("bias_grad", bias_grad, "CompositeExplicitAutograd")
    torch.library.register_fake("forge::wgrad_hand_off",
                                lambda x, dy, weight, key, keep:
                                weight.new_empty(()).expand(weight.shape),
                                lib=lib)
    torch.library.register_fake("forge::bias_grad", lambda dy: dy.new_empty(dy.shape[-1:]), lib=lib)
    _LIB = lib


def _pin_hand_off_inputs() -> None:
    """Inductor lowers forge::wgrad_hand_off as the fallback call it would make anyway,
    with x and dy of a hand-off that keeps them in the graph's never-reuse set (they live on
    in the slot)."""
    from torch._inductor import graph, lowering
    from torch._inductor.virtualized import V
    if "never_reuse_buffers" not in graph.GraphLowering.__init__.__code__.co_names:
        raise RuntimeError("Inductor's graph has no never-reuse set")
    op = torch.ops.forge.wgrad_hand_off.default
    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    @lowering.register_lowering(op, type_promotion_kind=None)
    def _lower(x, dy, weight, key, keep):
        if keep:
            for t in (x, dy):
                t.realize()
                V.graph.never_reuse_buffers.add(t.get_name())
        return fallback(x, dy, weight, key, keep)


def _ready() -> bool:
    global _READY
    if _READY is None:
        try:
            if not hasattr(torch.library, "register_fake"):
                raise RuntimeError("torch.library.register_fake is missing (torch < 2.4)")
            _define_ops()
            _pin_hand_off_inputs()
            _READY = True
        except Exception as e:  # an older or changed torch: the eager backward, as before
            _READY = False
            warnings.warn(
                f"forge: torch.compile cannot take the fused Linear's backward into the graph "
                f"on this torch ({torch.__version__}: {e}); each fused Linear runs its backward "
                "outside the graph (a graph break per Linear), with the same results",
                stacklevel=2)
    return _READY


# Dynamo runs ready() when it traces a fused Linear's forward and keeps the answer as a
# constant of the graph.
ready = torch.compiler.assume_constant_result(_ready) \
    if hasattr(torch.compiler, "assume_constant_result") else _ready


def wgrad_hand_off(x, dy, weight, key: int, keep: bool):
    return torch.ops.forge.wgrad_hand_off(x, dy, weight, key, keep)


def bias_grad(dy):
    return torch.ops.forge.bias_grad(dy)

