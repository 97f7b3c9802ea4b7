"""The store writer in a child process (issue 30, a benchmark prototype): does extraction lose its GPU time to the
writer thread's share of the GIL?

The profile of 2026-12-02 (docs/benchmarks.md) showed the H200 idle 170-320 ms a batch during extraction and 27 ms
in the bare forward, in step with the writer's CPU time (zarr's per-chunk Python runs under the same GIL as the
forward's kernel launches). `ProcessWriter` keeps the zarr write in a child with its own interpreter: the parent's
writer thread only hands each batch's parts through a pipe (the `write` syscall releases the GIL), the child owns
the shard's `ShardWriter` (lock, commits) and writes as `dflash extract` does. bench/fastfwd_bench.py runs it as the
writer variant `process` beside `thread` (as shipped), `switch` and `null`.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np


def _child(conn, path: str, prov: dict) -> None:
    from pipeline import store as st

    writer = st.ShardWriter(path, 0, prov)
    conn.send("ready")
    try:
        while True:
            head = conn.recv()
            if head is None:
                break
            n, seq, spec = head  # spec: {part: (dtype str, shape)}
            parts = {}
            for k, (dt, shape) in spec.items():
                buf = bytearray(int(np.prod(shape)) * np.dtype(dt).itemsize)
                conn.recv_bytes_into(buf)
                parts[k] = np.frombuffer(buf, dtype=dt).reshape(shape)
            T = next(iter(parts.values())).shape[0]
            writer.write_batch(np.arange(n, dtype=np.uint64), np.zeros(n, np.uint8), np.array([seq] * n, np.int32),
                               np.zeros(T, np.int32), np.ones(T, np.uint8), parts)
    finally:
        writer.close()
        conn.send("done")


class ProcessWriter:
    """write(n, seq, parts) from the parent; close() waits until the child has written everything."""

    def __init__(self, path: str, prov: dict):
        ctx = mp.get_context("spawn")  # never fork a process that holds a CUDA context
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, path, prov), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("the writer process did not start")

    def write(self, n: int, seq: int, parts: dict) -> None:
        arrays = {k: np.ascontiguousarray(v) for k, v in parts.items()}
        self.conn.send((n, seq, {k: (v.dtype.str, v.shape) for k, v in arrays.items()}))
        for v in arrays.values():
            self.conn.send_bytes(memoryview(v).cast("B"))

    def close(self) -> None:
        if self.proc.is_alive() and not self.conn.closed:
            self.conn.send(None)
            assert self.conn.recv() == "done"
            self.done_at = time.perf_counter()  # everything written (the child's exit is not the bench's time)
            self.conn.close()
        self.proc.join(timeout=60)
