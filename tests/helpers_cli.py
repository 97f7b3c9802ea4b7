"""Run the `dflash` command line in a subprocess for tests, without a GPU; fail with its output on a bad exit
(`dflash`), several refusing commands in one subprocess (`dflash_each`) or independent ones side by side
(`dflash_all`); any command in the background (`start`, `must_pass`; `selected` for a fixture that starts the
commands of several tests ahead) or several side by side (`side_by_side`)."""

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


class Started:
    """A process started in the background (`start`), its stdout and stderr going to files in a temporary
    directory; `result()` waits for it (a hang guard only) and gives what subprocess.run(..., capture_output=True,
    text=True) would have (the same object on every call)."""

    def __init__(self, argv: list, env: dict | None = None, cwd=ROOT):
        self.argv, self._dir, self._done = [str(a) for a in argv], tempfile.TemporaryDirectory(), None
        self._out, self._err = Path(self._dir.name) / "out", Path(self._dir.name) / "err"
        with open(self._out, "w") as out, open(self._err, "w") as err:  # the child keeps its own descriptors
            self.proc = subprocess.Popen(self.argv, cwd=cwd, env=env, stdout=out, stderr=err, text=True)

    def result(self, timeout=HANG_S) -> subprocess.CompletedProcess:
        if self._done is None:
            rc = self.proc.wait(timeout=timeout)
            self._done = subprocess.CompletedProcess(self.argv, rc, self._out.read_text(errors="replace"),
                                                     self._err.read_text(errors="replace"))
            self._dir.cleanup()
        return self._done


def start(argv: list, env: dict | None = None, cwd=ROOT) -> Started:
    """Start a command (argv, env) in the background; GPUs hidden unless env says otherwise (the caller's env
    is used as given; None: this process's environment with CUDA_VISIBLE_DEVICES="")."""
    return Started(argv, {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if env is None else env, cwd)


def side_by_side(*runs: tuple, timeout=HANG_S) -> list[subprocess.CompletedProcess]:
    """Independent commands, (argv, env) each (env None: GPUs hidden, as `start`), all started at once, their
    start-ups overlapping on the 2 cores (a process that mostly imports leaves a core idle); one CompletedProcess
    each, in order, as subprocess.run(..., capture_output=True, text=True) gives."""
    started = [start(argv, env) for argv, env in runs]
    return [s.result(timeout) for s in started]


def one_worker_per_file(config) -> bool:
    """Whether every test of a file runs in this process: no pytest-xdist, or its `--dist loadfile` (which
    tests/conftest.py sets whenever the suite runs with -n)."""
    from helpers_share import under_xdist

    return not under_xdist() or config.getoption("dist", "no") == "loadfile"


def selected(request, *names: str) -> list:
    """The items this session will run of the requesting module's test functions `names` (one per parametrization),
    for a module fixture that starts their slow commands together, ahead (an item's callspec gives its params).
    None where another pytest-xdist worker may run the others (each test then starts its own when it asks)."""
    if not one_worker_per_file(request.config):
        return []
    return [i for i in request.session.items if i.path == request.path and getattr(i, "originalname", None) in names]


class Lazy(dict):
    """A dict that makes a missing key's value with `make(key)`: a module fixture's futures of its tests' runs,
    the selected ones made ahead (`selected`), any other when its test asks (a case not started with the others)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


def must_pass(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fail the test with the command's output unless it exited 0."""
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, r.args))} exited {r.returncode}\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-3000:]}")
    return r


def dflash_all(*commands: list, check=True, timeout=HANG_S) -> list[subprocess.CompletedProcess]:
    """Independent `dflash` commands (none reads what another writes) run side by side (`side_by_side`), one
    process each, as helpers_cli.dflash runs one. One CompletedProcess per command, in order, its args the
    command's own; with check, a command that exits non-zero fails the test with its output. GPUs hidden."""
    done = side_by_side(*[([sys.executable, "-m", "stages.cli", *map(str, c)], None) for c in commands],
                        timeout=timeout)
    done = [subprocess.CompletedProcess(list(c), r.returncode, r.stdout, r.stderr) for c, r in zip(commands, done)]
    for r in done:
        if check and r.returncode != 0:
            raise AssertionError(f"dflash {' '.join(map(str, r.args))} exited {r.returncode}\n{r.stdout[-3000:]}\n"
                                 f"{r.stderr[-3000:]}")
    return done
