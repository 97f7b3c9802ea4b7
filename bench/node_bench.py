"""Issue 34: the owner's node, measured with the real CLI on one 8-GPU machine.

Phases (`--phases`, in this order; each reads what the ones before it left under --root, so two device calls
can split them, each under the device's 10-minute limit):
  prepare  a random checkpoint of the real Qwen3.5/3.6-27B layout (bench/load_bench.write_checkpoint: 64 layers,
           ~54 GB, `Qwen3_5ForConditionalGeneration` layout) with the project's shipped tokenizer, and a
           conversation set of the long mix (SpecForge's recipe: mean ~4.5K tokens, max 8K; random words of that
           tokenizer, one token each). Kept when it is already there.
  run      `dflash run --extract-gpus 0-4 --train-gpus 5-7` from an empty store, stopped after --run-s once
           training steps (Ctrl-C to the group, as a user stops it).
  extract  `dflash extract --shards 5` alone on GPUs 0-4 into a new store, to the end (it is the store `train`
           reads).
  train    `dflash train --gpus 5,6,7` alone on that finished store for --train-s, then `--gpus 5` alone (the
           1-GPU rate the 3-rank DDP scaling is measured against).
Measured, from the processes' own files (never from their speed claims): per-shard extraction tokens/s from
the store's commit records (sampled every second), training steps/s and samples/s from RUN/progress.json, the
host's used-memory and page-cache peaks (/proc/meminfo), the time from launch to the first optimizer step,
and whether training waited for extraction (its "waiting for extraction" line). Each stage while the other
runs is reported as a fraction of its solo rate; goals (issue 34): >= 0.95 each, 3-rank scaling >= 0.95.

    NODE_PHASES=prepare bash bench/device_run.sh node8   # nvidia-h200-x8; one call per phase (10-minute limit),
    NODE_PHASES=run bash bench/device_run.sh node8       # back to back on the same warm machine (the checkpoint
    NODE_PHASES=extract bash bench/device_run.sh node8   # and stores stay under out/node8)
    NODE_PHASES=train bash bench/device_run.sh node8
    python bench/node_bench.py --tiny --root /tmp/nb             # CPU smoke run: tiny target, CPU processes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = ("prepare", "run", "extract", "train")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


# ---- what a phase starts ---------------------------------------------------------------------------------------

def sets(a, store: Path, run: Path) -> list[str]:
    """The --set options every command of the bench shares (the target, data, store and run it uses)."""
    s = [f"target.path={a.root / 'target'}", "target.name=bench-27b-random", f"data.train_files=[{a.root / 'data.jsonl'}]",
         "data.validation_files=[]", "data.validation_fraction=0.0", f"data.max_length={a.max_len}",
         f"store.path={store}", f"train.run_dir={run}", "train.epochs=100", "train.log_every=1",
         "train.checkpoint_every=1000000", "train.val_every=1000000", "train.follow_buffer=16", *a.extra_set]
    return [x for v in s for x in ("--set", v)]


def gpus_or_cpu(a, flag: str, gpus: str) -> list[str]:
    """`--gpus 5,6,7`-style options on the GPU machine; the CPU processes of the smoke run otherwise."""
    if a.device == "cuda":
        return [flag, gpus]
    n = len(gpus.replace("-", ",").split(","))
    return {"--extract-gpus": [], "--train-gpus": ["--devices", str(min(n, 2))], "--gpus": ["--devices", str(min(n, 2))],
            "--shards": ["--shards", "2"]}[flag]


def command(a, stage: str, store: Path, run: Path, **kw) -> list[str]:
    cli = [sys.executable, "-m", "stages.cli"]
    if stage == "run":
        return [*cli, "run", "--config", a.config, *gpus_or_cpu(a, "--extract-gpus", kw["extract"]),
                *gpus_or_cpu(a, "--train-gpus", kw["train"]), *sets(a, store, run)]
    if stage == "extract":
        return [*cli, "extract", "--config", a.config, *gpus_or_cpu(a, "--shards", str(kw["shards"])),
                *sets(a, store, run), *[x for v in a.solo_extract_set for x in ("--set", v)]]
    return [*cli, "train", "--config", a.config, "--no-export", *gpus_or_cpu(a, "--gpus", kw["gpus"]),
            *sets(a, store, run)]


# ---- what a phase measures -------------------------------------------------------------------------------------

class Watch:
    """Samples, once a second, the store's per-shard committed tokens, the run's progress record and
    /proc/meminfo, until stopped."""

    def __init__(self, store: Path, run: Path):
        self.store, self.run = store, run
        self.commits: list[tuple[float, list[int]]] = []
        self.progress: list[tuple[float, int]] = []
        self.mem = {"used_peak_gb": 0.0, "cached_peak_gb": 0.0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        from pipeline import store as st

        while not self._stop.wait(1.0):
            now = time.time()
            try:
                states = st.read_all_progress(str(self.store))
                self.commits.append((now, [s.progress.committed_tokens if s.progress else 0 for s in states]))
            except Exception:  # noqa: BLE001 - not created yet, or a record being replaced
                pass
            try:
                rec = json.loads((self.run / "progress.json").read_text())
                if rec.get("state") == "running" and (not self.progress or rec["step"] != self.progress[-1][1]):
                    self.progress.append((float(rec["time"]), int(rec["step"])))
            except (OSError, ValueError, KeyError):
                pass
            info = meminfo()
            if info:
                self.mem["used_peak_gb"] = max(self.mem["used_peak_gb"], info["used_gb"])
                self.mem["cached_peak_gb"] = max(self.mem["cached_peak_gb"], info["cached_gb"])

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)

    def extract_rates(self, skip: int = 3, window: tuple = (0.0, float("inf"))) -> list[float]:
        """Per shard: tokens/s from its first commit after `skip` samples of growth to its last growth, counting
        only the samples inside `window` (unix times: the run phase's time both stages were working)."""
        if not self.commits:
            return []
        out = []
        for i in range(len(self.commits[-1][1])):
            series = [(t, c[i]) for t, c in self.commits if i < len(c) and window[0] <= t <= window[1]]
            grew = [(t, k) for (t, k), (_, k0) in zip(series[1:], series[:-1]) if k > k0]
            if len(grew) < 2:
                out.append(float("nan"))
                continue
            (ta, ka), (tb, kb) = grew[min(skip, len(grew) - 2)], grew[-1]  # (a smoke run commits a few times)
            out.append((kb - ka) / max(1e-9, tb - ta))
        return out

    def train_rate(self, skip: int = 2) -> float:
        """Optimizer steps/s over the progress records after the first `skip` (compile, warm-up)."""
        p = self.progress
        if len(p) < skip + 2:
            return float("nan")
        (ta, sa), (tb, sb) = p[skip], p[-1]
        return (sb - sa) / max(1e-9, tb - ta)


def meminfo() -> dict:
    try:
        kv = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()}
    except (OSError, ValueError, IndexError):
        return {}
    return {"used_gb": (kv["MemTotal"] - kv["MemAvailable"]) / 2**20, "cached_gb": kv.get("Cached", 0) / 2**20}


