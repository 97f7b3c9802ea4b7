"""Process lifecycle: how every dflash child process (extract and regenerate workers, DDP ranks, loader
workers) ends with its parent and stops on a signal, and how each one's output reaches a log file.

Contract:
- `die_with_parent()` asks Linux to SIGTERM the calling process when the process that started it exits
  (PR_SET_PDEATHSIG), so workers and DDP ranks never run on as orphans holding GPU memory. No-op elsewhere.
- `StopFlag` turns SIGTERM and SIGINT into a flag a worker reads between batches: it finishes and commits
  the batch in hand, then returns 143, so a stop loses nothing already committed.
- `watch_parent(pid)` starts a daemon thread that hard-exits a process (a DataLoader worker) as soon as its
  parent `pid` is gone. Only for processes that hold nothing worth saving (loader workers only read).
- `Tee(stream, path)` mirrors a stream into a log file; `log_process_output(run_dir, rank)` tees this
  process's stdout and stderr into RUN/logs/rankN.log, so a detached run leaves every process's log.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGTERM): the kernel signals us when the process that started us exits (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class StopFlag:
    """SIGTERM/SIGINT set `stop` instead of killing: the worker stops at its next batch boundary."""

    def __init__(self):
        self.stop = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, _frame):
        self.stop = True


def watch_parent(parent: int) -> None:
    """Exit this process at once when `parent` is no longer its parent (it died: SIGKILL, the OOM killer).
    torch's own loader-worker check compares with getppid() at start-up (already 1 for a worker whose parent
    died while it was importing: such orphans were seen) and runs only between batches."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="dflash-parent-watch", daemon=True).start()


class Tee:
    """Write a stream to a log file too, so every process of a detached run leaves its log in the run dir."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text: str) -> int:
        self._to_file("write", text)
        return self.stream.write(text)

    def flush(self) -> None:
        self._to_file("flush")
        self.stream.flush()

    def _to_file(self, op: str, *args) -> None:
        """The log file is a copy: a write it refuses (a full disk) must not stop the message reaching the
        terminal, nor turn the exit into Python's 120 (a failed flush at shutdown). The file is dropped then."""
        if self.file is None:
            return
        try:
            getattr(self.file, op)(*args)
        except (OSError, ValueError):
            f, self.file = self.file, None
            try:
                f.close()
            except OSError:
                pass

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def log_process_output(run_dir: Path, rank: int) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / "logs" / f"rank{rank}.log"
    sys.stderr = Tee(sys.stderr, path)
    sys.stdout = Tee(sys.stdout, path)
