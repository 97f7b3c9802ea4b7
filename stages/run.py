"""`dflash run`: both stages on one node at once, supervised: extraction on some GPUs, training on the others
following the store as it grows (`dflash train --follow`).

Contract:
- Starts `dflash extract` (one shard per extract GPU) and `dflash train --follow` as child commands, each in
  its own process group, with their output in RUN/logs/run-extract.log and RUN/logs/run-train.log. With
  empty GPU lists (a machine without GPUs) both run as CPU processes (train: `devices` gloo ranks).
- One progress view: extraction's samples, tokens/s and ETA, training's step, steps/s and ETA, and how far
  training is behind extraction; a redrawn line on a terminal, a plain line every 15 s otherwise.
- One Ctrl-C (or SIGTERM) stops both cleanly: each child gets the signal a terminal would have sent it (the
  extraction commits and stops, training stops; checkpoints and commits are kept); a second Ctrl-C forces
  both. If this process dies, the children are sent SIGTERM (PR_SET_PDEATHSIG).
- Resume: the same command. Extraction continues from its commits; training resumes from
  RUN/checkpoints/last.ckpt when there is one. A store that is already complete is trained on directly,
  except by a rerun of a run whose training began following (RUN/logs/train-follows, written when training is
  started with --follow) and was stopped before its first checkpoint: that training follows again (the
  finished store's commit-order stream epoch, which depends only on the store and the seed), so the rerun
  gives the uninterrupted run's result, not a shuffled first epoch.
- Failures: a failed extraction stops the training (it could not finish) and the command exits 1 naming it;
  a failed training lets the extraction finish (its store is kept for the next run) and exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline import store as st
from pipeline.config import Config
from pipeline.errors import UserError


class RunError(UserError, RuntimeError):
    pass


def parse_gpus(text: Optional[str]) -> list[int]:
    """'0-4' / '0,1,2' / '5-7,9' / '' -> GPU indices."""
    out: list[int] = []
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        try:
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        except ValueError:
            raise RunError(f"{text!r}: expected GPU indices such as 0-4 or 0,1,2") from None
    if len(set(out)) != len(out):
        raise RunError(f"{text!r} names a GPU twice")
    return out


def _child(cmd: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "ab")
    f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
    f.flush()
    # its own process group: a terminal's Ctrl-C reaches this process only, which passes it on exactly once
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_child_setup)


def _child_setup() -> None:
    """In the child before exec: die with this process, and take Ctrl-C as a terminal's job does. An ignored
    SIGINT is inherited: `dflash run` started where Ctrl-C is ignored (a background job of a script, `nohup`)
    gave its children an ignored SIGINT, so the Ctrl-C this process passes on never stopped the training
    (it waited for the extraction forever; seen in a CI-like run)."""
    from pipeline.lifecycle import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def status_line(store: str, run_dir: Path) -> str:
    """One line: extraction (its own status line), training (step, rate, ETA) and the lag between them."""
    ex = _read_json(Path(store) / "logs" / "extract-status.json")
    tr = _read_json(run_dir / "progress.json")
    parts = [ex.get("line", "extract: starting").split("  [")[0]]
    if tr.get("state") == "running" and tr.get("step") is not None:
        eta = tr.get("eta_s")
        parts.append(f"train: step {tr['step']}/{tr.get('total_steps', '?')} {tr.get('steps_per_s', 0):.2f} steps/s "
                     f"ETA {'?' if eta is None or eta != eta else f'{eta / 60:.1f} min'}")
        d = tr.get("data", {})
        if d.get("stream_epoch") and "readable_samples" in d:
            lag = d["readable_samples"] - d["global_batches_done"] * d["batch_size"]
            parts.append(f"training is {max(0, lag)} samples behind extraction"
                         + (" (waits for it)" if lag < d["batch_size"] else ""))
        elif d:
            parts.append(f"epoch {d.get('epoch')} over the finished store")
    else:
        parts.append(f"train: {tr.get('state', 'starting (waits for the first committed samples)')}")
    return " | ".join(parts)


def run_node(cfg: Config, config_path: Optional[str], overrides: list[str], extract_gpus: str, train_gpus: str,
             devices: Optional[int], store: Optional[str], command: str) -> int:
    xg, tg = parse_gpus(extract_gpus), parse_gpus(train_gpus)
    if set(xg) & set(tg):
        raise RunError(f"GPU(s) {sorted(set(xg) & set(tg))} are in both --extract-gpus and --train-gpus")
    import torch

    if (xg or tg) and not torch.cuda.is_available():
        raise RunError("--extract-gpus/--train-gpus name GPUs, but this machine has none visible; leave both empty "
                       "to run on the CPU")
    store_path = store or cfg.store.path
    run_dir = Path(cfg.train.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    common = ["--config", str(config_path or "")] + [a for o in overrides for a in ("--set", o)] + ["--store", store_path]
    py = [sys.executable, "-m", "stages.cli"]
    x_cmd = py + ["extract", *common, "--shards", str(len(xg) or cfg.extract.shards)]
    x_cmd += ["--gpus", ",".join(map(str, xg))] if xg else []
    resume = (run_dir / "checkpoints" / "last.ckpt").exists()
    complete = _complete(store_path)
    t_cmd = py + ["train", *common] + (["--gpus", ",".join(map(str, tg))] if tg else ["--devices", str(devices or 1)])
    follows = run_dir / "logs" / "train-follows"  # this run's training began on an unfinished store
    follow = not complete or (not resume and follows.exists())  # resumed: the checkpoint keeps its epochs
    if follow and not complete:
        follows.write_text("training started with --follow: a rerun before its first checkpoint follows too\n")
    t_cmd += (["--follow"] if follow else []) + (["--resume"] if resume else [])
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say(f"run: extraction on {('GPUs ' + ','.join(map(str, xg))) if xg else 'the CPU'} -> {store_path}"
        f"{' (already complete)' if complete else ''}; training on "
        f"{('GPUs ' + ','.join(map(str, tg))) if tg else f'{devices or 1} CPU process(es)'} -> {run_dir}"
        f"{' (resuming)' if resume else ''}; logs in {run_dir / 'logs'}/run-*.log")
    procs = {"extract": _child(x_cmd, run_dir / "logs" / "run-extract.log"),
             "train": _child(t_cmd, run_dir / "logs" / "run-train.log")}
    stops = {"n": 0}

    def on_signal(signum, _frame):
        stops["n"] += 1
        if stops["n"] == 1:
            say("\nrun: stopping both stages (Ctrl-C again to force)")
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    tty, last, failed = sys.stderr.isatty(), 0.0, None
    try:
        while any(p.poll() is None for p in procs.values()):
            rc_x, rc_t = procs["extract"].poll(), procs["train"].poll()
            if failed is None and not stops["n"] and rc_x not in (None, 0):
                failed = "extract"
                say(f"\nrun: extraction failed (exit {rc_x}); stopping the training, which cannot finish without it")
                os.killpg(procs["train"].pid, signal.SIGINT)
            if failed is None and not stops["n"] and rc_t not in (None, 0):
                failed = "train"
                say(f"\nrun: training failed (exit {rc_t}); extraction goes on (Ctrl-C stops it)")
            if time.time() - last >= (1.0 if tty else 15.0):
                last = time.time()
                print(status_line(store_path, run_dir).ljust(120 if tty else 0), end="\r" if tty else "\n",
                      file=sys.stderr, flush=True)
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    codes = {k: p.returncode for k, p in procs.items()}
    say(("\n" if tty else "") + status_line(store_path, run_dir))
    if failed or any(c not in (0, 130) for c in codes.values()):
        bad = failed or next(k for k, c in codes.items() if c not in (0, 130))
        log = run_dir / "logs" / f"run-{bad}.log"
        say(f"run: {bad} failed (exit {codes[bad]}): {_tail(log)}\n  log: {log}\n  what is done is kept; fix the "
            f"cause and rerun the same command: {command}")
        return 1
    if stops["n"] or any(c == 130 for c in codes.values()):
        say(f"run: stopped; store commits and training checkpoints are kept; continue with the same command: {command}")
        return 130
    summary = _read_json(run_dir / "summary.json")
    tau = summary.get("val", {}).get("val/tau")
    say(f"run: done: store {store_path} complete; {summary.get('global_step', '?')} training steps, val tau "
        f"{'n/a' if tau is None else f'{tau:.3f}'}" + (f"; export {summary['export']}" if summary.get("export") else ""))
    return 0


def _complete(store_path: str) -> bool:
    try:
        attrs = st.read_root_attrs(store_path)
    except st.StoreError:
        return False
    return attrs is not None and all(s.done for s in st.read_all_progress(store_path))


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return "(no log)"
