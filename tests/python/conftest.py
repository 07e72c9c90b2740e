"""conftest.py — shared fixtures of the Python suite.

- Runs from a source checkout without installing: if `forge` is not importable, python/
  is put on sys.path (libforge is then found through FORGE_LIBRARY or build*/).
- DEVICES: "cpu" always; "cuda" only where torch sees a GPU and libforge has its CUDA
  backend (skipped otherwise, so the CPU CI runs the same files). format_devices: the
  same for (state format, device) pairs.
- Measured weight differences are collected and printed at the end of the run.
- OMP_WAIT_POLICY=PASSIVE (unless set): torch and libforge share torch's OpenMP runtime,
  whose threads spin after every parallel region; on a 2-core CI machine with anything
  else running, spinning threads starve each other (a contract test took 22 s instead of
  4 s). Set before torch is imported, which is when the runtime reads it.
"""
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# cuBLAS needs this for torch.use_deterministic_algorithms (bit-exact resume on CUDA).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import forge  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import forge  # noqa: F401


def cuda_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return forge.has_cuda()
    except Exception:
        return False


_CUDA_REASON = "needs a CUDA GPU and libforge built with CUDA"
requires_cuda = pytest.mark.skipif(not cuda_usable(), reason=_CUDA_REASON)
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def format_devices(formats):
    """(state_format, device) parameters: every format on every device of DEVICES."""
    out = []
    for fmt in formats:
        out.append((fmt, "cpu"))
        out.append(pytest.param(fmt, "cuda", marks=requires_cuda))
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (given by requires_cuda)")


def pytest_collection_modifyitems(items):
    # scripts/gpu_python.sh selects the GPU tests with `-k cuda`: every test that carries
    # requires_cuda gets the `cuda` keyword, so one whose name lacks "cuda" is not left out.
    for item in items:
        if any(m.kwargs.get("reason") == _CUDA_REASON for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)

# (test id, what, value) rows filled by the tests through record_difference
_MEASURED = []


@pytest.fixture
def record_difference(request):
    def record(what: str, value: float):
        _MEASURED.append((request.node.name, what, value))
    return record


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def deterministic():
    """torch's own kernels deterministic (CUDA embedding backward uses atomics otherwise)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def pytest_terminal_summary(terminalreporter):
    if not _MEASURED:
        return
    terminalreporter.section("forge: measured differences (metrics: tolerances.py)")
    for test, what, value in _MEASURED:
        terminalreporter.write_line(f"{value:10.2e}  {what:<34} {test}")
