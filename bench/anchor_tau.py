"""Issue 19.3's study: anchors per document. Paired seeded runs, anchor rule fixed vs proportional.

Mirrors bench/arch_tau.py (and uses bench/encoding_tau.py's pieces): one bf16 store of the tiny target; for each
seed two drafters trained with the same schedule, data order and initial weights, differing only in how many
anchors each sample gets:
  fixed:         train.num_anchors = 8 per sample (the tiny conversations have 16-90 labelled tokens, so the
                 fixed rule spends as much on a 16-token answer as on a 90-token one);
  proportional:  train.anchor_rule = proportional at 0.21 anchors per labelled token (cap 24), which gives the
                 same mean anchors per sample (~8.1 against 8.0 on the tiny store): the same budget, spread by
                 each sample's labelled tokens.
(At the tiny config's own num_anchors = 32 the fixed rule already takes almost every candidate position of
these short conversations, so the two rules would hardly differ.) Each drafter is evaluated offline (uniform
anchors and the serving walk, validation split) and online against the target. Prints each measure's mean per
rule and the paired difference proportional vs fixed in percent with its 95% interval. Resumable.

    nice -n 10 python bench/anchor_tau.py --out runs/anchor-tau --seeds 0..3 --jobs 2 --threads 1 --cpu \
        --set train.epochs=1
    python bench/anchor_tau.py --summarize runs/anchor-tau/results.jsonl
    python bench/anchor_tau.py --out /tmp/smoke --seeds 0 --set train.max_steps=2   # smoke run
"""

from __future__ import annotations

from encoding_tau import paired_study

RULES = {
    "fixed": ["train.num_anchors=8"],
    "proportional": ["train.anchor_rule=proportional", "train.anchors_per_token=0.21", "train.num_anchors=24"],
}


def main() -> None:
    paired_study("runs/anchor-tau", "0..3", RULES, base="fixed")


if __name__ == "__main__":
    main()
