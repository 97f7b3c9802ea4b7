#!/usr/bin/env bash
# Set up a fresh machine for dflash: a virtualenv in .venv with the CPU build of torch and the project.
# On a GPU node, install your CUDA torch first (or reuse an environment that has one) and skip the pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # torch first and pinned: an unpinned torch (or one pulled in by another package) is a multi-GB CUDA build.
  python -m pip install -q "torch==${DFLASH_TORCH:-2.13.0}"
fi
python -m pip install -q -e ".[dev]"
echo "dflash installed in $(pwd)/.venv (activate with: . .venv/bin/activate)"
