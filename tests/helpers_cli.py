"""Run the `dflash` command line in a subprocess for tests, without a GPU; fail with its output on a bad exit
(`dflash`), several refusing commands in one subprocess (`dflash_each`) or independent ones side by side
(`dflash_all`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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


# The child of dflash_each: each command through the CLI's own entry point (stages.cli.main, as `python -m
# stages.cli` runs it), its stdout and stderr caught at the file descriptors, its exit code from SystemExit; an
# exception that escapes the CLI prints its traceback into that command's stderr and exits 1, as a process would.
_EACH = r"""
import json, os, sys, tempfile, traceback
from stages.cli import main
results = []
for args in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            try:
                main(args, prog_name="dflash")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        results.append([code, out.read().decode(errors="replace"), err.read().decode(errors="replace")])
print("DFLASH_EACH " + json.dumps(results))
"""


def dflash_each(*commands: list, timeout=HANG_S) -> list[subprocess.CompletedProcess]:
    """Several `dflash` commands that refuse before any work, in one subprocess (issue 44: a subprocess's start-up,
    torch and Lightning imported, cost more than each refusal): one CompletedProcess per command, in order, with
    its exit code, stdout and stderr, as helpers_cli.dflash(..., check=False) returns. GPUs hidden, as there."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", _EACH, json.dumps([[str(a) for a in c] for c in commands])], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and last.startswith("DFLASH_EACH "), (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return [subprocess.CompletedProcess(list(c), code, out, err)
            for c, (code, out, err) in zip(commands, json.loads(last[len("DFLASH_EACH "):]))]


def dflash_all(*commands: list, check=True, timeout=HANG_S) -> list[subprocess.CompletedProcess]:
    """Independent `dflash` commands (none reads what another writes) run side by side, one process each, as
    helpers_cli.dflash runs one: their start-ups overlap on the 2 cores. One CompletedProcess per command, in
    order; with check, a command that exits non-zero fails the test with its output. GPUs hidden."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory() as d:
        procs = []
        for i, c in enumerate(commands):
            with open(f"{d}/{i}.out", "w") as out, open(f"{d}/{i}.err", "w") as err:
                procs.append(subprocess.Popen([sys.executable, "-m", "stages.cli", *map(str, c)], cwd=ROOT, env=env,
                                              stdout=out, stderr=err, text=True))
        codes = [p.wait(timeout=timeout) for p in procs]  # a hang guard only
        done = [subprocess.CompletedProcess(list(c), rc, open(f"{d}/{i}.out").read(), open(f"{d}/{i}.err").read())
                for i, (c, rc) in enumerate(zip(commands, codes))]
    for r in done:
        if check and r.returncode != 0:
            raise AssertionError(f"dflash {' '.join(map(str, r.args))} exited {r.returncode}\n{r.stdout[-3000:]}\n"
                                 f"{r.stderr[-3000:]}")
    return done
