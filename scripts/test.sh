#!/usr/bin/env bash
# test.sh — the whole test suite on this machine: the C++ CPU suite (ctest, label
# "cpu") and the Python suite (pytest). GPU tests run only on a GPU machine
# (scripts/gpu_check.sh). Run scripts/setup.sh first (.ci/run does both).
set -euo pipefail
cd "$(dirname "$0")/.."
ctest --test-dir build -L cpu --output-on-failure -j "$(nproc)"
.venv/bin/python -m pytest tests/python -q