def launch(cmd: list[str], log: Path, env: dict) -> tuple[subprocess.Popen, float]:
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True), time.time()


def stop(p: subprocess.Popen, how=signal.SIGINT, wait_s: float = 120.0) -> int:
    """Ctrl-C to the process group (what a user does), then SIGKILL if it has not left within `wait_s`."""
    if p.poll() is None:
        os.killpg(p.pid, how)
        try:
            p.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode


def samples_per_step(a, ranks: int) -> int:
    from pipeline.config import load_config

    t = load_config(a.config, [v for v in sets(a, a.root / "s", a.root / "r")[1::2]]).train
    return t.batch_size * t.accumulate_grad_batches * ranks


def _timed_train(a, store: Path, run: Path, gpus: str, env: dict, log: Path) -> dict:
    shutil.rmtree(run, ignore_errors=True)
    w = Watch(store, run)
    p, t0 = launch(command(a, "train", store, run, gpus=gpus), log, env)
    deadline = t0 + a.train_s + a.startup_s
    while p.poll() is None and time.time() < deadline and not (
            w.progress and w.progress[-1][0] - w.progress[0][0] >= a.train_s):
        time.sleep(1)
    stop(p, signal.SIGKILL)  # no final checkpoint (21 GB at this shape): not what is measured
    w.stop()
    ranks = len(gpus.split(",")) if a.device == "cuda" else min(len(gpus.split(",")), 2)
    rate = w.train_rate()
    return {"gpus": gpus, "steps_s": rate, "samples_s": rate * samples_per_step(a, ranks), "steps": len(w.progress),
            "first_step_after_launch_s": w.progress[0][0] - t0 if w.progress else None, "host": w.mem}


# ---- the phases ------------------------------------------------------------------------------------------------

