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
- `Supervisor`: the one supervisor of child processes (extract's and regenerate's shard workers, `dflash run`'s
  two commands): spawn each with its log, watch them, the first failure stops the others (or what the caller
  says), a stop signal is passed on (a second one kills), and one `Outcome` names the exit code (`ExitCode`).
- What the supervisors' messages share: `tail` (a failed child's last log lines), `failure_reason`, `fmt_rate`
  and `fmt_eta` (progress lines), and `place_shards` (which GPU each shard worker gets).
"""

from __future__ import annotations

import ctypes
import enum
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Hashable, Optional

from pipeline.errors import UserError


class ExitCode(enum.IntEnum):
    """The exit codes of dflash's commands and of the children they supervise."""

    OK = 0
    FAILED = 1  # the stage or one of its children failed; the message names which and how to resume
    USAGE = 2  # an error the user can fix (`UserError`): one line, exit before any work
    STOPPED = 130  # 128 + SIGINT: stopped by Ctrl-C or SIGTERM; what was committed is kept, the same command resumes
    WORKER_STOPPED = 143  # 128 + SIGTERM: a worker that stopped at a batch boundary when asked (`StopFlag`)


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
    """Exit this process at once when process `parent` has ended (SIGKILL, the OOM killer): the process that
    started it, directly (spawn) or through a forkserver (data/loader_workers.py), which is then not getppid().
    torch's own loader-worker check compares with getppid() at start-up (already 1 for a worker whose parent
    died while it was importing: such orphans were seen; the forkserver's pid under a forkserver, which lives
    as long as its workers do) and runs only between batches."""

    def watch() -> None:
        while not process_gone(parent):
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="dflash-parent-watch", daemon=True).start()


def process_gone(pid: int) -> bool:
    """Has process `pid` ended? A child of ours is alive while it is our parent; any other pid by /proc (a
    zombie has ended), or by signal 0 where there is no /proc."""
    if os.getppid() == pid:
        return False
    if os.path.isdir("/proc/self"):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


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


