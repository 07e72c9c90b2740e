#!/usr/bin/env bash
# setup.sh — everything a fresh Debian machine needs, idempotent:
#   1. Debian packages (compiler, CMake, Ninja, GoogleTest, OpenMP), installed only if missing;
#   2. libforge and the C++ tests, built with CMake into build/ (CUDA backend too when nvcc is found),
#      and again into build-asan/ with AddressSanitizer + UndefinedBehaviorSanitizer (CPU only,
#      with the C ABI fuzz harness) for scripts/test.sh;
#   3. a virtual environment .venv with torch from PyPI and the forge package installed
#      (its console scripts forge-train and forge-bench land in .venv/bin).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ libgtest-dev libomp-dev python3-venv)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# nvcc is not always on PATH even when the toolkit is installed.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${FORGE_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$(nproc)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release -DFORGE_CUDA=OFF -DFORGE_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$(nproc)"

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$python" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
# The package reuses the library just built instead of compiling it again.
FORGE_PREBUILT_LIBRARY="$PWD/build/libforge.so" .venv/bin/python -m pip install -q --no-build-isolation .
echo "setup: done (library build/libforge.so, environment .venv)"
