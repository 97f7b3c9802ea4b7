"""`dflash demo`: the whole pipeline on the embedded tiny target, in-process, in a few minutes on 2 CPU cores.

    regenerate (the target answers the tiny-chat prompts itself) -> ingest -> extract (2 shards) -> train
    -> export -> offline eval + online eval (speculative vs greedy)

Everything goes under OUT (default runs/demo): OUT/regen (the regenerated conversations and their
manifest.json), OUT/store.zarr, OUT/train (checkpoints, logs, export),
OUT/eval (report.json, plots), OUT/demo.json (the summary printed at the end). Rerunning reuses finished
stages (extraction resumes, a finished training run is kept); `--fresh` starts over. `--set` overrides
apply on top of configs/tiny.yaml and the demo's own settings (DEMO_OVERRIDES), e.g. --set train.epochs=2.
Training runs in this process (one CPU process, or one GPU when present), so Lightning never re-executes.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

from data.prompts import output_names
from pipeline.config import CONFIGS_DIR, Config, load_config
from stages.eval_online import log

# The tiny config as shipped, with the store and the run under OUT, and a shorter schedule for a CPU demo.
# Measured on 2 CPU cores: batch 8 x 3 epochs (~1100 steps, ~3.7 min) reaches val tau ~5.85 of 8 (plain batches,
# 2026-12-01; ~5.6 when batches were grouped by length); the shipped batch 16 x 6 epochs (~1100 steps of twice
# the work) reached ~6.2 with grouped batches.
DEMO_OVERRIDES: list[str] = [
    "train.batch_size=8",
    "train.epochs=3",
    "train.val_every=250",
    "train.num_workers=0",  # the store is small and local: reading in-process avoids a worker competing for cores
]


def run_demo(out: str = "runs/demo", *, overrides: list[str] | tuple = (), fresh: bool = False,
             command: str = "dflash demo") -> int:
    """The demo's conductor: OUT and the config, then regenerate, extract, train and eval in turn (a stage that
    fails ends the demo with its exit code), then the summary (OUT/demo.json and the lines printed); returns the
    eval's exit code."""
    from stages.eval import run_eval
    from stages.extract import run_extract
    from stages.regenerate import run_regenerate
    from stages.train import run_train

    out_dir = _out_dir(out=out, fresh=fresh)
    config_path = str(CONFIGS_DIR / "tiny.yaml")
    store = str(out_dir / "store.zarr")
    run_dir = out_dir / "train"
    all_overrides = [*DEMO_OVERRIDES, f"store.path={store}", f"train.run_dir={run_dir}", *overrides]
    cfg = load_config(config_path, all_overrides)
    times: dict[str, float] = {}
    t_start = time.perf_counter()
    regen = out_dir / "regen"
    rc, cfg = _regenerate(run_regenerate=run_regenerate, cfg=cfg, config_path=config_path,
                          overrides=all_overrides, regen=regen, command=command, times=times, t_start=t_start)
    if rc:
        return rc
    rc = _extract(run_extract=run_extract, cfg=cfg, store=store, command=command, times=times)
    if rc:
        return rc
    rc = _train(run_train=run_train, cfg=cfg, store=store, run_dir=run_dir, command=command, times=times)
    if rc:
        return rc
    code = _eval(run_eval=run_eval, overrides=overrides, store=store, run_dir=run_dir, out_dir=out_dir, times=times,
                 t_start=t_start)
    _summarize(out_dir=out_dir, regen=regen, store=store, run_dir=run_dir, times=times)
    return code


def _out_dir(*, out: str, fresh: bool) -> Path:
    """OUT, created; with `fresh`, whatever an earlier demo left there is removed first."""
    out_dir = Path(out)
    if fresh and out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def _regenerate(*, run_regenerate: Callable[..., int], cfg: Config, config_path: str, overrides: list[str],
                regen: Path, command: str, times: dict[str, float], t_start: float) -> tuple[int, Config]:
    """Stage 1: the target answers the config's prompt files itself (into OUT/regen); times["regenerate"].
    Returns the exit code and the config to go on with: reloaded with `overrides` extended (in place) to train
    and validate on the regenerated files; the config given when the regeneration stopped."""
    prompts = [*cfg.data.train_files, *cfg.data.validation_files]
    log(f"demo [1/5] regenerate: the target answers the prompts of {', '.join(Path(f).name for f in prompts)} "
        f"itself ({cfg.extract.shards} shards) -> {regen}")
    rc = run_regenerate(cfg, prompts=prompts, out=str(regen), shards=cfg.extract.shards, command=command)
    times["regenerate"] = time.perf_counter() - t_start
    if rc:
        log(f"demo: regeneration stopped (exit {rc}); rerun `{command}` to resume")
        return rc, cfg
    names = [str(regen / n) for n in output_names(prompts)]  # one output per prompt file, in order
    n_train = len(cfg.data.train_files)
    overrides += [f"data.train_files=[{','.join(names[:n_train])}]",
                  f"data.validation_files=[{','.join(names[n_train:])}]"]
    return rc, load_config(config_path, overrides)


