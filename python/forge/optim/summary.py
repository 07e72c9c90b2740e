"""summary.py — what a forge optimizer does with each parameter: as data (opt.inspect()) and
in words (opt.summary(), rendered from the same data).

    info = opt.inspect()                      # an Inspection: a snapshot, read-only
    info["fc.weight"].path                    # "fused"; info[param] works too
    [p.name for p in info if p.path == "batched"]

Each parameter's record (ParamInfo) says its path and why (routing.py's slot), its bytes and
its states' format and bytes, its step count, whether this step updated it, and which hooks
carry its update (the C++ ones of forge/_prehook.py, or Python's). The text groups them:
  fused         weights whose update runs inside the weight-gradient GEMM: their gradient is
                never allocated (the "gradient bytes never allocated" line is their size);
  element-wise  parameters whose gradient autograd forms and a hook applies at once (then
                frees), or step() applies in one call (the small ones), grouped by why they
                are not fused;
  deferred      parameters whose gradient waits in .grad for opt.step() (shared/tied, or a
                torch without the hooks);
  frozen        requires_grad=False: in the param groups (never stepped), or only in the model;
and the optimizer states each format will hold (made at a parameter's first update).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from .. import _prehook

_EXAMPLES = 3  # names shown per line unless verbose


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter of the optimizer's param groups, as it stands when inspected."""
    name: str                   # its first name in the model
    names: Tuple[str, ...]      # every name (a shared/tied parameter has several)
    index: int                  # its state_dict index (param_groups order)
    path: str                   # "fused" | "hook" | "batched" | "deferred" (routing.py)
    layer: Optional[str]        # fused: "Linear" or "Conv1D"; else None
    reason: str                 # why this path, in words
    frozen: bool                # requires_grad=False in the param groups: never stepped
    nbytes: int                 # the parameter's bytes on this rank
    state_format: Optional[str]  # fixed once its states exist, else what its group asks for
    state_bytes: int            # its states' bytes (made at its first update), master aside
    master_bytes: int           # its fp32 master copy's bytes (master_weights), else 0
    step: int                   # its own step count (state['step']; 0 before its first)
    updated_this_step: bool     # its update of the step in progress ran
    waiting: bool               # backward handed over what its update has not used yet
    cpp_prehook: bool           # its weight node's hooks are the C++ ones (_prehook.py)
    cpp_backward: bool          # its layer's forward makes the C++ Linear / Conv1D backward
    made_in_cpp: bool           # the C++ pre-hook made its update, not yet seen by Python
    python_hooks: int           # Python hooks the optimizer holds on it (or on its node)
    # the raw CUDA stream handle its fused call (kept for its updates) runs on; None on the
    # CPU, or before its first fused update
    wgrad_stream: Optional[int]
    param: torch.Tensor = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What opt.inspect() returns: the optimizer's parameters (ParamInfo, in param_groups
    order), iterable and indexable by name or by the parameter itself."""
    optimizer: str                  # the rule's class name: "AdamW", ...
    model: Optional[str]            # the model's class name (None: the model is gone)
    mode: str                       # where updates run now: "deferred" or "immediate"
    requested_mode: str             # the mode asked for: "auto", "immediate" or "deferred"
    step: int                       # completed opt.step() calls
    params: Tuple[ParamInfo, ...]
    # the model's parameters in no param group: (name, bytes, frozen)
    outside: Tuple[Tuple[str, int, bool], ...]
    cpp_failure: Optional[str]      # why the C++ part is not in use (None: in use, or untried)

    def __iter__(self) -> Iterator[ParamInfo]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, key: Union[str, torch.Tensor]) -> ParamInfo:
        for info in self.params:
            if (info.param is key) if isinstance(key, torch.Tensor) else key in info.names:
                return info
        raise KeyError(key if isinstance(key, str) else f"a parameter of shape "
                       f"{list(key.shape)} that is in no param group of this optimizer")


def inspect(shared, store, model, torch_name: str) -> Inspection:
    """The Inspection of an optimizer's parts (shared: its Shared; store: its Store)."""
    params = []
    step_id = shared.step_id
    for slot in sorted(shared.slots.values(), key=lambda s: s.index):
        p = slot.param
        frozen = not p.requires_grad and slot.mode == "deferred" \
            and slot.reason.startswith("frozen")
        fmt, state_bytes, master_bytes = None, 0, 0
        if not frozen:
            group = shared.group_of(slot)
            fmt = store.format_of(slot, group)
            spec = store.spec(slot, group, local=True)
            state_bytes = sum(torch.Size(shape).numel()
                              * torch.empty((), dtype=dtype).element_size()
                              for key, (dtype, shape) in spec.items() if key != "master")
            if "master" in spec:
                master_bytes = torch.Size(spec["master"][1]).numel() * 4
        st = shared.state.get(p)
        record = slot.record
        made_in_cpp = record is not None and record.called
        kept = slot.kept_args.get("wgrad")
        params.append(ParamInfo(
            name=slot.name, names=tuple(slot.names), index=slot.index, path=slot.mode,
            layer=slot.kind, reason=slot.reason, frozen=frozen, nbytes=_nbytes(slot.local()),
            state_format=fmt, state_bytes=state_bytes, master_bytes=master_bytes,
            step=st.get("step", 0) if st else 0,
            updated_this_step=slot.updated_at == step_id or made_in_cpp,
            waiting=bool(slot.pending) or slot.partial is not None
            or (record is not None and record.armed),
            cpp_prehook=record is not None and record.enabled,
            cpp_backward=slot.cpp_linear is not None, made_in_cpp=made_in_cpp,
            python_hooks=len(slot.handles),
            wgrad_stream=(kept[0].device.stream or 0) if kept is not None and p.is_cuda
            else None,  # (ctypes gives None for a null stream: the legacy default, 0)
            param=p))
    outside: List[Tuple[str, int, bool]] = []
    if model is not None:
        seen = set(shared.slots)
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                outside.append((name, _nbytes(p), not p.requires_grad))
    return Inspection(
        optimizer=torch_name, model=type(model).__name__ if model is not None else None,
        mode="deferred" if shared.deferring else "immediate", requested_mode=shared.mode,
        step=step_id, params=tuple(params), outside=tuple(outside),
        cpp_failure=_prehook.failure)


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


