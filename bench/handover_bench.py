"""Issue 41: the pieces of `dflash run`'s handover on one device, measured by the same protocol and code
(stages/run_expand.py): the checkpoint at the step, the stop, and the warm relaunch to the first step.

One GPU cannot hold both sides of `dflash run` (its GPU lists are disjoint), so this runs the training side: a
`dflash train` on GPU 0 (the CPU without CUDA) over a finished store, asked to hand over once it has trained
--after steps, then `dflash train --resume` on the same device; the figures are what `dflash run` records in
RUN/logs/handover.jsonl, printed and written to --out.

    python bench/handover_bench.py --root /tmp/hb --out OUT/handover.json [--set KEY=VALUE ...]
    python bench/handover_bench.py --root /tmp/hb --e2e --out OUT/handover.json   # the 27B drafter shape

`--e2e`: bench/train_e2e.py's store of random 27B-shaped features and configs/qwen3.6-27b.yaml instead of the tiny
target's extraction; both processes share one compile cache, so the relaunch is warm, as `dflash run`'s is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _wait(cond, proc: subprocess.Popen, what: str, limit: float) -> None:
    deadline = time.time() + limit
    while not cond():
        if proc.poll() is not None and not cond():
            raise SystemExit(f"handover bench: {what}: the training exited {proc.returncode} first (see its log)")
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"handover bench: {what}: not within {limit:.0f} s")
        time.sleep(0.05)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="scratch directory (the store and the run)")
    ap.add_argument("--out", required=True, help="the figures, JSON")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override (repeatable)")
    ap.add_argument("--after", type=int, default=3, help="ask for the handover once this many steps are trained")
    ap.add_argument("--limit", type=float, default=200.0, help="seconds any one phase may take")
    ap.add_argument("--e2e", action="store_true", help="the 27B drafter shape on random features (bench/train_e2e.py)")
    ap.add_argument("--samples", type=int, default=24, help="--e2e: samples of the store")
    a = ap.parse_args(argv)

    import torch

    from stages.run_expand import ENV_DIR, ENV_FIRST, FIRST_STEP, Handover, clear

    root = Path(a.root)
    store, run = root / "store.zarr", root / "run"
    logs = run / "logs"
    dev = ["--gpus", "0"] if torch.cuda.is_available() else ["--devices", "1"]
    e2e = ["target.name=bench", "target.layer_ids=[1, 16, 31, 46, 61]", "train.epochs=1000"] if a.e2e else []
    sets = [w for s in [*e2e, *a.sets, f"train.run_dir={run}", "train.val_every=100000", "train.log_every=1"]
            for w in ("--set", s)]
    cli = [sys.executable, "-m", "stages.cli"]
    env = {**os.environ, "DFLASH_COMPILE_CACHE": str(root / "compile-cache")}
    if a.e2e:
        a.config = str(ROOT / "configs" / "qwen3.6-27b.yaml")
        if not (store / "zarr.json").exists():
            from bench.train_e2e import build_store

            build_store(store, a.samples, 3072, "int5", [1, 16, 31, 46, 61], 5120, 248320)
    elif not (store / "zarr.json").exists():
        x = subprocess.run([*cli, "extract", "--config", a.config, "--store", str(store), *sets, "--shards", "1",
                            *(["--gpus", "0"] if dev[0] == "--gpus" else [])], cwd=ROOT, timeout=a.limit)
        if x.returncode:
            return x.returncode
    if run.exists():
        import shutil

        shutil.rmtree(run)
    logs.mkdir(parents=True)
    clear(logs)
    train = [*cli, "train", "--config", a.config, "--store", str(store), *sets, *dev, "--no-export"]
    log = open(logs / "bench-train.log", "ab")
    first = subprocess.Popen(train, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**env, ENV_DIR: str(logs), ENV_FIRST: str(logs / FIRST_STEP)})
    progress = run / "progress.json"

    def trained(n: int) -> bool:
        try:
            return json.loads(progress.read_text()).get("step", 0) >= n
        except (OSError, ValueError):
            return False

    _wait(lambda: (logs / FIRST_STEP).exists() and trained(a.after), first, f"{a.after} steps", a.limit)
    (logs / FIRST_STEP).unlink()
    h = Handover(logs, reason="bench: asked after warm-up")
    h.request()
    _wait(lambda: first.poll() is not None, first, "the stop", a.limit)
    h.exited_at = time.time()
    if first.returncode != 130 or h.stopped() is None:
        print(f"handover bench: the training exited {first.returncode} without its handover checkpoint", file=sys.stderr)
        return 1
    (logs / "handover-request.json").unlink()
    h.relaunched("the same device (stopped)", "the same device (resumed)")
    again = subprocess.Popen([*train, "--resume"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**env, ENV_FIRST: str(logs / FIRST_STEP)})
    _wait(lambda: (logs / FIRST_STEP).exists(), again, "the relaunch's first step", a.limit)
    rec = h.record(json.loads((logs / FIRST_STEP).read_text()))
    again.terminate()  # the figures are in; its stop keeps a checkpoint, nothing more is measured
    again.wait(timeout=a.limit)
    print(h.line())
    print(f"handover: checkpoint {rec['checkpoint_s']:.2f} s, stop {rec['stop_s']:.2f} s, relaunch to the first step "
          f"{rec['relaunch_to_first_step_s']:.2f} s; in all {rec['checkpoint_s'] + rec['stop_s'] + rec['relaunch_to_first_step_s']:.2f} s "
          f"(goal < 60 s) on {'GPU 0' if dev[0] == '--gpus' else 'the CPU'}")
    Path(a.out).write_text(json.dumps({**rec, "device": torch.cuda.get_device_name(0) if dev[0] == "--gpus" else "cpu"},
                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
