"""Where a checkpoint write's time goes, and how much of the GIL it takes (issue 46 item 3), on this host's disk.

A checkpoint-shaped dict (fp32 tensors of --gib GiB in all, in 64 MiB pieces, like the 27B shape's weights and
AdamW moments) is written under --dir by each way, each from a background thread while the main thread counts
loop turns in pure Python (its rate against the same loop beside an idle thread is the share of the GIL the
writer leaves to training's kernel launches):
- `shipped`: stages/train_ckpt_io.write_atomic (torch.save into an open file, fsync, rename, directory fsync);
- `path`: torch.save given the path (torch's C++ file writer), then fsync;
- `no crc`: `shipped` with torch's CRC32 of each record off (torch.serialization.set_crc32_options);
- `raw`: each tensor's bytes written with os.write, then fsync: the disk's own ceiling for these bytes.
Prints GB/s, seconds, the fsync's share and the main loop's rate per way; --out writes the JSON.

    python bench/ckpt_write_bench.py --gib 8 --dir /tmp/ckpt-write --out /tmp/ckpt_write.json
"""

from __future__ import annotations

import argparse
import json
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
    n = max(1, int(gib * 2**30 / 4 / PIECE))
    return {"state_dict": {f"w{i}": torch.rand(PIECE) for i in range(n)}, "epoch": 1, "global_step": 40}


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


WAYS = {"shipped": lambda o, p: (write_atomic(o, p), float("nan"))[1], "path": _path, "no crc": _no_crc, "raw": _raw}


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

    th = threading.Thread(target=write)
    th.start()
    out["main_loop_per_s"] = loop_rate(done)
    th.join()
    out["GB_s"] = gib * 2**30 / 1e9 / out["s"]
    shutil.rmtree(d, ignore_errors=True)
    return out


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
        fs = "" if r["fsync_s"] != r["fsync_s"] else f", fsync {r['fsync_s']:.1f} s of it"
        print(f"{way:<8} {r['GB_s']:5.2f} GB/s ({r['s']:.1f} s{fs}); main loop {r['main_loop_per_s'] / 1e6:.2f} M "
              f"turns/s = {100 * r['main_loop_per_s'] / idle:.0f}% of alone")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
