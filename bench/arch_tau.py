"""Issue 20's study: does DFlash 2 pay on the tiny target? Paired seeded runs, dflash vs dflash2.

Mirrors bench/encoding_tau.py (and uses its pieces): one bf16 store of the tiny target; for each seed, a DFlash
and a DFlash 2 drafter trained from it with the same schedule (batch 8 x 3 epochs: the same steps, data order,
anchors and, through train.seed, the same initial backbone: DFlash 2 starts as its DFlash backbone), each
evaluated offline (uniform anchors and the serving walk, on the store's validation split) and online against
the target (lossless decoding, tau = tokens per verify step). Prints each measure's mean per arch and the
paired difference dflash2 vs dflash in percent with its 95% interval. Resumable: finished runs are reused;
seed-major, so a run cut short leaves whole pairs.

    nice -n 10 python bench/arch_tau.py --out runs/arch-tau --seeds 0..9 --jobs 2 --threads 1 --cpu
    python bench/arch_tau.py --summarize runs/arch-tau/results.jsonl
    python bench/arch_tau.py --out /tmp/smoke --seeds 0 --set train.max_steps=2   # smoke run
"""

from __future__ import annotations

from encoding_tau import paired_study

ARCHS = ("dflash", "dflash2")


def main() -> None:
    paired_study("runs/arch-tau", "0..3", {arch: [f"drafter.arch={arch}"] for arch in ARCHS}, base="dflash")


if __name__ == "__main__":
    main()
