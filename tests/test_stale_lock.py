"""A shard lock on this machine whose pid now belongs to an unrelated process (pipeline/store_lock.py, issue 27):
told apart by start time (the pid's recorded start ticks, or the lock's own `started` time when the record has
none) and taken over; a lock that cannot be told apart is refused with a message that says what the lock is,
who holds it and how to clear it."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pipeline import store_lock as sl
from pipeline.procinfo import machine_id, start_time


def _plant(store: Path, pids, started: datetime) -> Path:
    path = Path(sl.lock_path(str(store), 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"token": "old", "host": socket.gethostname(), "machine": machine_id(), "pids": pids,
           "command": "dflash extract --config old.yaml", "started": started.isoformat(timespec="seconds"),
           "heartbeat": started.timestamp(), "ttl": 120.0}
    path.write_text(json.dumps(rec))
    return path


@pytest.fixture
def unrelated():
    """A live process that is not a dflash writer, started now."""
    p = subprocess.Popen(["sleep", "300"])
    time.sleep(0.2)
    yield p.pid
    p.kill()
    p.wait()


def test_a_reused_pid_without_a_recorded_start_is_taken_over(tmp_path, unrelated):
    """The lock was taken an hour before the pid's process started: it cannot hold it."""
    store = tmp_path / "s.zarr"
    _plant(store, [[unrelated, None]], datetime.now(timezone.utc) - timedelta(hours=1))
    assert sl.holder(str(store), 0)["live"] is False
    lock = sl.ShardLock.acquire(str(store), 0, "dflash extract", heartbeat=False)
    assert lock.holds() and json.loads(Path(lock.path).read_text())["token"] == lock.token
    lock.release()
    _plant(store, [unrelated], datetime.now(timezone.utc) - timedelta(hours=1))  # a bare pid (a hand-made record)
    lock = sl.ShardLock.acquire(str(store), 0, "dflash extract", heartbeat=False)
    lock.release()


def test_a_reused_pid_with_another_recorded_start_is_taken_over(tmp_path, unrelated):
    store = tmp_path / "s.zarr"
    _plant(store, [[unrelated, start_time(unrelated) - 1]], datetime.now(timezone.utc))
    lock = sl.ShardLock.acquire(str(store), 0, "dflash extract", heartbeat=False)
    lock.release()


def test_a_lock_that_cannot_be_told_stale_is_refused_with_how_to_clear_it(tmp_path, unrelated):
    """The pid started before the lock was taken and no start ticks were recorded: it may be the holder."""
    store = tmp_path / "s.zarr"
    path = _plant(store, [[unrelated, None]], datetime.now(timezone.utc) + timedelta(minutes=1))
    with pytest.raises(sl.ShardLockedError) as e:
        sl.ShardLock.acquire(str(store), 0, "dflash extract", heartbeat=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"pid {unrelated} on host {socket.gethostname()}" in msg  # who holds it
    assert f"pid {unrelated} runs `sleep 300` now" in msg  # what that pid is now
    assert f"The lock is {path}" in msg and "remove the lock file and rerun" in msg  # what it is, how to clear it
    assert path.exists()  # refused: nothing removed


def test_a_creation_lock_left_by_a_killed_run_is_taken_over_and_the_store_made(tmp_path):
    """A run killed while creating a new store's root leaves STORE/locks/create.lock: the next run takes it over
    (its pid is gone) and creates the store, without waiting out the lock's ttl."""
    from helpers_store import synthetic_provenance
    from pipeline import store as st
    from pipeline.provenance import create_or_open_store

    store = tmp_path / "s.zarr"
    gone = subprocess.Popen(["true"])
    gone.wait()
    path = Path(sl.lock_path(str(store), None))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"token": "dead", "host": socket.gethostname(), "machine": machine_id(),
                                "pids": [[gone.pid, None]], "command": "create the store",
                                "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                "heartbeat": time.time(), "ttl": 120.0}))
    assert st.read_root_attrs(str(store)) is None  # a directory holding only the lock is not a store yet
    create_or_open_store(str(store), synthetic_provenance(fingerprint="new"))  # (a live lock: StoreError after 180 s)
    assert st.read_root_attrs(str(store))["dataset"]["fingerprint"] == "new" and not path.exists()
