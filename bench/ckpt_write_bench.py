"""Where a checkpoint write's time goes, and how much of the GIL it takes (issue 46 item 3), on this host's disk.

A checkpoint-shaped dict (fp32 tensors of --gib GiB in all, in 64 MiB pieces, like the 27B shape's weights and
AdamW moments) is written under --dir by each way, each from a background thread while the main thread counts
loop turns in pure Python (its rate against the same loop beside an idle thread is the share of the GIL the
writer leaves to training's kernel launches):
- `shipped`: stages/train_ckpt_io.write_atomic (torch.save into an open file, fsync, rename, directory fsync);
- `path`: torch.save given the path (torch's C++ file writer), then fsync;
- `no crc`: `shipped` with torch's CRC32 of each record off (torch.serialization.set_crc32_options);
- `raw`: each tensor's bytes written with os.write, then fsync: the disk's own ceiling for these bytes;
and three ways that tell why even `raw` slowed the main loop to 89% on the H200 host (2026-12-03), each the
same bytes as `raw`:
- `raw process`: written by a child process (the same bytes: the tensors live in one shared anonymous mapping);
  only the wait is a thread here. Recovers the loop if the cost was the writer's share of the GIL.
- `raw O_DIRECT`: the file opened with O_DIRECT, so the kernel copies nothing into the page cache (the pieces are
  page-aligned); recovers it if the cost was that copy (memory bandwidth, the kernel's CPU time).
- `raw apart`: the main thread pinned to one CPU, the writer thread to every CPU but that one and its hyperthread
  siblings; recovers it if the two shared a core.
Prints GB/s, seconds, the fsync's share and the main loop's rate per way; --out writes the JSON.

    python bench/ckpt_write_bench.py --gib 8 --dir /tmp/ckpt-write --out /tmp/ckpt_write.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stages.train_ckpt_io import write_atomic  # noqa: E402

PIECE = 16 * 2**20  # fp32 elements: 64 MiB a tensor


def checkpoint(gib: float) -> dict:
    """The pieces are views of one shared anonymous mapping: page-aligned (O_DIRECT) and inherited by a child
    process (`raw process`) without a copy."""
    n = max(1, int(gib * 2**30 / 4 / PIECE))
    SHARED["map"] = mem = mmap.mmap(-1, n * PIECE * 4, flags=mmap.MAP_SHARED)
    flat = torch.frombuffer(mem, dtype=torch.float32)
    for i in range(n):
        flat[i * PIECE:(i + 1) * PIECE].uniform_()
    return {"state_dict": {f"w{i}": flat[i * PIECE:(i + 1) * PIECE] for i in range(n)}, "epoch": 1, "global_step": 40}


SHARED: dict = {}  # "map": the mapping behind the checkpoint's pieces


def _fsync(path: Path) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _raw(obj: dict, path: Path) -> float:
    with open(path, "wb", buffering=0) as f:
        for t in obj["state_dict"].values():
            f.write(memoryview(t.numpy()).cast("B"))
    return _fsync(path)


def _raw_process(obj: dict, path: Path) -> float:
    """The pieces' bytes written by a forked child (it shares the mapping), fsync included; the child's exit code
    is checked."""
    pid = os.fork()
    if pid == 0:  # the child: only os calls, then _exit (no Python clean-up of the parent's state)
        code = 1
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            view = memoryview(SHARED["map"])
            for i in range(len(obj["state_dict"])):
                os.write(fd, view[i * PIECE * 4:(i + 1) * PIECE * 4])
            os.fsync(fd)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the writer process exited {os.waitstatus_to_exitcode(status)}")
    return float("nan")


def _raw_direct(obj: dict, path: Path) -> float:
    """O_DIRECT writes of the page-aligned pieces (whole 64 MiB pieces: a multiple of any block size)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        view = memoryview(SHARED["map"])
        for i in range(len(obj["state_dict"])):
            os.write(fd, view[i * PIECE * 4:(i + 1) * PIECE * 4])
        t = time.perf_counter()
        os.fsync(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)


def apart(cpu: int) -> set:
    """Every CPU this process may use but `cpu` and its hyperthread siblings (all of them if nothing is left)."""
    mine = os.sched_getaffinity(0)
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        sib = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            sib |= set(range(int(lo), int(hi or lo) + 1))
    except OSError:
        sib = {cpu}
    return (mine - sib - {cpu}) or mine