def prepare(a, env: dict) -> dict:
    target = a.root / "target"
    if not (target / ".complete").exists():
        from bench.load_bench import write_checkpoint

        shutil.rmtree(target, ignore_errors=True)
        t = time.time()
        total = write_checkpoint(target, a.layers, a.tiny, a.device, shard_gb=5.0)
        for name in TOKENIZER_FILES:
            shutil.copy(ROOT / "data" / "assets" / "tiny-target" / name, target / name)
        (target / ".complete").write_text("")
        print(f"prepare: checkpoint {total / 1e9:.1f} GB in {time.time() - t:.0f} s -> {target}", flush=True)
    data = a.root / "data.jsonl"
    if not data.exists():
        vocab = [w for w in json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]
                 if w.isalpha() and w.islower()]
        g = np.random.default_rng(0)
        lengths = np.clip(g.normal(a.mean_len, a.mean_len / 3, a.samples), a.max_len / 16, a.max_len - 64).astype(int)
        with open(data, "w") as f:
            for n in lengths:
                words, k = g.choice(vocab, int(n)), min(32, int(n) // 4)  # a short prompt, a long answer
                f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[:k])},
                                                 {"role": "assistant", "content": " ".join(words[k:])}]}) + "\n")
        print(f"prepare: {a.samples} conversations, mean {lengths.mean():.0f} words -> {data}", flush=True)
    return {"samples": a.samples, "mean_len": a.mean_len, "max_len": a.max_len}


def run_both(a, env: dict) -> dict:
    store, run = a.root / "run.zarr", a.root / "run-train"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    w = Watch(store, run)
    p, t0 = launch(command(a, "run", store, run, extract="0-4", train="5-7"), a.root / "logs" / "run.log", env)
    deadline = t0 + a.run_s + a.startup_s
    while p.poll() is None and time.time() < deadline and not (
            w.progress and w.progress[-1][0] - w.progress[0][0] >= a.run_s):
        time.sleep(1)
    code = stop(p)
    w.stop()
    train_log = (run / "logs" / "run-train.log")
    waited = train_log.exists() and "waiting for extraction" in train_log.read_text(errors="replace")
    ranks = 3 if a.device == "cuda" else 2
    rate = w.train_rate()
    both = (w.progress[min(2, len(w.progress) - 1)][0], w.progress[-1][0]) if w.progress else (0.0, 0.0)
    return {"exit": code, "extract_tokens_s": w.extract_rates(skip=0, window=both), "train_steps_s": rate,
            "train_samples_s": rate * samples_per_step(a, ranks), "train_steps": len(w.progress),
            "launch_to_training_s": w.progress[0][0] - t0 if w.progress else None, "train_waited": waited,
            "host": w.mem}


def extract_alone(a, env: dict) -> dict:
    store = a.root / "solo.zarr"
    shutil.rmtree(store, ignore_errors=True)
    w = Watch(store, a.root / "no-run")
    p, t0 = launch(command(a, "extract", store, a.root / "no-run", shards=5), a.root / "logs" / "extract.log", env)
    while p.poll() is None and time.time() < t0 + a.extract_limit_s:
        time.sleep(1)
    code = stop(p) if p.poll() is None else p.returncode
    w.stop()
    return {"exit": code, "wall_s": time.time() - t0, "tokens_s": w.extract_rates(), "host": w.mem}


def train_alone(a, env: dict) -> dict:
    """Training alone on 3 GPUs, then on 1. The CPU smoke run (--tiny) runs the two side by side, each with its own
    run dir and log: the same commands, and a CPU rate means nothing (tests/test_bench_parts.py runs this part
    alone, and a 1-rank run's start-up leaves a core idle)."""
    store = a.root / "solo.zarr"
    runs = [(a.root / "solo-train3", "5,6,7", a.root / "logs" / "train3.log"),
            (a.root / "solo-train1", "5", a.root / "logs" / "train1.log")]
    with ThreadPoolExecutor(max_workers=2 if a.tiny else 1) as pool:
        three, one = pool.map(lambda r: _timed_train(a, store, r[0], r[1], env, r[2]), runs)
    scaling = three["samples_s"] / (3 * one["samples_s"]) if a.device == "cuda" else float("nan")
    return {"three": three, "one": one, "ddp3_scaling": scaling}


