"""How much the extraction writer holds the GIL (issue 22 item 4): does the store write slow the main thread?

Extraction's main thread launches the target's forward (Python work under the GIL, one kernel launch at a
time) while the writer thread (stages/extract_worker.py) converts, compresses (blosc zstd through zarr) and
writes each batch. This measures, on the CPU:

1. `python`: a pure-Python loop's rate alone (the stand-in for the main thread's launch work);
2. `blosc`: numcodecs Blosc(zstd) compressing in a thread beside that loop: the loop's rate kept (a codec
   that releases the GIL keeps ~1.0 when a core is free);
3. `write`: `ShardWriter.write_batch` of bf16 batches (27B-shaped features by default) in a thread beside
   the loop, as extraction runs it: the loop's rate kept and the writer's MB/s;
4. `write-process`: the same writes in a child process (what moving the writer to a process would give):
   the loop's rate kept.

    python bench/gil_bench.py --tokens 1024 --layers 5 --hidden 5120 --seconds 4 --out /tmp/gil.json

On a machine with fewer free cores than threads the kept rate measures core contention as well as the GIL;
the `blosc` line tells them apart (it releases the GIL, so any loss there is cores, not the lock).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def python_rate(seconds: float, stop: threading.Event | None = None) -> float:
    """Iterations per second of a pure-Python loop (holds the GIL between bytecodes)."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
        for i in range(1000):
            n += i & 1
    return n * 2 / (time.perf_counter() - t0)


def _features(tokens: int, layers: int, hidden: int, seed: int = 0) -> np.ndarray:
    """bf16 bit patterns (what the bf16 encoding stores) of activation-like values, int16 [T, L, H]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layers, hidden, generator=g) * torch.rand(hidden, generator=g).exp()
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # as to_storage gives


def _writer(root: str, layers: int, hidden: int, clevel: int):
    from bench.store_bench import provenance
    from pipeline.provenance import create_or_open_store
    from pipeline.store_writer import ShardWriter

    path = str(Path(root) / "s.zarr")
    prov = {**provenance("bf16", layers, hidden), "clevel": clevel, "chunk_tokens": 1024}
    create_or_open_store(path, prov)
    w = ShardWriter(path, 0, prov)
    w.start("bench", 1 << 30, 1 << 40)
    return w


def write_loop(root: str, layers: int, hidden: int, clevel: int, feats: np.ndarray, stop, done: list) -> None:
    w = _writer(root, layers, hidden, clevel)
    T, n, t0 = len(feats), 0, time.perf_counter()
    while not stop.is_set():
        w.write_batch(np.arange(n, n + 1, dtype=np.uint64), np.zeros(1, np.uint8), np.array([T], np.int32),
                      np.zeros(T, np.int32), np.ones(T, np.uint8), {"features": feats})
        n += 1
    done.append((n * feats.nbytes / 1e6) / (time.perf_counter() - t0))


def _child(root, layers, hidden, clevel, tokens, stop, out):
    done: list = []
    write_loop(root, layers, hidden, clevel, _features(tokens, layers, hidden), stop, done)
    out.put(done[0])


def beside(work, seconds: float) -> tuple[float, object]:
    """The Python loop's rate while `work(stop)` runs in a thread; returns (rate, work's result)."""
    stop, res = threading.Event(), []
    th = threading.Thread(target=lambda: res.append(work(stop)))
    th.start()
    time.sleep(0.5)  # let it reach its steady state
    rate = python_rate(seconds)
    stop.set()
    th.join()
    return rate, res[0] if res else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--clevel", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from numcodecs import Blosc

    feats = _features(a.tokens, a.layers, a.hidden)
    alone = python_rate(a.seconds)
    res = {"python_alone": alone, "mb_per_batch": feats.nbytes / 1e6}

    def blosc(stop):
        c, n, t0 = Blosc(cname="zstd", clevel=a.clevel, shuffle=Blosc.SHUFFLE), 0, time.perf_counter()
        while not stop.is_set():
            c.encode(feats)
            n += 1
        return n * feats.nbytes / 1e6 / (time.perf_counter() - t0)

    r, mbs = beside(blosc, a.seconds)
    res["blosc"] = {"kept": r / alone, "mb_s": mbs}
    with tempfile.TemporaryDirectory() as d:  # the writer alone: its MB/s with the GIL to itself
        stop, done = threading.Event(), []
        threading.Timer(a.seconds, stop.set).start()
        write_loop(d, a.layers, a.hidden, a.clevel, feats, stop, done)
        res["write_alone_mb_s"] = done[0]
    with tempfile.TemporaryDirectory() as d:
        def write(stop):
            done: list = []
            write_loop(d, a.layers, a.hidden, a.clevel, feats, stop, done)
            return done[0]

        r, mbs = beside(write, a.seconds)
        res["write_thread"] = {"kept": r / alone, "mb_s": mbs}
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=_child, args=(d, a.layers, a.hidden, a.clevel, a.tokens, stop, out))
        p.start()
        time.sleep(8.0)  # the child's imports and first batches
        r = python_rate(a.seconds)
        stop.set()
        mbs = out.get(timeout=120)
        p.join()
        res["write_process"] = {"kept": r / alone, "mb_s": mbs}
    print(f"write alone    writer {res['write_alone_mb_s']:.0f} MB/s raw")
    for k in ("blosc", "write_thread", "write_process"):
        print(f"{k:14s} python loop kept {res[k]['kept']:.2f} of its rate alone; writer {res[k]['mb_s']:.0f} MB/s raw")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
