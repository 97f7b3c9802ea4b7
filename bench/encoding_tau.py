"""Issue 7's deciding measurement: tau of drafters trained from each feature encoding, several seeds.

On the shipped tiny target: one bf16 store (the lossless reference) is extracted, every other encoding is
made from it with `dflash recode` (so all stores hold the same samples), then for each encoding and seed a
drafter is trained with the demo schedule (batch 8 x 3 epochs) and evaluated offline on the *bf16* store's
validation split and online against the target (serving hands the drafter exact bf16 features, whatever the
training store held). Prints mean and spread per encoding. Resumable: finished runs are reused.

    python bench/encoding_tau.py --out runs/encoding-tau --encodings bf16,fp8,int6,int5,int4 --seeds 0,1,2
    python bench/encoding_tau.py --out runs/tau-gpu --encodings bf16,int5 --seeds 0..19 --jobs 8 --threads 2  # GPU
    python bench/encoding_tau.py --encodings bf16,int5 --summarize A.jsonl B.jsonl  # pairs from several machines
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["train.batch_size=8", "train.epochs=3", "train.val_every=100000", "train.num_workers=0"]


def dflash(*args: str, env: dict | None = None, log: Path | None = None) -> None:
    """Run one dflash command; with `log` its output goes there (runs side by side would interleave)."""
    cmd = [sys.executable, "-m", "stages.cli", *args]
    print("+ dflash " + " ".join(args), flush=True)
    full_env = {**os.environ, **(env or {})}
    if log is None:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=full_env)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=full_env).returncode:
            raise RuntimeError(f"dflash {args[0]} failed; its output is in {log}")


def sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def one_run(out: Path, ref: Path, enc: str, seed: int, results: Path, lock: threading.Lock, env: dict,
            extra: list[str], name: str | None = None) -> dict:
    """Train (unless done) and evaluate the drafter of one (encoding, seed); append its row to results.
    name: the run's name when several variants train from one encoding (bench/arch_tau.py), in the row as "run"."""
    store = out / "stores" / f"{enc}.zarr"
    tag = f"{name or enc}-s{seed}"
    run = out / "runs" / tag
    if not (run / "summary.json").exists():
        dflash("train", "--store", str(store), *sets([*TRAIN, *extra, f"train.seed={seed}", f"train.run_dir={run}"]),
               env=env, log=out / "logs" / f"{tag}.log")
    ev = run / "eval"
    dflash("eval", str(run / "export"), "--store", str(ref), "--online", "--out", str(ev), env=env,
           log=out / "logs" / f"{tag}.log")
    rep = json.loads((ev / "report.json").read_text())
    row = {"encoding": enc, **({"run": name} if name else {}), "seed": seed, "offline_tau": rep["offline"]["tau"],
           "serving_walk_tau": rep["offline"]["serving_walk"]["tau"], "online_tau": rep["online"]["tau"],
           "lossless": rep["online"]["mismatches"] == 0, "store_bytes_per_token": _bpt(store)}
    with lock, results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def parse_seeds(text: str) -> list[int]:
    """'0,3..5' -> [0, 3, 4, 5]."""
    out = []
    for item in text.split(","):
        lo, _, hi = item.partition("..")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def study_args(ap: argparse.ArgumentParser, out: str, seeds: str) -> None:
    """The options of a paired seeded study (this one and bench/arch_tau.py)."""
    ap.add_argument("--out", default=out)
    ap.add_argument("--seeds", default=seeds, help="comma list of seeds or ranges: 0,1,2 or 0..19 or 0,10..21")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (on a GPU several tiny drafters share it)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per run (OMP_NUM_THREADS); 0 = torch's default")
    ap.add_argument("--cpu", action="store_true", help="hide the GPUs (the CPU results in docs/benchmarks.md)")
    ap.add_argument("--set", action="append", default=[], help="extra training override (smoke runs)")
    ap.add_argument("--extract-set", action="append", default=[],
                    help="extra override of the reference store's extraction (smoke runs: data.max_samples=120)")
    ap.add_argument("--summarize", nargs="+", metavar="RESULTS_JSONL", help="only print the table of these "
                    "results files together (runs pair with the reference run of their seed in the same file)")


def study_env(a: argparse.Namespace) -> dict:
    env = {"OMP_NUM_THREADS": str(a.threads)} if a.threads else {}
    if a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def main() -> None:
    ap = argparse.ArgumentParser()
    study_args(ap, "runs/encoding-tau", "0,1,2")
    ap.add_argument("--encodings", default="bf16,fp8,int6,int5,int4")
    ap.add_argument("--min-tau", type=float, default=None, help="with --summarize: also the paired differences "
                    "over the seeds whose runs all reach this offline tau (a sensitivity view: some seeds of the "
                    "tiny drafter end in a worse basin, tau ~4.0-4.3, whatever the encoding)")
    a = ap.parse_args()
    if a.summarize:
        rows = [{**json.loads(x), "source": f} for f in a.summarize for x in Path(f).read_text().splitlines() if x.strip()]
        table(rows, a.encodings.split(","))
        if a.min_tau is not None:
            low = {(r["source"], r["seed"]) for r in rows if r["offline_tau"] < a.min_tau}
            print(f"\nwithout the {len(low)} seeds where a run ended below offline tau {a.min_tau}:")
            table([r for r in rows if (r["source"], r["seed"]) not in low], a.encodings.split(","))
        return
    seeds = parse_seeds(a.seeds)
    encodings = a.encodings.split(",")
    env = study_env(a)
    out = Path(a.out).resolve()
    ref = reference_store(out, env, a.extract_set)
    for enc in encodings:
        if enc != "bf16" and not (out / "stores" / f"{enc}.done").exists():
            dflash("recode", str(ref), str(out / "stores" / f"{enc}.zarr"), "--encoding", enc, env=env)
            (out / "stores" / f"{enc}.done").write_text("")
    results = out / "results.jsonl"
    done = {(r["encoding"], r["seed"]) for r in map(json.loads, results.read_text().splitlines())} if results.exists() else set()
    # seed-major order: the pairs (same seed, every encoding) complete together, so a run cut short still
    # leaves whole pairs to compare
    todo = [(enc, seed) for seed in seeds for enc in encodings if (enc, seed) not in done]
    lock = threading.Lock()
    if todo and not a.cpu:  # on a GPU the first run goes alone: it fills the compile cache the others reuse
        one_run(out, ref, *todo.pop(0), results, lock, env, a.set)
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for fut in [pool.submit(one_run, out, ref, enc, seed, results, lock, env, a.set) for enc, seed in todo]:
            fut.result()
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    table(rows, encodings)