def _raw_apart(obj: dict, path: Path) -> float:
    """`raw` with this (writer) thread off the main thread's CPU and its siblings (measure() pins the main thread to
    MAIN_CPU first, for this way)."""
    os.sched_setaffinity(0, apart(MAIN_CPU[0]))  # Linux: 0 is the calling thread only
    return _raw(obj, path)


MAIN_CPU = [0]


def _path(obj: dict, path: Path) -> float:
    torch.save(obj, str(path))
    return _fsync(path)


def _no_crc(obj: dict, path: Path) -> float:
    torch.serialization.set_crc32_options(False)
    try:
        write_atomic(obj, path)
    finally:
        torch.serialization.set_crc32_options(True)
    return float("nan")


WAYS = {"shipped": lambda o, p: (write_atomic(o, p), float("nan"))[1], "path": _path, "no crc": _no_crc, "raw": _raw,
        "raw process": _raw_process, "raw O_DIRECT": _raw_direct, "raw apart": _raw_apart}


def loop_rate(done: threading.Event) -> float:
    """Pure-Python loop turns per second in this thread until `done` is set."""
    n, t0 = 0, time.perf_counter()
    while not done.is_set():
        n += 1
    return n / (time.perf_counter() - t0)


def idle_rate(seconds: float) -> float:
    """The same loop beside a thread that only sleeps."""
    done = threading.Event()
    threading.Timer(seconds, done.set).start()
    return loop_rate(done)


def measure(way: str, obj: dict, d: Path, gib: float) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    path, done, out = d / "ckpt.pt", threading.Event(), {}

    def write():
        t = time.perf_counter()
        out["fsync_s"] = WAYS[way](obj, path)
        out["s"] = time.perf_counter() - t
        done.set()

    def write_or_say():
        try:
            write()
        except OSError as e:  # e.g. O_DIRECT on a file system without it: the way is reported, not the run lost
            out["error"] = f"{type(e).__name__}: {e}"
            done.set()

    before = os.sched_getaffinity(0)
    if way == "raw apart":  # the main thread on the CPU it runs on now, the writer elsewhere
        MAIN_CPU[0] = os.sched_getaffinity(0).pop() if len(before) == 1 else _current_cpu()
        os.sched_setaffinity(0, {MAIN_CPU[0]})
    th = threading.Thread(target=write_or_say)
    th.start()
    out["main_loop_per_s"] = loop_rate(done)
    th.join()
    os.sched_setaffinity(0, before)
    if "error" in out:
        shutil.rmtree(d, ignore_errors=True)
        return out
    out["GB_s"] = gib * 2**30 / 1e9 / out["s"]
    shutil.rmtree(d, ignore_errors=True)
    return out


def _current_cpu() -> int:
    """The CPU this thread runs on now (/proc/thread-self/stat's field 39)."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return min(os.sched_getaffinity(0))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--dir", default="/tmp/ckpt-write")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    obj = checkpoint(a.gib)
    idle = idle_rate(2.0)  # the main loop with no writer
    res = {"gib": a.gib, "idle_main_loop_per_s": idle, "ways": {}}
    print(f"checkpoint of {a.gib:.1f} GiB in {len(obj['state_dict'])} tensors under {a.dir}; main loop alone "
          f"{idle / 1e6:.2f} M turns/s")
    measure("raw", obj, Path(a.dir), a.gib)  # a first write warms the page cache and the allocator: not counted
    for way in WAYS:
        r = measure(way, obj, Path(a.dir), a.gib)
        res["ways"][way] = r
        if "error" in r:
            print(f"{way:<12} not measured here: {r['error']}")
            continue
        fs = "" if r["fsync_s"] != r["fsync_s"] else f", fsync {r['fsync_s']:.1f} s of it"
        print(f"{way:<12} {r['GB_s']:5.2f} GB/s ({r['s']:.1f} s{fs}); main loop {r['main_loop_per_s'] / 1e6:.2f} M "
              f"turns/s = {100 * r['main_loop_per_s'] / idle:.0f}% of alone")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
