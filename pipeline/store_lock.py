"""One writer per shard: lock files with host, pids and a heartbeat, for a local disk or a shared filesystem.

The protocol (pipeline/store.py's docstring gives the user-level view):
- Shard i's lock is `STORE/locks/shard-NNNNN.lock`, a small JSON record: a random token, the host, a
  machine id (Linux boot id + pid namespace), the holder's pids with their start times, the command, the
  start time, a heartbeat (unix time) and the ttl after which a silent holder on another machine is dead.
- Acquire: the record is written to a temporary file and hard-linked to the lock path. link(2) is atomic
  and fails when the path exists, on a local disk and on NFS alike. When the lock exists its holder is
  - live: the acquirer is refused at once (`ShardLockedError` names host, pids, command, heartbeat age);
  - stale: on this machine none of its pids runs any more (kill -9, a crash; a reboot changes the boot id);
    on another machine, its heartbeat is older than its ttl. A pid that runs but is not the holder (reused
    after the holder died) is told apart by its start time: the one recorded beside the pid, or, for a pid
    recorded without one (a hand-made or older record), the lock's own `started` time (a process that started
    after the lock was taken cannot be its holder). A stale lock is taken over without manual
    cleanup: the taker creates `LOCK.takeover-TOKEN` exclusively (one process wins per stale token),
    re-reads the lock, removes it only if it still carries that token, drops the claim and acquires anew.
- Holding: a daemon thread rewrites the record every ttl/6 s with a fresh heartbeat (atomic replace), after
  checking it still carries its token. `check()` (called before every commit) raises if another process
  took the lock over, so a writer that was presumed dead (frozen past its ttl) cannot commit again.
- A parent process may hold the lock for a child that does the writing (`dflash extract` and its workers):
  it adds the child's pid (`add_pid`), and the child `adopt`s the lock by its token instead of acquiring.
- Release removes the lock if it still carries the holder's token.
- Creating a store's root takes the same kind of lock (`STORE/locks/create.lock`, `creating`), but a run that
  finds it live waits for it instead of stopping: of runs that start on a new store at once (the same command
  in a second shell, the nodes of a multi-node extraction), one creates the root and the others then open it
  and compare provenance. zarr's own create is not atomic (a second creator fails with ContainsGroupError).
- Object stores (fsspec URLs) have no atomic create: there the lock is best effort (exists, write, read
  back); the commit-time checks in pipeline/store.py still stop a second writer before it shrinks anything.
Clocks of machines that share a store must agree to well within the ttl (default 120 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from pipeline.errors import StoreError
from pipeline.procinfo import machine_id, pid_alive, read_text, start_time, started_at

LOCKS_DIR = "locks"
DEFAULT_TTL = 120.0  # seconds without a heartbeat after which a holder on another machine counts as dead
CLAIM_ABANDONED = 30.0  # a takeover claim older than this was left by a process killed while taking over


class ShardLockedError(StoreError):
    """Another live process holds the shard; the message names it and says what to do."""


def is_local(path: str) -> bool:
    """A path on this machine's filesystem (plain or file://), not an fsspec URL."""
    return "://" not in str(path) or str(path).startswith("file://")


def exists(path: str) -> bool:
    if is_local(path):
        return Path(str(path).removeprefix("file://")).exists()
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def is_new(path: str) -> bool:
    """Nothing but (perhaps) the locks directory is at `path`: no store yet, or one whose root is being created
    (`creating` puts its lock there first). An empty directory is new too."""
    if is_local(path):
        p = Path(str(path).removeprefix("file://"))
        return not p.exists() or (p.is_dir() and all(c.name == LOCKS_DIR for c in p.iterdir()))
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return not fs.exists(p) or all(str(n).rstrip("/").rsplit("/", 1)[-1] == LOCKS_DIR
                                   for n in fs.ls(p, detail=False))


