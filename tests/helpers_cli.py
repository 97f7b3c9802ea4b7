"""Run the `dflash` command line in a subprocess for tests, without a GPU; fail with its output on a bad exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
# the session's shared tiny store (tests/conftest.py: tiny_store): 2 shards of the tiny target, 240 samples
TINY_STORE_OPTS = ["--set", "data.max_samples=240", "--set", "extract.token_budget=4096"]
# For runs whose test proves bookkeeping (resume, signals, following, checkpoints, refusals), not learning: 8 anchor
# blocks a sample instead of tiny.yaml's 32 (the drafter's work a step is 4x smaller; the steps, samples, batches
# and every file the run writes are the same). A 1-rank run of 28 steps: 23.5 s -> 13.4 s on the 2-core machine.
FEW_ANCHORS = ("--set", "train.num_anchors=8")
# How long a test waits on a subprocess (or for a state it polls) before calling it hung. Only a guard against
# a hang, never a speed requirement: every test bounds its work by sample, step and epoch counts, and a busy
# shared 2-core machine took the tiny quality test past an earlier 600 s limit, failing a correct run.
HANG_S = 3600


def dflash(*args, timeout=HANG_S, check=True, cwd=ROOT, gpus=False) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess; GPUs hidden unless gpus=True (the GPU-marked tests)."""
    env = dict(os.environ) if gpus else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "stages.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"dflash {' '.join(args)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r
