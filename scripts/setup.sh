#!/usr/bin/env bash
# setup.sh — everything a fresh Debian machine needs, idempotent:
#   1. Debian packages (compiler, CMake, Ninja, GoogleTest, OpenMP), installed only if missing;
#   2. libforge and the C++ tests, built with CMake into build/ (CUDA backend: see below);
#   3. a virtual environment .venv with torch from PyPI and the forge package installed
#      (its console scripts forge-train and forge-bench land in .venv/bin).
# Each step that can take long first says what it does and roughly how long, then shows its
# progress (apt's and pip's lines, Ninja's [n/N]).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ libgtest-dev libomp-dev python3-venv)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]} (apt-get; up to ~150 MB, a minute or two)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q "${missing[@]}"
fi

# nvcc is not always on PATH even when the toolkit is installed.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# The CUDA backend: nvcc needs minutes for it even on a big machine, and it is of no use
# without a GPU. Built when `nvidia-smi -L` lists a GPU (and nvcc is there) or FORGE_CUDA=ON
# asks for it; FORGE_CUDA=OFF never builds it.
case "${FORGE_CUDA:-AUTO}" in
  ON | on) cuda=ON why="FORGE_CUDA=ON" ;;
  OFF | off) cuda=OFF why="FORGE_CUDA=OFF" ;;
  AUTO | auto)
    gpus=$(nvidia-smi -L 2>/dev/null || true)
    if ! grep -q '^GPU' <<<"$gpus"; then
      cuda=OFF why="no GPU found by nvidia-smi -L; FORGE_CUDA=ON builds it anyway"
    elif ! command -v nvcc >/dev/null; then
      cuda=OFF why="a GPU but no nvcc: install the CUDA toolkit and run this again"
    else
      cuda=ON why="nvidia-smi -L found a GPU"
    fi ;;
  *) echo "setup: error: FORGE_CUDA=$FORGE_CUDA: use ON or OFF (unset: ON where a GPU is found)" >&2
     exit 2 ;;
esac
if [ "$cuda" = ON ]; then
  echo "setup: building libforge with its CUDA backend ($why) into build/ (nvcc: several minutes)"
else
  echo "setup: building libforge for the CPU only ($why) into build/ (under a minute)"
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFORGE_CUDA="$cuda" ${FORGE_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$(nproc)"

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the virtual environment .venv ($python -m venv; seconds)"
  "$python" -m venv .venv
fi
echo "setup: pip: upgrading pip (a few MB)"
.venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
echo "setup: pip: installing requirements-dev.txt: torch from PyPI with its CUDA libraries" \
  "(~3 GB to download, ~6 GB installed: minutes on a first run), numpy, matplotlib," \
  "transformers, pytest"
# NOTE: --no-cache-dir: pip's cache would keep a second copy of every wheel downloaded (~3 GB)
# on the same disk while they are installed; a re-run finds the installed packages anyway.
bash scripts/disk_check.sh 10 "setup: pip"
.venv/bin/python -m pip install --no-cache-dir -r requirements-dev.txt
# The package reuses the library just built instead of compiling it again.
echo "setup: pip: installing the forge package (seconds: it reuses build/libforge.so)"
FORGE_PREBUILT_LIBRARY="$PWD/build/libforge.so" .venv/bin/python -m pip install -q --no-build-isolation .
echo "setup: done (library build/libforge.so, environment .venv)"
