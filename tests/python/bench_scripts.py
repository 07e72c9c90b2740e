"""bench_scripts.py — the tests' way to import a script of bench/ (not a package) as a module."""
import importlib.util
import os

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def load(name: str):
    """bench/<name>.py, imported as the module forge_bench_<name>."""
    spec = importlib.util.spec_from_file_location(f"forge_bench_{name}",
                                                  os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
