"""Issue 28 item 3: does sequence packing cost tau? Paired seeded runs on the tiny target, packed vs unpacked.

One bf16 store of the tiny target (bench/encoding_tau.py's pieces); per seed two drafters with the same seed,
initial weights, epochs and about the same tokens per optimizer step, differing only in how samples share a row:
  plain:   train.batch_size = 8 samples, one per row (the demo schedule; ~8 x 58 = 460 real tokens a step);
  packed:  train.packing = true, train.pack_tokens = 512, train.batch_size = 1 row (~500 real tokens a step:
           about 8.6 samples per row, each seeing only itself, data/packing.py).
Evaluated offline (uniform anchors and the serving walk, validation split, unpacked) and online against the
target. Prints each measure's mean per variant and the paired difference packed vs plain with its 95%
interval; "no worse beyond noise" = the interval reaches 0 or above. Resumable; seed-major.

    nice -n 10 python bench/pack_tau.py --out runs/pack-tau --seeds 0..7 --jobs 2 --threads 1 --cpu
    python bench/pack_tau.py --summarize runs/pack-tau/results.jsonl
    python bench/pack_tau.py --out /tmp/smoke --seeds 0 --set train.max_steps=2 --cpu   # smoke run
"""

from __future__ import annotations

from encoding_tau import paired_study

VARIANTS = {
    "plain": ["train.batch_size=8"],
    "packed": ["train.packing=true", "train.pack_tokens=512", "train.batch_size=1"],
}


def main() -> None:
    paired_study("runs/pack-tau", "0..3", VARIANTS, base="plain")


if __name__ == "__main__":
    main()
