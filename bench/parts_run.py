"""Runs the steps of one bench/parts.py part: each command with its log under OUT, a time limit that ends its whole
process group, periodic copies of its results into OUT, and the tail of its log printed when it ends. A part's
exit status is the worst of its steps' (1 for a failed step or a time limit), so a smoke run fails loudly."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path

_started: dict[int, subprocess.Popen] = {}  # detached steps started by this process (pid -> process)


def copy_path(src: Path, dst: Path) -> None:
    if Path(src).is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    elif Path(src).exists():
        shutil.copyfile(src, dst)


def _copy(pairs) -> None:
    for src, dst in pairs:
        try:
            copy_path(Path(src), Path(dst))
        except OSError:  # a results file being rewritten: the next round copies it
            pass


def _shown(log: Path, step) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    lines = [x for x in lines if (not step.only or re.search(step.only, x)) and not (step.hide and re.search(step.hide, x))]
    return "\n".join(lines[-step.show:]) if step.show else ""


def _start(step, out: Path) -> tuple[subprocess.Popen, Path]:
    for p in step.clean:
        shutil.rmtree(p, ignore_errors=True)
    log = Path(step.log) if os.path.isabs(step.log) else out / step.log
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        p = subprocess.Popen(step.argv, cwd=step.cwd, env={**os.environ, **step.env}, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    return p, log


def _finish(p: subprocess.Popen, log: Path, step) -> int:
    stop = threading.Event()

    def copier() -> None:
        while not stop.wait(15):
            _copy(step.copy)
    threading.Thread(target=copier, daemon=True).start()
    try:
        rc = p.wait(timeout=step.timeout or None)
    except subprocess.TimeoutExpired:  # SIGINT first: pytest (and a bench's finally) still reports what it has
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        rc = 124
        print(f"{' '.join(step.argv[:3])}: stopped at its limit of {step.timeout:.0f} s")
    stop.set()
    _copy(step.copy)
    text = _shown(log, step)
    if text:
        print(text, flush=True)
    if rc:
        print(f"FAILED (exit {rc}): {' '.join(step.argv)}; log {log}", flush=True)
    return 0 if rc == 0 else 1


def _sigint_reaches_steps() -> None:
    """A runner started with SIGINT ignored (a background job of a non-interactive shell: `cmd &`) hands that on to
    every step, and Python then installs no KeyboardInterrupt handler: the SIGINT a step gets at its limit would
    do nothing, and pytest would not print its summary (a background `.ci/run` failed so, 2026-12-06). Python's
    handler is put back here; a step then starts with the default action."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_steps(steps: list, out: Path) -> int:
    _sigint_reaches_steps()
    rc = 0
    for step in steps:
        if callable(step):
            try:
                step()
            except Exception:  # a summary that fails fails the part, with its traceback
                traceback.print_exc()
                rc = 1
        elif isinstance(step, list):  # side by side
            started = [(s, *_start(s, out)) for s in step]
            rc = max([rc, *(_finish(p, log, s) for s, p, log in started)])
        elif step.detach:
            p, log = _start(step, out)
            _started[p.pid] = p
            Path(f"{log}.pid").write_text(str(p.pid))
            print(f"{' '.join(step.argv[:4])} started in the background (pid {p.pid}, log {log})")
        else:
            rc = max(rc, _finish(*_start(step, out), step))
    return rc


def run_part(name: str, steps: list, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    return run_steps(steps, out)


def wait_detached(log: Path, limit_s: float) -> bool:
    """Wait for the step detached with this log (its pid file) to end, at most limit_s; True when it ended."""
    pid_file = Path(f"{log}.pid")
    if not pid_file.exists():
        print(f"nothing was started with log {log}")
        return True
    pid, end = int(pid_file.read_text()), time.monotonic() + limit_s
    while time.monotonic() < end:
        if pid in _started:
            if _started[pid].poll() is not None:
                return True
        else:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(2)
    print(f"pid {pid} still runs after {limit_s:.0f} s; copying what it finished")
    return False
