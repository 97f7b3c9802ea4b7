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

import argparse
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from encoding_tau import one_run, parse_seeds, reference_store, study_args, study_env, table

RULES = {
    "fixed": ["train.num_anchors=8"],
    "proportional": ["train.anchor_rule=proportional", "train.anchors_per_token=0.21", "train.num_anchors=24"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    study_args(ap, "runs/anchor-tau", "0..3")
    a = ap.parse_args()
    if a.summarize:
        table([{**json.loads(x), "source": f} for f in a.summarize for x in Path(f).read_text().splitlines()
               if x.strip()], list(RULES), by="run", base="fixed")
        return
    env = study_env(a)
    out = Path(a.out).resolve()
    ref = reference_store(out, env)
    results = out / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    done = {(r["run"], r["seed"]) for r in rows}
    todo = [(rule, seed) for seed in parse_seeds(a.seeds) for rule in RULES if (rule, seed) not in done]
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = [pool.submit(one_run, out, ref, "bf16", seed, results, lock, env, [*a.set, *RULES[rule]], rule)
                   for rule, seed in todo]
        for fut in futures:
            fut.result()
    table([json.loads(x) for x in results.read_text().splitlines()], list(RULES), by="run", base="fixed")


if __name__ == "__main__":
    main()