def paired_study(out_default: str, seeds_default: str, variants: dict[str, list[str]], base: str) -> None:
    """The main() of a paired study of training variants on the one bf16 store (bench/arch_tau.py,
    bench/anchor_tau.py): per seed one run per variant (its training overrides), seed-major, resumable; then
    the table of each measure per variant and the paired difference to `base`."""
    ap = argparse.ArgumentParser()
    study_args(ap, out_default, seeds_default)
    a = ap.parse_args()
    if a.summarize:
        table([{**json.loads(x), "source": f} for f in a.summarize for x in Path(f).read_text().splitlines()
               if x.strip()], list(variants), by="run", base=base)
        return
    env = study_env(a)
    out = Path(a.out).resolve()
    ref = reference_store(out, env, a.extract_set)
    results = out / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    done = {(r["run"], r["seed"]) for r in rows}
    todo = [(name, seed) for seed in parse_seeds(a.seeds) for name in variants if (name, seed) not in done]
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = [pool.submit(one_run, out, ref, "bf16", seed, results, lock, env, [*a.set, *variants[name]], name)
                   for name, seed in todo]
        for fut in futures:
            fut.result()
    table([json.loads(x) for x in results.read_text().splitlines()], list(variants), by="run", base=base)


def reference_store(out: Path, env: dict, extra: list[str] = ()) -> Path:
    """The lossless bf16 store of the tiny target's conversations (extracted once; `extra`: more overrides)."""
    ref = out / "stores" / "bf16.zarr"
    if not (out / "stores" / "bf16.done").exists():
        dflash("extract", "--store", str(ref), *sets(["store.encoding=bf16", *extra]), env=env)
        (out / "stores" / "bf16.done").write_text("")
    return ref


def table(rows: list[dict], encodings: list[str], by: str = "encoding", base: str = "bf16") -> None:
    """Mean ± sd over seeds, and the difference to bf16 at the same seed, mean ± sd in percent. The seed fixes
    the data order and anchors, and (since train.seed seeds the initial weights; runs made before that had
    unseeded weights) the initialisation; the measured spread of the difference shows how little cancels."""
    keys = ("offline_tau", "serving_walk_tau", "online_tau")
    # a run pairs with the bf16 run of its seed from the same source (machine): CPU results repeat bit for
    # bit on one machine, not across machines
    ref = {_pair(r, k): r[k] for r in rows if r[by] == base for k in keys}
    print(f"\n{by:<9}{'B/token':>9}" + "".join(f"{k:>32}" for k in keys) + f"{'seeds':>7}")
    for enc in encodings:
        rs = [r for r in rows if r[by] == enc]
        if not rs:
            continue
        cells = []
        for k in keys:
            v = [r[k] for r in rs]
            d = [100 * (r[k] / ref[_pair(r, k)] - 1) for r in rs if _pair(r, k) in ref]
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            dm, dsd = (statistics.mean(d), statistics.stdev(d) if len(d) > 1 else 0.0) if d else (float("nan"), 0.0)
            cells.append(f"{statistics.mean(v):.3f}±{sd:.3f} ({dm:+.1f}±{dsd:.1f}%)")
        print(f"{enc:<9}{rs[0]['store_bytes_per_token']:>9.0f}" + "".join(f"{c:>32}" for c in cells) + f"{len(rs):>7}")
    for enc in encodings:  # the paired difference's 95% interval: is a 1% difference resolved?
        if enc == base:
            continue
        for k in keys:
            d = [100 * (r[k] / ref[_pair(r, k)] - 1) for r in rows if r[by] == enc and _pair(r, k) in ref]
            if len(d) > 1:
                half = _t975(len(d) - 1) * statistics.stdev(d) / len(d) ** 0.5
                m = statistics.mean(d)
                print(f"{enc} vs {base}, {k}: {m:+.2f}% (95% interval {m - half:+.2f} .. {m + half:+.2f}%, {len(d)} pairs)")


_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
         15: 2.13, 19: 2.09, 24: 2.06, 29: 2.05}


def _pair(row: dict, key: str) -> tuple:
    """What a run pairs on: its results file (machine), seed and measure."""
    return row.get("source"), row["seed"], key


def _t975(df: int) -> float:
    """Student's t 97.5% quantile (two-sided 95%), from the table at the nearest df not above (conservative)."""
    return _T975[max(k for k in _T975 if k <= df)] if df < 30 else 1.96 + 2.4 / df


def _bpt(store: Path) -> float:
    from stages.inspect import store_summary

    s = store_summary(str(store))
    return s["disk_bytes"] / max(1, s["tokens"])


if __name__ == "__main__":
    main()