def _tally(info: Inspection):
    """Per path {reason: [(name, bytes)]} ("frozen" a path of its own here) and state bytes
    by format: [parameters, bytes]."""
    paths: Dict[str, "OrderedDict[str, List[Tuple[str, int]]]"] = {
        "fused": OrderedDict(), "hook": OrderedDict(), "batched": OrderedDict(),
        "deferred": OrderedDict(), "frozen": OrderedDict()}
    states: Dict[str, List[int]] = {}  # format -> [parameters, bytes]
    for p in info.params:
        path = "frozen" if p.frozen else p.path
        # (a shared parameter is shown under all its names)
        paths[path].setdefault(p.reason, []).append((" = ".join(p.names), p.nbytes))
        if p.frozen:
            continue
        entry = states.setdefault(p.state_format, [0, 0])
        entry[0] += 1
        entry[1] += p.state_bytes
        if p.master_bytes:
            master = states.setdefault("fp32 master weights", [0, 0])
            master[0] += 1
            master[1] += p.master_bytes
    return paths, states


def describe(info: Inspection, verbose: bool = False) -> str:
    """opt.summary(): a readable multi-line report (see the file header)."""
    paths, states = _tally(info)
    outside = info.outside
    count = lambda path: sum(len(v) for v in paths[path].values())  # noqa: E731
    size = lambda path: sum(b for v in paths[path].values() for _, b in v)  # noqa: E731
    lines = [f"forge.optim.{info.optimizer} over "
             f"{info.model if info.model is not None else 'a deleted model'}: "
             f"{_plural(len(info.params), 'parameter')} in its param groups, "
             f"mode={info.requested_mode!r}"]
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
    fused = [p for p in info.params if p.path == "fused"]
    if fused:
        in_cpp = sum(1 for p in fused if p.cpp_prehook)
        why = "" if in_cpp == len(fused) else \
            f"; the Python pre-hook for {len(fused) - in_cpp} " + (
                f"(the C++ one is not built: {info.cpp_failure})" if in_cpp == 0
                and info.cpp_failure else "(sharded, detached, or Muon's)")
        lines.append(f"  fused weights' update inside backward: the C++ pre-hook for {in_cpp}"
                     f" (of which {sum(1 for p in fused if p.cpp_backward)} "
                     f"with the C++ Linear or Conv1D backward){why}")
    parts = [f"{fmt} {_bytes(b)} ({_plural(n, 'parameter')})"
             for fmt, (n, b) in sorted(states.items()) if b]
    lines.append("  optimizer states (made at each parameter's first update): "
                 + ("; ".join(parts) if parts else "none"))
    return "\n".join(lines)


def one_line(info: Inspection) -> str:
    """The INFO line logged at construction."""
    paths, states = _tally(info)
    count = lambda path: sum(len(v) for v in paths[path].values())  # noqa: E731
    fused = sum(b for v in paths["fused"].values() for _, b in v)
    frozen = count("frozen") + sum(1 for *_, f in info.outside if f)
    state_text = ", ".join(f"{fmt} {_bytes(b)}" for fmt, (_, b) in sorted(states.items()) if b)
    return (f"forge: {info.optimizer}: {count('fused')} weights fused "
            f"({_bytes(fused)} of gradients never allocated), "
            f"{count('hook') + count('batched')} element-wise ({count('batched')} small: "
            "applied together in step()), "
            f"{count('deferred')} deferred to step(), {frozen} frozen; states "
            f"{state_text or 'none'}; opt.summary() says which and why")
