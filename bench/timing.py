"""Device-synchronised timing, shared by the benches (extract_bench, fastfwd_bench, train_bench, long_bench).

A GPU runs what it is given asynchronously: a timed region starts and ends with the device synchronised, or
it times the launches only. `timed` is that region, once, for every timed loop of those scripts:

    sync = device_sync(dev)
    first = timed(step, sync)                     # the first call (compiles, autotuning), alone
    ms = timed(step, sync, n=20, warmup=3) / 20 * 1e3
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def device_sync(dev: torch.device | str) -> Callable[[], None]:
    """What waits for `dev`'s queued work: torch.cuda.synchronize on CUDA, nothing on the CPU."""
    return torch.cuda.synchronize if torch.device(dev).type == "cuda" else (lambda: None)


def timed(fn: Callable[[], object], sync: Callable[[], None], n: int = 1, warmup: int = 0) -> float:
    """Seconds that n calls of fn() take, after `warmup` untimed calls; the device synchronised before and after."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return time.perf_counter() - t0
