"""setup.py — the one build step pyproject.toml cannot declare: compile libforge with CMake
and put it inside the package (forge/lib/libforge.so), where forge._lib finds it.

    pip install .                                   # builds libforge (CUDA too if nvcc is found)
    FORGE_CMAKE_ARGS="-DFORGE_CUDA=OFF" pip install .   # extra CMake arguments
    FORGE_PREBUILT_LIBRARY=build/libforge.so pip install --no-build-isolation .
                                                    # ship an already built library instead

CMake ≥ 3.25 is taken from the system when it has one; otherwise the `cmake` package from
PyPI is a build requirement (setuptools' build backend reads setup_requires for that).
Ninja is used when found. The wheel is platform-specific (it carries a shared library)
but not tied to a torch version: nothing in libforge includes torch headers.
"""
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
LIBRARY_NAMES = ("libforge.so", "libforge.dylib", "forge.dll")
MIN_CMAKE = (3, 25)


def system_cmake_ok() -> bool:
    exe = shutil.which("cmake")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    match = re.search(r"(\d+)\.(\d+)", out)
    return bool(match) and (int(match[1]), int(match[2])) >= MIN_CMAKE


def build_requirements():
    """Asked for only when the build needs them (no prebuilt library, no usable system tool)."""
    if os.environ.get("FORGE_PREBUILT_LIBRARY"):
        return []
    needs = [] if system_cmake_ok() else [f"cmake>={MIN_CMAKE[0]}.{MIN_CMAKE[1]}"]
    if shutil.which("ninja") is None and needs:
        needs.append("ninja")
    return needs


class BuildPyWithLibforge(build_py):
    """build_py, then libforge into <build_lib>/forge/lib (and python/forge/lib for an
    editable install, where the package is imported from the source tree)."""

    def run(self):
        super().run()
        library = self.libforge()
        targets = [Path(self.build_lib) / "forge" / "lib"]
        if getattr(self, "editable_mode", False):
            targets.append(ROOT / "python" / "forge" / "lib")
        for target in targets:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(library, target / library.name)

    def libforge(self) -> Path:
        prebuilt = os.environ.get("FORGE_PREBUILT_LIBRARY")
        if prebuilt:
            path = Path(prebuilt)
            if not path.is_file():
                raise RuntimeError(f"FORGE_PREBUILT_LIBRARY={prebuilt}: no such file")
            return path
        build_dir = Path(self.get_finalized_command("build").build_temp).resolve() / "libforge"
        extra = shlex.split(os.environ.get("FORGE_CMAKE_ARGS", ""))
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir),
                     "-DCMAKE_BUILD_TYPE=Release", "-DFORGE_BUILD_TESTS=OFF",
                     "-DFORGE_BUILD_BENCH=OFF"]
        fresh = not (build_dir / "CMakeCache.txt").exists()
        if fresh and shutil.which("ninja") and not any(a.startswith("-G") for a in extra):
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure + extra)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "forge",
                               "--parallel", str(os.cpu_count() or 1)])
        for name in LIBRARY_NAMES:
            for candidate in (build_dir / name, build_dir / "lib" / name):
                if candidate.is_file():
                    return candidate
        raise RuntimeError(f"CMake finished but no libforge was found in {build_dir}")


class BinaryDistribution(Distribution):
    """The wheel carries a shared library: tag it for this platform, not 'any'."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibforge}, distclass=BinaryDistribution,
      setup_requires=build_requirements())