# ----------------------------------------------------------------------------------------------------------
# supervising child processes
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How a supervised set of children ended: every child's exit code, the one that failed (None: none did),
    and how many stop signals (Ctrl-C, SIGTERM) this process received while it watched."""

    codes: dict
    failed: Optional[Hashable] = None
    stops: int = 0

    @property
    def exit_code(self) -> ExitCode:
        """FAILED when a child failed; else STOPPED when a stop was asked or a child ended non-zero; else OK."""
        if self.failed is not None:
            return ExitCode.FAILED
        return ExitCode.STOPPED if self.stops or any(self.codes.values()) else ExitCode.OK


@dataclass
class _Child:
    proc: subprocess.Popen
    own_group: bool
    reader: Optional[threading.Thread] = None


@dataclass
class Supervisor:
    """Start child processes, watch them until every one has exited, stop them together.

    - `spawn(name, cmd, log=...)` starts a child. Its stderr (and its stdout, unless `on_line` reads that) is
      appended to `log` after a `=== TIME COMMAND` line; `on_line(line)` gets each stdout line on a thread (the
      workers' JSON progress). `own_group=True` starts it in a process group of its own (a terminal's Ctrl-C
      then reaches only this process, which passes it on), with SIGINT at its default (an ignored SIGINT is
      inherited across exec) and `die_with_parent`.
    - `watch(tick)` waits for every child, calling `tick()` every `poll_s` seconds. While it watches, SIGINT and
      SIGTERM are this supervisor's: `signals="terminate"` sends the first stop SIGTERM to every child (a
      worker finishes its batch and exits 143) and any later one SIGKILL; `signals="forward"` passes each
      signal on to every child's process group as a terminal would (SIGINT stays SIGINT: a second Ctrl-C
      reaches the children, whose own rule forces them). `on_stop(n, signum)` runs first, n = 1, 2, ...
    - The first child to end with a code outside `quiet` while no stop was asked has failed: `on_failure(name,
      code)` runs once (default: `stop_all(exclude=name)`: SIGTERM to the others, SIGKILL after `grace` s).
    - `watch` returns the `Outcome`. A child that ended non-zero without a stop also failed (the first such),
      and after a stop, one that ended with a code outside `stop_codes` (None: any code is a stop's).
    - `stop_all()` (idempotent): what a caller's `finally` runs, so that no child outlives its parent's work.
    """

    signals: str = "terminate"  # or "forward"
    quiet: tuple = (0,)
    stop_codes: Optional[tuple] = None
    on_failure: Optional[Callable[[Hashable, int], None]] = None
    on_stop: Optional[Callable[[int, int], None]] = None
    grace: float = 15.0
    poll_s: float = 0.2
    children: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.signals not in ("terminate", "forward"):
            raise ValueError(f"signals={self.signals!r}: 'terminate' or 'forward'")

    def spawn(self, name: Hashable, cmd: list[str], *, log: Path, env: Optional[dict] = None,
              on_line: Optional[Callable[[str], None]] = None, own_group: bool = False) -> subprocess.Popen:
        with open(log, "ab") as f:  # the child holds its own copy of the descriptor
            f.write(f"\n=== {datetime.now().isoformat()} {shlex.join(cmd)}\n".encode())
            f.flush()
            out = subprocess.PIPE if on_line is not None else f
            err = f if on_line is not None else subprocess.STDOUT
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=on_line is not None,
                                    bufsize=1 if on_line is not None else -1, start_new_session=own_group,
                                    preexec_fn=_own_group_setup if own_group else None)
        child = self.children[name] = _Child(proc, own_group)
        if on_line is not None:
            child.reader = threading.Thread(target=lambda: [on_line(line) for line in proc.stdout], daemon=True,
                                            name=f"dflash-child-{name}")
            child.reader.start()
        return proc

    def alive(self) -> list:
        return [n for n, c in self.children.items() if c.proc.poll() is None]

    def send(self, name: Hashable, sig: int) -> None:
        """`sig` to a child still running (to its process group when it has its own)."""
        c = self.children[name]
        if c.proc.poll() is not None:
            return
        try:
            os.killpg(c.proc.pid, sig) if c.own_group else c.proc.send_signal(sig)
        except ProcessLookupError:  # it exited just now
            pass

    def stop_all(self, exclude: Optional[Hashable] = None) -> None:
        """SIGTERM to every running child but `exclude`, wait up to `grace` s for all, SIGKILL what is left (and
        wait for it to go)."""
        for name in self.alive():
            if name != exclude:
                self.send(name, signal.SIGTERM)
        deadline = time.time() + self.grace
        for name, c in self.children.items():
            while c.proc.poll() is None and time.time() < deadline:
                time.sleep(0.1)
            if c.proc.poll() is None:
                self.send(name, signal.SIGKILL)
                try:
                    c.proc.wait(timeout=5)  # gone before the caller releases what it held for it (a shard lock)
                except subprocess.TimeoutExpired:
                    pass

    def watch(self, tick: Optional[Callable[[], None]] = None) -> Outcome:
        stops = [0]

        def on_signal(signum, _frame):
            stops[0] += 1
            if self.on_stop is not None:
                self.on_stop(stops[0], signum)
            if self.signals == "forward":
                sig = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
            else:
                sig = signal.SIGTERM if stops[0] == 1 else signal.SIGKILL
            for name in self.alive():
                self.send(name, sig)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        failed = None
        try:
            while self.alive():
                for name, c in self.children.items():
                    rc = c.proc.poll()
                    if rc is not None and rc not in self.quiet and failed is None and not stops[0]:
                        failed = name  # the first failure; the others are stopped (or what on_failure does)
                        (self.on_failure or (lambda n, _rc: self.stop_all(exclude=n)))(name, rc)
                if tick is not None:
                    tick()
                time.sleep(self.poll_s)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        for c in self.children.values():  # the last progress lines, before the caller's final count
            if c.reader is not None:
                c.reader.join(timeout=5)
        codes = {n: c.proc.returncode for n, c in self.children.items()}
        if failed is None:
            failed = next((n for n, rc in codes.items() if rc != 0 and (
                not stops[0] or (self.stop_codes is not None and rc not in self.stop_codes))), None)
        return Outcome(codes, failed, stops[0])


def _own_group_setup() -> None:
    """In a child of its own process group, before exec: take Ctrl-C as a terminal's job does, and die with the
    parent. An ignored SIGINT is inherited: `dflash run` started where Ctrl-C is ignored (a background job of a
    script, `nohup`) gave its children an ignored SIGINT, so the Ctrl-C it passed on never stopped the training
    (it waited for the extraction forever; seen in a CI-like run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


# ----------------------------------------------------------------------------------------------------------
# what the supervisors' messages and placements share
# ----------------------------------------------------------------------------------------------------------


def tail(path: Path, n: int = 5) -> str:
    """The last `n` non-blank lines of a log, joined by ' | ' (a failed child's last words), or '(no log)'."""
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return "(no log)"


def failure_reason(code: int, log: Path, error: Optional[str] = None) -> str:
    """Why a worker failed: the error it reported, else the signal that killed it, else its log's tail."""
    return error or (f"killed by signal {-code}" if code is not None and code < 0 else tail(log))


def fmt_rate(x: float) -> str:
    return f"{x / 1000:.1f}K" if x >= 1000 else f"{x:.0f}"


def fmt_eta(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class PlacementError(UserError, RuntimeError):
    pass


def place_shards(gpus: Optional[list[int]], num_shards: int, n_gpu: int, shard_set: Optional[list[int]] = None, *,
                 error: type = PlacementError) -> dict[int, int]:
    """Which GPU (index among the visible ones) each shard to run gets; a misfit raises `error` (the caller's
    own error class) naming the fix. All shards (`shard_set` None): --gpus in order, default 0..shards-1. One
    shard (e.g. under a scheduler): the single --gpus entry, default the first visible GPU (or the shard's
    entry of a --gpus list with one GPU per shard). A set of shards (one node's): the j-th shard on --gpus'
    j-th entry, default the j-th visible GPU. More shards than visible GPUs and no --gpus: the shards take the
    GPUs in turn (several workers on one GPU; the memory check counts them). No GPU: {} (the CPU)."""
    if not n_gpu:
        if gpus:
            raise error(f"--gpus {','.join(map(str, gpus))}: this process sees no CUDA GPU (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); leave --gpus out to run on the CPU")
        return {}
    if shard_set is not None and len(shard_set) > 1:
        if gpus is not None and len(gpus) != len(shard_set):
            raise error(f"--shard-index {','.join(map(str, shard_set))} runs {len(shard_set)} shards here: give "
                        f"--gpus {len(shard_set)} GPUs (the j-th shard on the j-th), or leave --gpus out (GPUs "
                        f"0..{len(shard_set) - 1}); it names {len(gpus)}: {gpus}")
        chosen = {i: (gpus[j] if gpus is not None else j % n_gpu) for j, i in enumerate(shard_set)}
    elif shard_set is not None:
        shard_index = shard_set[0]
        if gpus is not None and len(gpus) not in (1, num_shards):
            raise error(f"--shard-index runs one shard: give --gpus one GPU (or one per shard); it names "
                        f"{len(gpus)}: {gpus}")
        chosen = {shard_index: (gpus or [0])[shard_index if gpus and len(gpus) > 1 else 0]}
    else:
        gpus = [i % n_gpu for i in range(num_shards)] if gpus is None else gpus
        if len(gpus) < num_shards:
            raise error(f"--shards {num_shards} needs {num_shards} GPUs but --gpus names {len(gpus)}: {gpus}")
        chosen = dict(enumerate(gpus[:num_shards]))
    bad = sorted({g for g in chosen.values() if g >= n_gpu})
    if bad:
        raise error(f"--gpus {bad}: this process sees {n_gpu} GPU(s) (0..{n_gpu - 1})")
    return chosen
