"""Issue 19.7's study: tau when the chat template's thinking switch differs between training and serving.

On the tiny target: one store extracted with data.enable_thinking=false and one with true; per seed, a drafter
trained on each (the schedule of bench/anchor_tau.py's `fixed` arm: batch 8, num_anchors 8, --set extra), then
every drafter evaluated online against the target with prompts rendered thinking off and on (the 2 x 2 train/
serve combos, paired by seed), at eval.temperature (default 0: greedy). The offline tau is measured on the
serving template's store. What the tiny template does: thinking off puts an empty `<think></think>` after every
`<|assistant|>` (as Qwen3 does), thinking on puts nothing; the tiny target never writes reasoning, so this
measures the template mismatch alone, not reasoning text the drafter never saw. Resumable; rows in results.jsonl.

    nice -n 10 python bench/thinking_tau.py --out runs/thinking-tau --seeds 0,1 --threads 1 --cpu --set train.epochs=1
    python bench/thinking_tau.py --summarize runs/thinking-tau/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from encoding_tau import TRAIN, dflash, parse_seeds, sets, study_args, study_env

MODES = {"off": "false", "on": "true"}


def store(out: Path, mode: str, env: dict) -> Path:
    path = out / "stores" / f"thinking-{mode}.zarr"
    if not (out / "stores" / f"thinking-{mode}.done").exists():
        dflash("extract", "--store", str(path), *sets(["store.encoding=bf16", f"data.enable_thinking={MODES[mode]}"]),
               env=env, log=out / "logs" / f"extract-{mode}.log")
        (out / "stores" / f"thinking-{mode}.done").write_text("")
    return path


def summarize(rows: list[dict]) -> None:
    print(f"\n{'train':>6}{'serve':>6}{'offline tau':>14}{'online tau':>14}{'vs matched (same seed)':>26}{'seeds':>7}")
    matched = {(r["seed"], r["train"], r["temperature"]): r["online_tau"] for r in rows if r["train"] == r["serve"]}
    for tr in MODES:
        for sv in MODES:
            rs = [r for r in rows if r["train"] == tr and r["serve"] == sv]
            if not rs:
                continue
            on = [r["online_tau"] for r in rs]
            off = [r["offline_tau"] for r in rs if r["offline_tau"] is not None]
            d = [100 * (r["online_tau"] / matched[(r["seed"], sv, r["temperature"])] - 1) for r in rs
                 if (r["seed"], sv, r["temperature"]) in matched]
            cell = lambda v: f"{statistics.mean(v):.3f}±{statistics.stdev(v) if len(v) > 1 else 0:.3f}"  # noqa: E731
            print(f"{tr:>6}{sv:>6}{cell(off) if off else '-':>14}{cell(on):>14}"
                  f"{(f'{statistics.mean(d):+.1f}%' if d else '-'):>26}{len(rs):>7}")


def main() -> None:
    ap = argparse.ArgumentParser()
    study_args(ap, "runs/thinking-tau", "0,1")
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    if a.summarize:
        summarize([json.loads(x) for f in a.summarize for x in Path(f).read_text().splitlines() if x.strip()])
        return
    env = study_env(a)
    out = Path(a.out).resolve()
    stores = {m: store(out, m, env) for m in MODES}
    results = out / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    done = {(r["train"], r["serve"], r["seed"], r["temperature"]) for r in rows}
    for seed in parse_seeds(a.seeds):
        for tr in MODES:
            run = out / "runs" / f"train-{tr}-s{seed}"
            log = out / "logs" / f"train-{tr}-s{seed}.log"
            if not (run / "summary.json").exists():
                dflash("train", "--store", str(stores[tr]), *sets([*TRAIN, *a.set, "train.num_anchors=8",
                       f"data.enable_thinking={MODES[tr]}", f"train.seed={seed}", f"train.run_dir={run}"]),
                       env=env, log=log)
            for sv in MODES:
                if (tr, sv, seed, a.temperature) in done:
                    continue
                ev = run / f"eval-serve-{sv}-t{a.temperature}"
                dflash("eval", str(run / "export"), "--store", str(stores[sv]), "--online", "--out", str(ev),
                       "--max-samples", "200", *sets([f"data.enable_thinking={MODES[sv]}",
                                                      f"eval.temperature={a.temperature}"]), env=env, log=log)
                rep = json.loads((ev / "report.json").read_text())
                row = {"train": tr, "serve": sv, "seed": seed, "temperature": a.temperature,
                       "offline_tau": rep.get("offline", {}).get("tau"), "online_tau": rep["online"]["tau"],
                       "mismatches": rep["online"]["mismatches"]}
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    summarize([json.loads(x) for x in results.read_text().splitlines()])


if __name__ == "__main__":
    main()
