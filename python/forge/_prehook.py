"""_prehook.py — the C++ part of fused Linears (csrc/prehook.cpp), built against the torch in
use: the fused weights' AccumulateGrad pre-hook, an nn.Linear forward with a C++ backward, and
the kernel of a compiled backward's hand-off (forge/_ops.py).

A fused weight's update runs at its AccumulateGrad node; entering Python there and in the
Linear's backward is the largest part of FORGE's host time per Linear on small models
(docs/design.md §5.3). Where a C++ compiler and ninja are present, forge.optim builds this
extension once (torch's cpp_extension: cached under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions, per torch and Python version), hooks the nodes with it and routes
the common Linear forward through it; elsewhere the Python pre-hook and Function run, with the
same calls and bits. FORGE_CPP_PREHOOK=0 never builds it; =1 makes a failed build an error.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from typing import Any, Optional

_ENV = "FORGE_CPP_PREHOOK"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "prehook.cpp")

_lock = threading.Lock()
_module: Any = None
_tried = False
failure: Optional[str] = None  # why the extension is not in use (None: in use, or not tried)


def get() -> Any:
    """The built extension module, or None (switched off, no compiler, the build failed)."""
    global _module, _tried, failure
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        setting = os.environ.get(_ENV, "auto").strip().lower()
        if setting in ("0", "off", "false", "no"):
            failure = f"{_ENV}={os.environ[_ENV]}"
        else:
            try:
                _module = _build()
            except Exception as e:  # no compiler or ninja, a build error: the Python pre-hook
                failure = f"{type(e).__name__}: {e}"
                if setting in ("1", "on", "true", "yes"):
                    _tried = True
                    raise RuntimeError(f"forge: {_ENV}={os.environ[_ENV]} but the C++ pre-hook "
                                       f"could not be built: {failure}") from e
                warnings.warn("forge: the C++ pre-hook could not be built, the Python one runs "
                              f"(same results, more host time per Linear): {failure}",
                              stacklevel=3)
        _tried = True
    return _module


def _build():
    import torch
    from torch.utils import cpp_extension
    # (named by torch's version and the source's hash: each FORGE checkout on a machine keeps
    # its own build, and two in one process, bench/host_overhead.py --baseline, load both)
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:10]
    name = f"forge_prehook_{torch.__version__.split('+')[0].replace('.', '_')}_{digest}"
    try:  # (a private helper of torch's: only the message below depends on it)
        directory = cpp_extension._get_build_directory(name, verbose=False)
        built = os.path.exists(os.path.join(directory, name + ".so"))
    except Exception:
        directory, built = "torch's extension cache", False
    if not built:
        print(f"forge: building the C++ part of fused Linears against torch "
              f"{torch.__version__} (once, cached in {directory})", file=sys.stderr, flush=True)
    module = cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=["-O2"],
                                verbose=False)
    from . import _lib

    def fields(struct_type, names):  # (offset, size) of each, in order
        return [(getattr(struct_type, n).offset, getattr(struct_type, n).size) for n in names]
    module.set_operand_layout(fields(_lib.WgradArgs, _lib.WGRAD_OPERAND_FIELDS))
    module.set_grad_layout(fields(_lib.ElementwiseArgs, ("grad", "grad_dtype")))
    module.set_dtype_codes(_lib.DTYPE_FP32, _lib.DTYPE_BF16, _lib.DTYPE_FP16)
    call_fields = ("device", "param", "hparams", "outputs")  # (StepRecheck writes them)
    module.set_call_layout(fields(_lib.WgradArgs, call_fields),
                           fields(_lib.ElementwiseArgs, call_fields),
                           fields(_lib.Hparams, ("step", "seed", "grad_scale")))
    return module
