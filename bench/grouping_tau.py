"""Does grouping batches by length cost tau? Paired seeded runs, train.length_group_factor 32 vs 0.

Issue 17's study (bench/follow_tau.py) found a drafter trained while following the extraction ~7% better in tau
than one trained after it, and its likely cause was batch composition: the "after" run's epochs are sorted by
length inside windows of 32 batches (so each batch holds similar lengths), the following run's first epoch
takes the samples close to commit order. This study isolates that: one bf16 store of the tiny target, per
seed two drafters with the same schedule, seed and initial weights, differing only in the epoch plan:
  grouped:  train.length_group_factor = 32 (the default: little padding per batch);
  plain:    train.length_group_factor = 0 (batches of the shuffled order, any lengths together).
Evaluated offline (uniform anchors and the serving walk, validation split) and online against the target.
Prints each measure's mean per variant and the paired difference plain vs grouped. Resumable.

    nice -n 10 python bench/grouping_tau.py --out runs/grouping-tau --seeds 0..3 --jobs 2 --threads 1 --cpu \
        --set train.epochs=1
    python bench/grouping_tau.py --out /tmp/smoke --seeds 0 --set train.max_steps=2   # smoke run
"""

from __future__ import annotations

from encoding_tau import paired_study

VARIANTS = {
    "grouped": ["train.length_group_factor=32"],
    "plain": ["train.length_group_factor=0"],
}


def main() -> None:
    paired_study("runs/grouping-tau", "0..3", VARIANTS, base="grouped")


if __name__ == "__main__":
    main()
