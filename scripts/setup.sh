#!/usr/bin/env bash
# Set up a fresh machine for dflash: a virtualenv in .venv with torch and the project (pip install -e ".[dev]").
#
# Which torch, and why (it prints the choice and its reason):
#   1. a torch already importable in .venv (e.g. your CUDA build on a GPU node: install it first, any
#      2.6 <= torch < 2.15) is kept as it is: replacing a CUDA torch with the CPU one would lose the GPU;
#   2. otherwise the CPU build torch==$DFLASH_TORCH+cpu (default 2.13.0): a plain `pip install torch` on Linux
#      pulls a multi-GB CUDA build, and the demo and the tests need only the CPU. It comes from a wheel pip can
#      already see without any index (a find-links directory, as on CI), else from $DFLASH_TORCH_INDEX.
# Variables: PYTHON (the interpreter that makes .venv, default python3), DFLASH_TORCH (version, default 2.13.0),
#   DFLASH_TORCH_INDEX (the index of the CPU build, default https://download.pytorch.org/whl/cpu; set it empty
#   to use pip's own configured index, or to your mirror).
# `./scripts/setup.sh --dry-run` prints the torch decision and the commands, and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${DFLASH_TORCH:-2.13.0}
TORCH_INDEX=${DFLASH_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

run() { if [ "$DRY" = 1 ]; then echo "would run: $*"; else "$@"; fi; }

if [ "$DRY" = 1 ] && [ ! -x .venv/bin/python ]; then
  VPY=$PY  # nothing is made in a dry run: the interpreter that would make .venv stands in for it
  echo "would run: $PY -m venv .venv"
  echo "would run: .venv/bin/python -m pip install -q --upgrade pip"
else
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  VPY=.venv/bin/python
  run "$VPY" -m pip install -q --upgrade pip
fi

HAVE=$("$VPY" -c "import torch; print(torch.__version__, torch.version.cuda or 'none')" 2>/dev/null || true)
if [ -n "$HAVE" ]; then
  read -r tv cuda <<<"$HAVE"
  if [ "$cuda" != none ]; then
    echo "setup: torch $tv (CUDA $cuda) is installed: kept, it is the build this GPU machine needs"
  else
    echo "setup: torch $tv (CPU build) is installed: kept (for a GPU, install your CUDA torch into .venv first)"
  fi
else
  WANT="torch==$TORCH_VERSION+cpu"
  if [ "$(uname -s)" = Darwin ]; then
    echo "setup: no torch yet: installing torch==$TORCH_VERSION (macOS builds have no CUDA)"
    run "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  elif "$VPY" -m pip install -q --dry-run --no-deps --no-index "$WANT" >/dev/null 2>&1; then
    echo "setup: no torch yet: installing the CPU build $WANT from a wheel pip finds locally (no CUDA download)"
    run "$VPY" -m pip install -q "$WANT"
  elif [ -n "$TORCH_INDEX" ]; then
    echo "setup: no torch yet: installing the CPU build $WANT from $TORCH_INDEX (DFLASH_TORCH_INDEX; a plain"
    echo "       pip install torch would pull the multi-GB CUDA build)"
    run "$VPY" -m pip install -q --index-url "$TORCH_INDEX" "$WANT"
  else
    echo "setup: no torch yet: installing torch==$TORCH_VERSION from pip's configured index (DFLASH_TORCH_INDEX is empty)"
    run "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  fi
fi
run "$VPY" -m pip install -q -e ".[dev]"
if [ "$DRY" = 1 ]; then
  echo "setup: dry run, nothing was changed"
else
  echo "dflash installed in $(pwd)/.venv: run .venv/bin/dflash (or activate with: . .venv/bin/activate)"
fi