def _extract(*, run_extract: Callable[..., int], cfg: Config, store: str, command: str, times: dict[str, float]) -> int:
    """Stage 2: ingest and extract the regenerated conversations into the store; times["extract"]; its exit code."""
    log(f"demo [2/5] ingest + extract: target {cfg.target.path}, {cfg.extract.shards} shards -> {store}")
    t0 = time.perf_counter()
    rc = run_extract(cfg, shards=cfg.extract.shards, store=store, command=command)
    times["extract"] = time.perf_counter() - t0
    if rc:
        log(f"demo: extraction failed (exit {rc}); rerun `{command}` to resume")
    return rc


def _train(*, run_train: Callable[..., int], cfg: Config, store: str, run_dir: Path, command: str,
           times: dict[str, float]) -> int:
    """Stage 3: train (and export) in this process, resuming from a checkpoint, or keep a finished run with its
    export; times["train"] when it did not fail; its exit code."""
    export = run_dir / "export"
    summary_path = run_dir / "summary.json"
    t0 = time.perf_counter()
    if summary_path.exists() and (export / "model.safetensors").exists():
        log(f"demo [3/5] train: reusing the finished run in {run_dir} (--fresh to retrain)")
    else:
        resume = (run_dir / "checkpoints" / "last.ckpt").exists()
        log(f"demo [3/5] train{' (resuming)' if resume else ''}: {cfg.train.epochs} epochs, drafter "
            f"{cfg.drafter.num_hidden_layers} layers x {cfg.drafter.hidden_size}, block {cfg.drafter.block_size} "
            f"-> {run_dir}")
        from stages.train_startup import begin

        begin()  # the start-up line counts from here, not from the demo's start
        rc = run_train(cfg, store=store, resume=resume, command=command, export=True)
        if rc:
            return rc
    times["train"] = time.perf_counter() - t0
    return 0


def _eval(*, run_eval: Callable[..., int], overrides: list[str] | tuple, store: str, run_dir: Path, out_dir: Path,
          times: dict[str, float], t_start: float) -> int:
    """Stages 4 and 5: name the export, evaluate it offline and online into OUT/eval; times["eval"] and
    times["total"]; the eval's exit code."""
    export = run_dir / "export"
    log(f"demo [4/5] export: {export}")
    eval_dir = out_dir / "eval"
    log(f"demo [5/5] eval (offline on the store's validation split, online against the target) -> {eval_dir}")
    t0 = time.perf_counter()
    code = run_eval(str(export), config_path=None, overrides=list(overrides), store=store, online=True,
                    out=str(eval_dir))
    times["eval"] = time.perf_counter() - t0
    times["total"] = time.perf_counter() - t_start
    return code


def _summarize(*, out_dir: Path, regen: Path, store: str, run_dir: Path, times: dict[str, float]) -> None:
    """From OUT/eval/report.json: write OUT/demo.json (paths, taus, speedup, seconds) and print the closing lines."""
    export, eval_dir = run_dir / "export", out_dir / "eval"
    report = json.loads((eval_dir / "report.json").read_text())
    off, on = report.get("offline", {}), report.get("online", {})
    summary = {
        "regenerated": str(regen), "store": store, "run_dir": str(run_dir), "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "export": str(export), "report": str(eval_dir / "report.json"),
        "plots": [str(eval_dir / p) for p in report.get("plots", [])],
        "offline_tau": off.get("tau"), "offline_serving_walk_tau": (off.get("serving_walk") or {}).get("tau"),
        "online_tau": on.get("tau"), "speedup": on.get("speedup"),
        "tokens_per_target_forward": on.get("tokens_per_target_forward"), "lossless": on.get("lossless"),
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }
    (out_dir / "demo.json").write_text(json.dumps(summary, indent=1) + "\n")
    walk = (off.get("serving_walk") or {}).get("tau", float("nan"))
    gap = on.get("tau", float("nan")) / walk - 1.0 if walk == walk and walk else float("nan")
    lines = [
        "",
        "dflash demo: done in {:.0f} s (regenerate {:.0f} s, extract {:.0f} s, train {:.0f} s, eval {:.0f} s)".format(
            times["total"], times["regenerate"], times["extract"], times["train"], times["eval"]),
        f"  regenerated  {regen}  (the target's own answers; provenance in manifest.json)",
        f"  store        {store}",
        f"  run          {run_dir}  (logs/metrics.csv, checkpoints/last.ckpt)",
        f"  export       {export}  (serve it, or `dflash eval {export} --online`)",
        f"  eval report  {eval_dir / 'report.json'}",
        f"  plots        {', '.join(summary['plots'])}",
        f"  tau offline  {off.get('tau', float('nan')):.3f}  mean acceptance length over the validation anchors; "
        f"{walk:.3f} tokens per verify step replaying decoding on the stored responses",
        f"  tau online   {on.get('tau', float('nan')):.3f}  tokens per verify step ({gap:+.1%} vs the offline replay); "
        f"{on.get('tokens_per_target_forward', float('nan')):.2f} tokens per target forward; "
        f"speedup {on.get('speedup', float('nan')):.2f}x over greedy on this machine",
        f"  lossless     {'yes: identical to greedy decoding' if on.get('lossless') else 'NO: see the report'}",
    ]
    print("\n".join(lines), flush=True)
