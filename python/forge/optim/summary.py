"""summary.py — what a forge optimizer does with each parameter, in words (opt.summary()).

Reports, from the slots routing.py made (each records its path and why):
  fused         weights whose update runs inside the weight-gradient GEMM: their gradient is
                never allocated (the "gradient bytes never allocated" line is their size);
  element-wise  parameters whose gradient autograd forms and a hook applies at once (then
                frees), grouped by why they are not fused;
  deferred      parameters whose gradient waits in .grad for opt.step() (shared/tied, or a
                torch without the hooks);
  frozen        requires_grad=False: in the param groups (never stepped), or only in the model;
and the optimizer states each format will hold (made at a parameter's first update).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Tuple

import torch

from .. import _prehook

_EXAMPLES = 3  # names shown per line unless verbose


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _names(names: List[str], verbose: bool) -> str:
    if verbose or len(names) <= _EXAMPLES:
        return ", ".join(names)
    return ", ".join(names[:_EXAMPLES]) + f", ... (+{len(names) - _EXAMPLES} more)"


def tally(opt) -> Dict[str, object]:
    """The figures of the summary: per path {reason: [(name, bytes)]}, frozen parameters of
    the model outside the param groups, and state bytes by format."""
    paths: Dict[str, "OrderedDict[str, List[Tuple[str, int]]]"] = {
        "fused": OrderedDict(), "hook": OrderedDict(), "batched": OrderedDict(),
        "deferred": OrderedDict(), "frozen": OrderedDict()}
    states: Dict[str, List[int]] = {}  # format -> [parameters, bytes]
    for slot in sorted(opt._slots.values(), key=lambda s: s.index):
        nbytes = _nbytes(slot.local())
        frozen = not slot.param.requires_grad and slot.mode == "deferred" \
            and slot.reason.startswith("frozen")
        path = "frozen" if frozen else slot.mode
        # (a shared parameter is shown under all its names)
        paths[path].setdefault(slot.reason, []).append((" = ".join(slot.names), nbytes))
        if frozen:
            continue
        group = opt._group_of(slot)
        fmt = opt._format_of(slot, group)
        spec = opt._state_spec(slot, group, local=True)
        state_bytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                          for key, (dtype, shape) in spec.items() if key != "master")
        entry = states.setdefault(fmt, [0, 0])
        entry[0] += 1
        entry[1] += state_bytes
        if "master" in spec:
            master = states.setdefault("fp32 master weights", [0, 0])
            master[0] += 1
            master[1] += torch.Size(spec["master"][1]).numel() * 4
    outside: List[Tuple[str, int, bool]] = []  # (name, bytes, frozen) of the model's others
    model = opt._model_ref()
    if model is not None:
        seen = set(opt._slots)
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                outside.append((name, _nbytes(p), not p.requires_grad))
    return {"paths": paths, "states": states, "outside": outside}


def describe(opt, verbose: bool = False) -> str:
    """opt.summary(): a readable multi-line report (see the file header)."""
    t = tally(opt)
    paths, states, outside = t["paths"], t["states"], t["outside"]
    model = opt._model_ref()
    count = lambda path: sum(len(v) for v in paths[path].values())  # noqa: E731
    size = lambda path: sum(b for v in paths[path].values() for _, b in v)  # noqa: E731
    lines = [f"forge.optim.{opt._torch_name} over "
             f"{type(model).__name__ if model is not None else 'a deleted model'}: "
             f"{_plural(len(opt._slots), 'parameter')} in its param groups, mode={opt._mode!r}"]
    titles = {
        "fused": "fused into the weight-gradient GEMM (no gradient is ever allocated)",
        "hook": "element-wise: autograd forms the gradient, a hook applies and frees it",
        "batched": "element-wise, small: the gradient waits in .grad, opt.step() applies all "
                   "of them in one call",
        "deferred": "deferred: the gradient waits in .grad for opt.step()",
        "frozen": "frozen (requires_grad=False) in the param groups: never stepped"}
    for path, title in titles.items():
        n = count(path)
        if n == 0 and path != "fused":
            continue
        lines.append(f"  {title}: {_plural(n, 'parameter')}, {_bytes(size(path))}")
        for reason, items in paths[path].items():
            lines.append(f"    {len(items):>4}  {reason}, {_bytes(sum(b for _, b in items))}")
            lines.append(f"            {_names([n for n, _ in items], verbose)}")
    frozen_out = [(n, b) for n, b, f in outside if f]
    trainable_out = [(n, b) for n, b, f in outside if not f]
    if frozen_out:
        lines.append(f"  frozen, in the model only: {_plural(len(frozen_out), 'parameter')}, "
                     f"{_bytes(sum(b for _, b in frozen_out))} (untouched; their layers keep "
                     "their own forward)")
        lines.append(f"            {_names([n for n, _ in frozen_out], verbose)}")
    if trainable_out:
        lines.append(f"  trainable but in no param group of this optimizer: "
                     f"{_plural(len(trainable_out), 'parameter')}, "
                     f"{_bytes(sum(b for _, b in trainable_out))}: "
                     f"{_names([n for n, _ in trainable_out], verbose)}")
    lines.append(f"  gradient bytes never allocated: {_bytes(size('fused'))} (the fused "
                 "weights' gradients)")
    fused_slots = [s for s in opt._slots.values() if s.mode == "fused"]
    if fused_slots:
        in_cpp = sum(1 for s in fused_slots if s.record is not None)
        why = "" if in_cpp == len(fused_slots) else \
            f"; the Python pre-hook for {len(fused_slots) - in_cpp} " + (
                f"(the C++ one is not built: {_prehook.failure})" if in_cpp == 0
                and _prehook.failure else "(sharded or detached)")
        lines.append(f"  fused weights' update inside backward: the C++ pre-hook for {in_cpp}"
                     f" (of which {sum(1 for s in fused_slots if s.cpp_linear is not None)} "
                     f"with the C++ Linear or Conv1D backward){why}")
    parts = [f"{fmt} {_bytes(b)} ({_plural(n, 'parameter')})"
             for fmt, (n, b) in sorted(states.items()) if b]
    lines.append("  optimizer states (made at each parameter's first update): "
                 + ("; ".join(parts) if parts else "none"))
    return "\n".join(lines)


def one_line(opt) -> str:
    """The INFO line logged at construction."""
    t = tally(opt)
    paths, states = t["paths"], t["states"]
    count = lambda path: sum(len(v) for v in paths[path].values())  # noqa: E731
    fused = sum(b for v in paths["fused"].values() for _, b in v)
    frozen = count("frozen") + sum(1 for *_, f in t["outside"] if f)
    state_text = ", ".join(f"{fmt} {_bytes(b)}" for fmt, (_, b) in sorted(states.items()) if b)
    return (f"forge: {opt._torch_name}: {count('fused')} weights fused "
            f"({_bytes(fused)} of gradients never allocated), "
            f"{count('hook') + count('batched')} element-wise ({count('batched')} small: "
            "applied together in step()), "
            f"{count('deferred')} deferred to step(), {frozen} frozen; states "
            f"{state_text or 'none'}; opt.summary() says which and why")
