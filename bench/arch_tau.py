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

import argparse
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from encoding_tau import one_run, parse_seeds, reference_store, study_args, study_env, table

ARCHS = ("dflash", "dflash2")


def main() -> None:
    ap = argparse.ArgumentParser()
    study_args(ap, "runs/arch-tau", "0..3")
    a = ap.parse_args()
    if a.summarize:
        table([{**json.loads(x), "source": f} for f in a.summarize for x in Path(f).read_text().splitlines()
               if x.strip()], list(ARCHS), by="run", base="dflash")
        return
    env = study_env(a)
    out = Path(a.out).resolve()
    ref = reference_store(out, env)
    results = out / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    done = {(r["run"], r["seed"]) for r in rows}
    todo = [(arch, seed) for seed in parse_seeds(a.seeds) for arch in ARCHS if (arch, seed) not in done]
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = [pool.submit(one_run, out, ref, "bf16", seed, results, lock, env,
                               [*a.set, f"drafter.arch={arch}"], arch) for arch, seed in todo]
        for fut in futures:
            fut.result()
    table([json.loads(x) for x in results.read_text().splitlines()], list(ARCHS), by="run", base="dflash")


if __name__ == "__main__":
    main()
