"""Issue 17's quality check: does a drafter trained while following the extraction reach the tau of one trained
after it? Paired by seed on the shipped tiny target (CPU).

Per seed: (a) "after": `dflash train` on a finished bf16 store; (b) "following": a fresh extraction of the same
data started together with `dflash train --follow` (same seed and schedule: the demo's batch 8 x 3 epochs),
which trains its first epoch in commit order while the store grows. Both drafters are evaluated offline on
the finished store's validation split (`dflash eval`: tau with uniform anchors and the serving walk). Prints
each pair, how much of the following run's first epoch was trained before its extraction finished, and the
paired difference with a 95% interval. Resumable: finished runs are reused.

    nice -n 10 python bench/follow_tau.py --out runs/follow-tau --seeds 0..3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.encoding_tau import _t975, dflash, parse_seeds, sets  # noqa: E402

TRAIN = ["train.batch_size=8", "train.epochs=3", "train.val_every=100000", "train.num_workers=1"]


def evaluate(run: Path, ref: Path, env: dict, log: Path) -> dict:
    ev = run / "eval"
    if not (ev / "report.json").exists():
        dflash("eval", str(run / "export"), "--store", str(ref), "--out", str(ev), env=env, log=log)
    off = json.loads((ev / "report.json").read_text())["offline"]
    return {"offline_tau": off["tau"], "serving_walk_tau": off["serving_walk"]["tau"]}


def following(out: Path, seed: int, env: dict, delay: float, extra: list[str], extract_sets: list[str]) -> dict:
    """A fresh extraction and `train --follow` started together; returns timing facts of the overlap."""
    store, run, log = out / "stores" / f"follow-s{seed}.zarr", out / "runs" / f"follow-s{seed}", out / "logs" / f"follow-s{seed}.log"
    facts = out / "runs" / f"follow-s{seed}.json"
    if facts.exists():
        return json.loads(facts.read_text())
    log.parent.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "stages.cli"]
    with log.open("a") as f:
        t0 = time.time()
        x = subprocess.Popen(py + ["extract", "--store", str(store), *sets(extract_sets)], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, **env, "DFLASH_TEST_EXTRACT_DELAY": str(delay)})
        t = subprocess.Popen(py + ["train", "--follow", "--store", str(store), *sets([*TRAIN, *extra, f"train.seed={seed}",
                             f"train.run_dir={run}"])], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, **env, "DFLASH_SAMPLE_LOG": "1"})
        if x.wait() != 0:
            t.kill()
            raise RuntimeError(f"extraction failed; see {log}")
        x_end = time.time()
        if t.wait() != 0:
            raise RuntimeError(f"training failed; see {log}")
    lines = [json.loads(s) for s in (run / "logs" / "samples-rank0.jsonl").read_text().splitlines()]
    first = [b for b in lines if b["epoch"] == 0]
    r = {"extract_s": x_end - t0, "train_s": time.time() - t0, "first_step_s": lines[0]["t"] - t0,
         "epoch0_batches": len(first), "epoch0_before_extraction_end": sum(b["t"] < x_end for b in first)}
    facts.write_text(json.dumps(r))
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/follow-tau")
    ap.add_argument("--seeds", default="0..3")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds each extraction batch waits (a slower target)")
    ap.add_argument("--set", action="append", default=[], help="extra training override (smoke runs)")
    ap.add_argument("--extract-set", action="append", default=[], help="extra override for both stores (smoke runs)")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    env = {"CUDA_VISIBLE_DEVICES": ""}
    extra = a.set + a.extract_set
    ref = out / "stores" / "after.zarr"
    if not (out / "stores" / "after.done").exists():
        dflash("extract", "--store", str(ref), *sets(a.extract_set), env=env)
        (out / "stores" / "after.done").write_text("")
    results = out / "results.jsonl"
    done = {r["seed"] for r in map(json.loads, results.read_text().splitlines())} if results.exists() else set()
    for seed in parse_seeds(a.seeds):
        if seed in done:
            continue
        log = out / "logs" / f"after-s{seed}.log"
        after = out / "runs" / f"after-s{seed}"
        if not (after / "summary.json").exists():
            dflash("train", "--store", str(ref), *sets([*TRAIN, *extra, f"train.seed={seed}", f"train.run_dir={after}"]),
                   env=env, log=log)
        facts = following(out, seed, env, a.delay, extra, a.extract_set)
        row = {"seed": seed, "after": evaluate(after, ref, env, log),
               "following": evaluate(out / "runs" / f"follow-s{seed}", ref, env, out / "logs" / f"follow-s{seed}.log"),
               **facts}
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    summarize([json.loads(x) for x in results.read_text().splitlines()])


def summarize(rows: list[dict]) -> None:
    for k in ("offline_tau", "serving_walk_tau"):
        a = [r["after"][k] for r in rows]
        f = [r["following"][k] for r in rows]
        d = [100 * (y / x - 1) for x, y in zip(a, f)]
        m = statistics.mean(d)
        half = _t975(len(d) - 1) * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        sa = statistics.stdev(a) if len(a) > 1 else 0.0
        print(f"{k}: after extraction {statistics.mean(a):.3f} ± {sa:.3f}, following {statistics.mean(f):.3f}; "
              f"following vs after {m:+.2f}% (95% interval {m - half:+.2f} .. {m + half:+.2f}%, {len(d)} pairs)")
    share = [r["epoch0_before_extraction_end"] / max(1, r["epoch0_batches"]) for r in rows]
    print(f"first epoch trained before its extraction finished: {', '.join(f'{100 * s:.0f}%' for s in share)}; "
          f"first step {statistics.mean(r['first_step_s'] for r in rows):.0f} s after the start, extraction took "
          f"{statistics.mean(r['extract_s'] for r in rows):.0f} s")


if __name__ == "__main__":
    main()
