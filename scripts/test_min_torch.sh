#!/usr/bin/env bash
# test_min_torch.sh — the Python suite against the oldest torch FORGE supports (2.4), so that
# "torch >= 2.4" stays true: its own virtual environment .venv-torch2.4 (torch 2.4.1 from PyPI,
# about 2.5 GB the first time, a minute or two), the library setup.sh built in build/. Tests
# that need something this environment leaves out (transformers, a newer torch) skip with
# their reason; the main suite (scripts/test.sh) runs them. .ci/run calls this after test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-torch2.4
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  echo "test_min_torch: creating $venv ($python -m venv; seconds)"
  "$python" -m venv "$venv"
fi
echo "test_min_torch: pip: torch 2.4.1, numpy, pytest (about 2.5 GB the first time)"
bash scripts/disk_check.sh 8 "test_min_torch: pip"
"$venv/bin/python" -m pip install -q --no-cache-dir "torch==2.4.1" numpy pytest
FORGE_LIBRARY="$PWD/build/libforge.so" PYTHONPATH="$PWD/python" \
  "$venv/bin/python" -m pytest tests/python -q -p no:cacheprovider
