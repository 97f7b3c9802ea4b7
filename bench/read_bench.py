"""Per-sample read time of a store: what a loader worker (or, with num_workers=0, the training loop) pays.

    python bench/read_bench.py STORE [--samples 400]

Reads samples in store order through `StoreReader.read` (all token arrays of one sample: tokens, loss mask
and the encoding's parts) after a short warm-up, and prints samples/s and ms per sample.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.store_reader import StoreReader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--samples", type=int, default=400)
    a = ap.parse_args()
    reader = StoreReader(a.store)
    n = min(a.samples, len(reader.samples) - 20)
    for i in range(20):  # warm-up: page cache, first opens
        reader.read(i)
    t = time.perf_counter()
    for i in range(20, 20 + n):
        reader.read(i)
    dt = time.perf_counter() - t
    print(f"{a.store}: {n} samples ({reader.encoding}), {n / dt:.0f} samples/s, {1000 * dt / n:.2f} ms/sample")


if __name__ == "__main__":
    main()
