"""forge — training without weight gradients: the PyTorch layer over libforge.

    import forge
    opt = forge.optim.AdamW(model, lr=3e-4, weight_decay=0.1, state_format="int8")

The library: forge.optim (the optimizers; optim/routing.py says how the update moves into
backward), forge.lean (memory-lean activations), forge.graphs (whole training steps as CUDA
graphs). The programs built on it live in forge.tools (forge-train, forge-bench), which the
library never imports. forge.optim is imported on first use and loads libforge then
(through ctypes; _lib.py says where it is looked for), so `import forge` alone works without
the library (forge.tools' models and data, forge-train --baseline torch), while
`import forge.optim` fails early with a clear ImportError when libforge cannot be found.
"""
import importlib

from ._lib import ForgeError, LibraryNotFound

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("optim", "lean", "graphs", "muon"):  # only forge.optim needs libforge
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'forge' has no attribute {name!r}")


def library():
    """The loaded libforge (path, version, capabilities); loads it if needed."""
    from . import _lib
    return _lib.get()


def has_cuda() -> bool:
    """Whether the loaded libforge has its CUDA backend compiled in."""
    return library().has_cuda


__all__ = ["optim", "lean", "graphs", "muon", "ForgeError", "LibraryNotFound", "library", "has_cuda",
           "__version__"]
