"""Padding of the epoch plans with and without packing, from sample lengths alone (no training).

    python bench/pack_stats.py --store runs/pack-tau/stores/bf16.zarr --batch 8 --pack 256,512
    python bench/pack_stats.py --mix chat --samples 1070000 --pack 3072      # bench/train_e2e.py's length mixes
    python bench/pack_stats.py --mix long --samples 1070000 --pack 8192

Unpacked: data/sampler.py's plain plan (train.length_group_factor 0) in batches of --batch, padded to each
batch's longest. Packed: data/packing.py's plan, one row a batch; prints samples per row, the share of the rows'
budget left empty and how long planning one epoch took.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.packing import packed_plan  # noqa: E402
from data.sampler import window_plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None)
    ap.add_argument("--mix", default=None, help="chat | long (bench/train_e2e.py mix_lengths) instead of a store")
    ap.add_argument("--samples", type=int, default=1_070_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pack", default="512")
    a = ap.parse_args()
    if a.store:
        from pipeline import store as st
        from pipeline.store_reader import StoreReader

        r = StoreReader(a.store)
        lengths = [x.length for x in r.samples if x.split == st.SPLITS["train"]]
    else:
        from bench.train_e2e import mix_lengths

        lengths = mix_lengths(a.mix, a.samples, 0)
    print(f"{len(lengths):,} train samples, {sum(lengths):,} tokens, mean {statistics.mean(lengths):.1f}, max {max(lengths)}")
    plain = window_plan(lengths, a.batch, 0, 0, True, 0)
    slots = sum(len(b) * max(lengths[i] for i in b) for b in plain)
    print(f"unpacked, batches of {a.batch}: {len(plain):,} batches, {100 * (1 - sum(lengths) / slots):.1f}% padding")
    for pt in (int(x) for x in a.pack.split(",")):
        t = time.perf_counter()
        rows = [row for b in packed_plan(lengths, 1, 0, 0, pt) for row in b]
        dt = time.perf_counter() - t
        print(f"packed into {pt:,}-token rows: {len(rows):,} rows, {len(lengths) / len(rows):.2f} samples a row, "
              f"{100 * (1 - sum(lengths) / (len(rows) * pt)):.1f}% of the budget empty; planned in {dt:.1f} s")


if __name__ == "__main__":
    main()