def being_created(path: str) -> bool:
    """Another run holds (or a killed one left) the creation lock of `path`'s root."""
    return _FS(path).read(lock_path(path, None)) is not None


def lock_path(store: str, index: Optional[int]) -> str:
    """Shard `index`'s lock; index None is the creation lock (`creating`)."""
    name = "create" if index is None else f"shard-{index:05d}"
    return f"{str(store).rstrip('/')}/{LOCKS_DIR}/{name}.lock"


# ----------------------------------------------------------------------------------------------------------
# Who is alive
# ----------------------------------------------------------------------------------------------------------


def _pids(rec: dict) -> list[tuple[int, Optional[int]]]:
    """(pid, start time or None) of the record's holders; entries that are not a pid are left out."""
    out = []
    for p in rec.get("pids") or []:
        pid, start = (p[0], p[1] if len(p) > 1 else None) if isinstance(p, (list, tuple)) and p else (p, None)
        try:
            out.append((int(pid), None if start is None else int(start)))
        except (TypeError, ValueError):
            continue
    return out


def _lock_started(rec: dict) -> Optional[float]:
    try:
        return datetime.fromisoformat(str(rec["started"])).timestamp()
    except (KeyError, ValueError):
        return None


def holder_alive(rec: dict, pid: int, start: Optional[int]) -> bool:
    """Whether `pid` of this machine's lock record still runs as the holder (see the module contract)."""
    if start is not None or not pid_alive(pid):
        return pid_alive(pid, start)
    began, taken = started_at(pid), _lock_started(rec)
    return began is None or taken is None or began <= taken + 2.0  # 2 s: boot time is in whole seconds


def is_live(rec: dict, now: Optional[float] = None) -> bool:
    if rec.get("machine") == machine_id():
        return any(holder_alive(rec, pid, start) for pid, start in _pids(rec))
    return (now or time.time()) - float(rec.get("heartbeat", 0)) <= float(rec.get("ttl", DEFAULT_TTL))


