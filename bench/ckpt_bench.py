"""Checkpoint write: Lightning's default (serialise into memory, then write) vs dflash's streaming CheckpointIO.

A checkpoint-shaped dict (fp32 weights + two AdamW moments, like a training checkpoint) of --gib GiB is
written to --dir by each IO plugin; prints wall time and the process's peak resident memory growth.

    python bench/ckpt_bench.py --gib 3 --dir /tmp/ckpt-bench
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import shutil
import time
from pathlib import Path


def _write(kind: str, gib: float, out: str, q) -> None:
    import torch

    n = int(gib * 2**30 / 4 / 3)
    ckpt = {"state_dict": {"w": torch.randn(n)}, "optimizer_states": [{"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}]}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if kind == "lightning default":
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        io = TorchCheckpointIO()
    else:
        from stages.train_ckpt_io import AsyncCheckpointIO

        io = AsyncCheckpointIO()
    t = time.perf_counter()
    io.save_checkpoint(ckpt, Path(out) / f"{kind.split()[0]}.ckpt")
    io.teardown()  # the background write is in place: the time is the whole write, as for the default
    q.put((kind, time.perf_counter() - t, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--dir", default="/tmp/ckpt-bench")
    a = ap.parse_args()
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")  # a fresh process each: peak memory is per writer
    q = ctx.Queue()
    print(f"checkpoint of {a.gib:.1f} GiB to {a.dir}")
    print(f"{'writer':<20}{'seconds':>9}{'GiB/s':>8}{'peak RSS growth GiB':>21}")
    for kind in ("lightning default", "streaming (dflash)"):
        p = ctx.Process(target=_write, args=(kind, a.gib, a.dir, q))
        p.start()
        k, dt, rss = q.get()
        p.join()
        print(f"{k:<20}{dt:>9.1f}{a.gib / dt:>8.2f}{rss:>21.1f}")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
