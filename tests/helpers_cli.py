"""Run the `dflash` command line in a subprocess for tests, without a GPU; fail with its output on a bad exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def dflash(*args, timeout=600, check=True, cwd=ROOT, gpus=False) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess; GPUs hidden unless gpus=True (the GPU-marked tests)."""
    env = dict(os.environ) if gpus else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"dflash {' '.join(args)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r
