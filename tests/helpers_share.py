"""What the suite's pytest-xdist workers share (CI runs `pytest -n 3 --dist loadfile`, issue 44): a session
fixture built once for all workers (`build_once`), and the machine itself (`Machine`): every test holds it shared,
and a test whose run needs the cores to itself (node8's run phase, tests/test_bench_parts.py) takes it alone.

Contract:
- `build_once(factory, name, build)`: `build(d)` fills the empty directory `d` once per test run, whichever worker
  asks first (the others wait on a lock, then use it); a build that raised is tried again by the next asker.
  Without xdist, `d` is this session's own temporary directory, as `factory.mktemp` gives.
- `Machine`: `shared()` around each test; `alone()` waits until every other worker's running test has ended, and
  holds back their next ones until `share()`. A turnstile lock keeps a waiting `alone()` from being starved by
  tests that keep starting. Processes a worker started in the background before (a module fixture's runs ahead)
  go on running; only tests are held. Locks are `flock`s on files in the run's shared temporary directory, so a
  crashed worker's locks go with it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def under_xdist() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def shared_root(factory) -> Path:
    """The directory every worker of this test run sees: the parent of a worker's base temp (pytest-N/popen-gwK)."""
    base = Path(factory.getbasetemp())
    return base.parent if under_xdist() else base


@contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(factory, name: str, build) -> Path:
    """The directory `name`, filled by `build(d)` once per test run (see the module's contract)."""
    if not under_xdist():
        d = Path(factory.mktemp(name))
        build(d)
        return d
    root = shared_root(factory)
    d, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with _locked(root / f"shared-{name}.lock"):
        if not done.exists():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            build(d)
            done.write_text("")
    return d


class Machine:
    """The cores, shared by the tests of every worker or held by one test alone (see the module's contract)."""

    def __init__(self, root: Path):
        self._gate = open(root / "machine-gate.lock", "a")
        self._room = open(root / "machine-room.lock", "a")
        self.alone_now = False

    @contextmanager
    def shared(self):
        fcntl.flock(self._gate, fcntl.LOCK_EX)  # the turnstile: closed while a worker waits to be alone
        fcntl.flock(self._room, fcntl.LOCK_SH)
        fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield self
        finally:
            self.share()
            fcntl.flock(self._room, fcntl.LOCK_UN)

    def alone(self) -> None:
        """From the calling test (which holds the machine shared): wait until it is the only test running."""
        if self.alone_now:
            return
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        fcntl.flock(self._room, fcntl.LOCK_EX)  # converts this worker's shared lock; waits for the others' tests
        self.alone_now = True

    def share(self) -> None:
        """Back to shared after `alone` (a no-op otherwise): the other workers' tests may start again."""
        if self.alone_now:
            fcntl.flock(self._room, fcntl.LOCK_SH)
            fcntl.flock(self._gate, fcntl.LOCK_UN)
            self.alone_now = False

    def close(self) -> None:
        self._gate.close()
        self._room.close()