def report(res: dict) -> None:
    def mean(xs):
        xs = [x for x in xs if x == x]
        return sum(xs) / len(xs) if xs else float("nan")

    both, xs, ts = res.get("run"), res.get("extract"), res.get("train")
    if xs:
        print(f"extract alone: per GPU {', '.join(f'{x:,.0f}' for x in xs['tokens_s'])} tok/s "
              f"(mean {mean(xs['tokens_s']):,.0f}); {xs['wall_s']:.0f} s; host peak {xs['host']['used_peak_gb']:.1f} GB "
              f"used, {xs['host']['cached_peak_gb']:.1f} GB page cache")
    if ts:
        print(f"train alone: 3 GPUs {ts['three']['samples_s']:.2f} samples/s, 1 GPU {ts['one']['samples_s']:.2f}; "
              f"3-rank scaling {ts['ddp3_scaling']:.3f} (goal >= 0.95)")
    if both:
        print(f"both at once: per GPU {', '.join(f'{x:,.0f}' for x in both['extract_tokens_s'])} tok/s, training "
              f"{both['train_samples_s']:.2f} samples/s; launch to training {both['launch_to_training_s']} s; "
              f"training waited for extraction: {both['train_waited']}; host peak {both['host']['used_peak_gb']:.1f} GB "
              f"used, {both['host']['cached_peak_gb']:.1f} GB page cache")
        if xs:
            print(f"  extraction while training: {mean(both['extract_tokens_s']) / mean(xs['tokens_s']):.3f} of alone "
                  "(goal >= 0.95)")
        if ts:
            print(f"  training while extracting: {both['train_samples_s'] / ts['three']['samples_s']:.3f} of alone "
                  "(goal >= 0.95)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(ROOT / "out" / "node8"), help="kept between calls (the checkpoint)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--out", default=None, help="the figures as JSON (merged with earlier phases' under --root)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny target, configs/tiny.yaml's drafter")
    ap.add_argument("--samples", type=int, default=3000, help="~13.5M tokens: extraction on 5 GPUs outlasts the run "
                    "phase (~50K tok/s: 10K per H200, docs/benchmarks.md)")
    ap.add_argument("--run-s", type=float, default=120.0, help="run: measured this long once training steps")
    ap.add_argument("--train-s", type=float, default=60.0, help="train: each solo run measured this long")
    ap.add_argument("--startup-s", type=float, default=240.0, help="launch time allowed before the measured window")
    ap.add_argument("--extract-limit-s", type=float, default=420.0, help="extract: stopped here if not done")
    a = ap.parse_args(argv)
    import torch

    a.device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    a.root = Path(a.root)
    a.root.mkdir(parents=True, exist_ok=True)
    a.layers, a.mean_len, a.max_len, a.config, a.extra_set = 64, 4500, 8192, str(ROOT / "configs" / "qwen3.6-27b.yaml"), []
    a.solo_extract_set = []  # --set options of the extract phase only (the tiny size's smaller solo store)
    if a.tiny:
        a.layers, a.mean_len, a.max_len, a.config = 8, 96, 256, str(ROOT / "configs" / "tiny.yaml")
        a.samples = min(a.samples, 600)  # extraction still runs when training starts stepping (~15 s)
        # the extract phase: a quarter of them, still many commits a shard (a rate each); train reads that store
        a.solo_extract_set = [f"data.max_samples={a.samples // 4}"]
        a.run_s, a.train_s, a.startup_s, a.extract_limit_s = (min(a.run_s, 8), min(a.train_s, 6), min(a.startup_s, 150),
                                                              min(a.extract_limit_s, 200))
        a.extra_set = ["drafter.hidden_size=256", "target.num_feature_layers=3", "train.batch_size=4",
                       "extract.token_budget=512"]  # several commits per shard: a rate to measure
    env = {**os.environ, "DFLASH_COMPILE_CACHE": str(a.root / "compile-cache")}
    if a.device != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    results_file = a.root / "results.json"
    res = json.loads(results_file.read_text()) if results_file.exists() else {}
    res["device"] = a.device
    for phase in a.phases.split(","):
        if phase not in PHASES:
            raise SystemExit(f"unknown phase {phase!r}: choose from {', '.join(PHASES)}")
        print(f"=== {phase}", flush=True)
        res[phase] = {"prepare": prepare, "run": run_both, "extract": extract_alone, "train": train_alone}[phase](a, env)
        results_file.write_text(json.dumps(res, indent=1))  # a cut-short call keeps the phases it finished
    report(res)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    missing = missing_figures(res, a.phases.split(","), a.device)
    if missing:
        raise SystemExit(f"node_bench: no figure for {', '.join(missing)} (see the logs under {a.root / 'logs'})")


def missing_figures(res: dict, phases: list[str], device: str) -> list[str]:
    """The figures of the phases this call ran that came out empty (a stage that never got going)."""
    def bad(x):
        return x is None or x != x

    out = []
    if "run" in phases:
        r = res["run"]
        out += [f"run: shard {i} tokens/s" for i, x in enumerate(r["extract_tokens_s"]) if bad(x)] or (
            [] if r["extract_tokens_s"] else ["run: extraction"])
        out += ["run: training samples/s"] * bad(r["train_samples_s"]) + ["run: launch to training"] * bad(
            r["launch_to_training_s"])
    if "extract" in phases:
        x = res["extract"]["tokens_s"]
        out += [f"extract: shard {i} tokens/s" for i, v in enumerate(x) if bad(v)] or ([] if x else ["extract"])
    if "train" in phases:
        t = res["train"]
        out += ["train: 3 GPUs"] * bad(t["three"]["samples_s"]) + ["train: 1 GPU"] * bad(t["one"]["samples_s"])
        out += ["train: scaling"] * (device == "cuda" and bad(t["ddp3_scaling"]))
    return out


if __name__ == "__main__":
    main()
