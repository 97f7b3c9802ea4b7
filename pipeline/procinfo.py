"""What this machine can say about a process: whether a pid still names the process that was recorded, and
which processes can see each other's pids. The contract: a pid is the same process only if its start time
(clock ticks since boot, from /proc) matches the recorded one, because pids are reused; two records with the
same `machine_id` (boot id + pid namespace) can compare pids at all. The shard locks (pipeline/store_lock.py)
and `dflash status` decide liveness with these; without /proc (not Linux) a pid is alive while kill(0) says so.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional


def read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def machine_id() -> str:
    """Boot id + pid namespace: two processes with equal ids can see each other's pids."""
    boot = read_text("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{boot}/{ns}" if boot and ns else f"host:{socket.gethostname()}"


def start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (tells a pid from a later reuse of it), or None."""
    stat = read_text(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])  # a zombie has exited


def pid_alive(pid: int, start: Optional[int] = None) -> bool:
    """Whether process `pid` runs on this machine (and, given its start time, is the same process)."""
    if Path("/proc/self/stat").exists():
        now = start_time(pid)
        return now is not None and (start is None or now == start)
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def started_at(pid: int) -> Optional[float]:
    """The unix time process `pid` started (Linux: boot time + its start ticks), or None."""
    ticks = start_time(pid)
    btime = next((line.split()[1] for line in read_text("/proc/stat").splitlines() if line.startswith("btime ")), None)
    if ticks is None or btime is None:
        return None
    return int(btime) + ticks / os.sysconf("SC_CLK_TCK")