def _runs_now(pid: int) -> str:
    args = read_text(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
    return f"pid {pid} runs `{args[:120]}` now" if args else ""


def describe(rec: dict, store: str, index: int) -> str:
    pids = ", ".join(str(p) for p, _ in _pids(rec)) or "?"
    age = time.time() - float(rec.get("heartbeat", 0))
    here = rec.get("machine") == machine_id()
    now = "; ".join(filter(None, (_runs_now(p) for p, _ in _pids(rec)))) if here else ""
    return (f"shard {index} of {store} is being written by another process: pid {pids} on host "
            f"{rec.get('host', '?')} (`{rec.get('command') or '?'}`, started {rec.get('started', '?')}, "
            f"last heartbeat {age:.0f} s ago{'; ' + now if now else ''}). Two writers of one shard would corrupt "
            f"it, so this run stops. The lock is {lock_path(store, index)}. Wait for that run to finish "
            f"(`dflash status {store}` shows its progress) or stop it, then rerun the same command; a lock left by "
            f"a killed process is taken over automatically (after {float(rec.get('ttl', DEFAULT_TTL)):.0f} s "
            f"without a heartbeat when it was on another host). If that pid is not a dflash run writing this store "
            f"(reused by an unrelated process), remove the lock file and rerun")


# ----------------------------------------------------------------------------------------------------------
# The few filesystem operations a lock needs
# ----------------------------------------------------------------------------------------------------------


class _FS:
    def __init__(self, store: str):
        self.local = is_local(store)
        if not self.local:
            import fsspec

            self.fs, _ = fsspec.core.url_to_fs(store)

    def _p(self, path: str) -> str:
        return path.removeprefix("file://") if self.local else self.fs._strip_protocol(path)

    def read(self, path: str) -> Optional[bytes]:
        try:
            if self.local:
                return Path(self._p(path)).read_bytes()
            return self.fs.cat_file(self._p(path))
        except (FileNotFoundError, OSError):
            return None

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Write `data` to `path` unless it exists; True if this call created it."""
        p = self._p(path)
        if not self.local:
            if self.fs.exists(p):
                return False
            self.fs.pipe_file(p, data)
            return self.read(path) == data
        Path(p).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{p}.{uuid.uuid4().hex}.tmp"
        Path(tmp).write_bytes(data)
        try:
            os.link(tmp, p)
            return True
        except FileExistsError:
            return False
        except OSError:  # NFS: a retransmitted link can fail although it succeeded
            return os.stat(tmp).st_nlink == 2
        finally:
            os.unlink(tmp)

    def replace(self, path: str, data: bytes) -> None:
        p = self._p(path)
        if not self.local:
            self.fs.pipe_file(p, data)
            return
        tmp = f"{p}.{uuid.uuid4().hex}.tmp"
        Path(tmp).write_bytes(data)
        os.replace(tmp, p)

    def remove(self, path: str) -> None:
        try:
            if self.local:
                os.unlink(self._p(path))
            else:
                self.fs.rm_file(self._p(path))
        except FileNotFoundError:
            pass


def _parse(raw: Optional[bytes]) -> Optional[dict]:
    """The lock record; an unreadable one cannot name a live holder, so it is stale (token: its hash)."""
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        rec = None
    if isinstance(rec, dict) and "token" in rec:
        return rec
    return {"token": "unparsable-" + hashlib.sha256(raw).hexdigest()[:16]}


# ----------------------------------------------------------------------------------------------------------
# The lock
# ----------------------------------------------------------------------------------------------------------


class ShardLock:
    def __init__(self, store: str, index: Optional[int], rec: dict):
        self.store, self.index, self.rec = store, index, rec
        self.path = lock_path(store, index)
        self._fs = _FS(store)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost = False

    @property
    def token(self) -> str:
        return self.rec["token"]

    @classmethod
    def acquire(cls, store: str, index: Optional[int], command: str = "", ttl: float = DEFAULT_TTL,
                heartbeat: bool = True) -> "ShardLock":
        """Take shard `index`'s lock or raise ShardLockedError naming its live holder."""
        pid = os.getpid()
        rec = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "machine": machine_id(),
               "pids": [[pid, start_time(pid)]], "command": command,
               "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "heartbeat": time.time(),
               "ttl": ttl}
        lock = cls(store, index, rec)
        fs = lock._fs
        for attempt in range(50):
            if fs.create_exclusive(lock.path, lock._bytes()):
                if heartbeat:
                    lock.start_heartbeat()
                return lock
            held = _parse(fs.read(lock.path))
            if held is None:
                continue  # released meanwhile
            if is_live(held):
                raise ShardLockedError(describe(held, store, index))
            lock._take_over(held)
            time.sleep(0.01 * attempt)
        raise StoreError(f"could not take the lock {lock.path} after 50 attempts (other processes kept "
                            "taking it); rerun the command")

    @classmethod
    def adopt(cls, store: str, index: int, token: str) -> "ShardLock":
        """The lock a parent took for this process (`dflash extract` for its workers); no heartbeat here."""
        lock = cls(store, index, {"token": token})
        held = _parse(lock._fs.read(lock.path))
        if held is None or held["token"] != token:
            holder = describe(held, store, index) if held else "it is not held at all"
            raise StoreError(f"this worker's lock on shard {index} of {store} is gone: {holder}")
        lock.rec = held
        return lock

    def _bytes(self) -> bytes:
        return json.dumps(self.rec, sort_keys=True).encode()

    def _take_over(self, stale: dict) -> None:
        claim = f"{self.path}.takeover-{stale['token']}"
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}).encode()
        if not self._fs.create_exclusive(claim, me):
            other = _parse(self._fs.read(claim)) or {}
            if time.time() - float(other.get("time", 0)) > CLAIM_ABANDONED:
                self._fs.remove(claim)  # its taker died within the few microseconds it holds a claim
            return
        try:
            now = _parse(self._fs.read(self.path))
            if now is not None and now["token"] == stale["token"]:
                self._fs.remove(self.path)
        finally:
            self._fs.remove(claim)

    def holds(self) -> bool:
        now = _parse(self._fs.read(self.path))
        return now is not None and now["token"] == self.token

    def check(self) -> None:
        """Raise StoreError unless this process (or its parent) still holds the lock."""
        if self.lost or not self.holds():
            self.lost = True
            held = _parse(self._fs.read(self.path))
            who = describe(held, self.store, self.index) if held else "the lock file is gone"
            raise StoreError(f"lost the lock on shard {self.index} of {self.store} (another process took it over "
                                f"while this one looked dead): {who}. Nothing more is written by this process")

    def add_pid(self, pid: int) -> None:
        """Record a child that writes under this lock: the lock is live while any recorded pid runs."""
        self.rec["pids"].append([pid, start_time(pid)])
        self.refresh()

    def refresh(self) -> None:
        if not self.holds():
            self.lost = True
            return
        self.rec["heartbeat"] = time.time()
        self._fs.replace(self.path, self._bytes())

    def start_heartbeat(self) -> None:
        interval = float(self.rec.get("ttl", DEFAULT_TTL)) / 6

        def beat():
            while not self._stop.wait(interval):
                try:
                    self.refresh()
                except OSError:  # a transient filesystem error: the next beat retries
                    pass
                if self.lost:
                    return

        self._thread = threading.Thread(target=beat, name=f"dflash-lock-{self.index}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.lost and self.holds():
            self._fs.remove(self.path)


def acquire_all(store: str, indices: list[int], command: str) -> list[ShardLock]:
    """Locks for several shards, in index order, all or none: of two runs asking for the same shards, the
    first to lock the lowest shard gets them all and the other is refused."""
    locks: list[ShardLock] = []
    try:
        for i in sorted(indices):
            locks.append(ShardLock.acquire(store, i, command))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


@contextmanager
def creating(store: str, wait_s: float = DEFAULT_TTL + 60.0):
    """Held while the caller creates (or finds) the root group of `store`; waits up to `wait_s` for another
    live creator (creating a root takes milliseconds). A dead creator's lock is taken over: at once on this
    machine, after its ttl from another one, hence a wait longer than the ttl."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock = ShardLock.acquire(store, None, "create the store", heartbeat=False)
            break
        except OSError as e:
            raise StoreError(f"cannot create the store at {store}: {e}; choose a writable --store path "
                             "(or set store.path) with room for the features") from None
        except ShardLockedError:
            if time.monotonic() > deadline:
                rec = holder(store, None) or {}
                raise StoreError(
                    f"another process (pid {', '.join(str(p) for p, _ in _pids(rec)) or '?'} on host "
                    f"{rec.get('host', '?')}) has been creating the store at {store} for over {wait_s:.0f} s; "
                    f"stop it and rerun (its lock {lock_path(store, None)} is then taken over), or remove that "
                    "file if no such process runs") from None
            time.sleep(0.05)
    try:
        yield
    finally:
        lock.release()


def refuse_if_held(store: str, indices: list[int]) -> None:
    """Raise ShardLockedError if a live process holds one of these shards: a cheap early look, before a run
    spends minutes on its set-up (`acquire_all` is what guarantees one writer)."""
    if not exists(store):
        return
    for i in sorted(indices):
        rec = holder(store, i)
        if rec is not None and rec["live"]:
            raise ShardLockedError(describe(rec, store, i))


def holder(store: str, index: Optional[int]) -> Optional[dict]:
    """The record of shard `index`'s lock with "live": bool added, or None when unlocked."""
    rec = _parse(_FS(store).read(lock_path(store, index)))
    if rec is not None:
        rec["live"] = "machine" in rec and is_live(rec)
    return rec
