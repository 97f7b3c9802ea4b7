"""Issue 45 item 4, the question that decides `extract.target_precision: auto`: which capture serves an FP8 target
better, in seeded pairs on the shipped tiny target.

The tiny target and its block-FP8 copy (bench/fp8_features.write_fp8_checkpoint: 128 x 128 blocks, amax / 448,
as the releases are made). Two bf16-encoded stores of the same conversations: `bf16`, captured by the tiny
target, and `fp8`, captured by the copy under extract.target_precision=fp8-block (the served numerics,
pipeline/fp8_block.py). Per seed a drafter is trained on each store (the encoding study's schedule, --set
extra), then each drafter is evaluated online against both served targets: the bf16 target, and the FP8 copy
under eval.target_precision=fp8-block (the offline τ on the serving target's store). The table gives each
(capture, serve) cell's τ and, per serving target, the paired difference of the other capture against the
matched one. Resumable; rows in OUT/results.jsonl.

    nice -n 10 python bench/fp8_tau.py --out runs/fp8-tau --seeds 0..3 --threads 1 --cpu
    python bench/fp8_tau.py --summarize runs/fp8-tau/results.jsonl
    python bench/fp8_tau.py --out /tmp/ft --seeds 0 --cpu --set train.epochs=1 --extract-set data.max_samples=60 \
        --max-samples 20 --eval-set eval.num_prompts=4 --eval-set eval.max_new_tokens=16       # smoke run (~3 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.encoding_tau import TRAIN, dflash, parse_seeds, sets, study_args, study_env  # noqa: E402
from bench.fp8_features import write_fp8_checkpoint  # noqa: E402

KINDS = ("bf16", "fp8")


def targets(out: Path) -> dict[str, str]:
    """Each kind's target.path: the shipped tiny target, and its block-FP8 copy under OUT (made once)."""
    from pipeline.config import load_config

    tiny = load_config(str(ROOT / "configs" / "tiny.yaml")).target.path
    copy = out / "tiny-fp8"
    if not (out / "tiny-fp8.done").exists():
        write_fp8_checkpoint(Path(tiny), copy)
        (out / "tiny-fp8.done").write_text("")
    return {"bf16": str(tiny), "fp8": str(copy)}


PRECISION = {"bf16": "auto", "fp8": "fp8-block"}  # each kind's extract.target_precision and eval.target_precision


def capture(kind: str, tg: dict) -> list[str]:
    return [f"target.path={tg[kind]}", f"extract.target_precision={PRECISION[kind]}"]


def serve(kind: str, tg: dict) -> list[str]:
    """Set explicitly for every eval: an eval starts from its training run's config."""
    return [f"target.path={tg[kind]}", f"eval.target_precision={PRECISION[kind]}"]


def store(out: Path, kind: str, target: list[str], env: dict, extra: list[str]) -> Path:
    """The bf16-encoded store of `kind`'s capture (extracted once)."""
    path = out / "stores" / f"{kind}.zarr"
    if not (out / "stores" / f"{kind}.done").exists():
        dflash("extract", "--store", str(path), *sets(["store.encoding=bf16", *target, *extra]), env=env,
               log=out / "logs" / f"extract-{kind}.log")
        (out / "stores" / f"{kind}.done").write_text("")
    return path


def summarize(rows: list[dict]) -> None:
    print(f"\n{'capture':>8}{'serve':>7}{'offline tau':>14}{'online tau':>14}{'vs matched (same seed)':>26}{'seeds':>7}")
    matched = {(r["seed"], r["serve"]): r["online_tau"] for r in rows if r["capture"] == r["serve"]}
    for sv in KINDS:
        for cap in KINDS:
            rs = [r for r in rows if r["capture"] == cap and r["serve"] == sv]
            if not rs:
                continue
            on = [r["online_tau"] for r in rs]
            off = [r["offline_tau"] for r in rs if r["offline_tau"] is not None]
            d = [100 * (r["online_tau"] / matched[(r["seed"], sv)] - 1) for r in rs if (r["seed"], sv) in matched]
            cell = lambda v: f"{statistics.mean(v):.3f}±{statistics.stdev(v) if len(v) > 1 else 0:.3f}"  # noqa: E731
            print(f"{cap:>8}{sv:>7}{cell(off) if off else '-':>14}{cell(on):>14}"
                  f"{(f'{statistics.mean(d):+.2f}%' if d else '-'):>26}{len(rs):>7}")


def main() -> None:
    ap = argparse.ArgumentParser()
    study_args(ap, "runs/fp8-tau", "0,1")
    ap.add_argument("--max-samples", default="200", help="eval: validation samples for the offline tau")
    ap.add_argument("--eval-set", action="append", default=[], help="extra eval override (smoke runs: "
                    "eval.num_prompts=4)")
    a = ap.parse_args()
    if a.summarize:
        summarize([json.loads(x) for f in a.summarize for x in Path(f).read_text().splitlines() if x.strip()])
        return
    env = study_env(a)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tg = targets(out)
    stores = {k: store(out, k, capture(k, tg), env, a.extract_set) for k in KINDS}
    results = out / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    done = {(r["capture"], r["serve"], r["seed"]) for r in rows}
    for seed in parse_seeds(a.seeds):
        for cap in KINDS:
            run = out / "runs" / f"capture-{cap}-s{seed}"
            log = out / "logs" / f"capture-{cap}-s{seed}.log"
            if not (run / "summary.json").exists():
                dflash("train", "--store", str(stores[cap]), *sets([*TRAIN, *a.set, f"target.path={tg[cap]}", f"train.seed={seed}",
                                                                     f"train.run_dir={run}"]), env=env, log=log)
            for sv in KINDS:
                if (cap, sv, seed) in done:
                    continue
                ev = run / f"eval-serve-{sv}"
                dflash("eval", str(run / "export"), "--store", str(stores[sv]), "--online", "--out", str(ev),
                       "--max-samples", a.max_samples, *sets([*serve(sv, tg), *a.eval_set]), env=env, log=log)
                rep = json.loads((ev / "report.json").read_text())
                row = {"capture": cap, "serve": sv, "seed": seed, "offline_tau": rep.get("offline", {}).get("tau"),
                       "online_tau": rep["online"]["tau"], "mismatches": rep["online"]["mismatches"]}
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    summarize([json.loads(x) for x in results.read_text().splitlines()])


if __name__ == "__main__":
    main()
