"""`dflash run`'s expansion (issue 41 item 1): when extraction ends, training takes over its GPUs.

Contract:
- The handover is a file protocol in RUN/logs between the supervisor (stages/run.py) and the training's
  `Handover` callback (stages/train_handover.py), which a training child started with DFLASH_HANDOVER_DIR
  installs:
  1. extraction exited 0 (every shard committed): the supervisor writes `handover-request.json`
     (`request`: the time and the reason);
  2. at its next optimizer step every rank agrees it was asked, the step's checkpoint is written whole to
     RUN/checkpoints/last.ckpt, rank 0 writes `handover-stopped.json` (the step, when the step ended, when the
     checkpoint was in place), and the ranks stop as after Ctrl-C (exit 130);
  3. the supervisor starts `dflash train --resume` on the union of the training and extraction GPUs (on the
     CPU: the training's processes plus the extraction's) with DFLASH_HANDOVER_FIRST naming
     `handover-first-step.json`, where the new rank 0 writes the time of its first optimizer step.
  The resume is the ordinary one (stages/train.py): data position, optimizer, LR schedule and RNG from the
  checkpoint, the global batch kept across the world size (stages/train_batch.py).
- `Handover.record()` appends one JSON line to RUN/logs/handover.jsonl: the step, why, from which devices to
  which, and the pieces' seconds: `wait_for_step_s` (request -> the step's end), `checkpoint_s`, `stop_s`
  (checkpoint in place -> the old training exited), `relaunch_to_first_step_s` and `total_s`; `line()` is
  what the progress view says.
- Crash safety: a run killed at any moment of the handover leaves either no handover checkpoint (the rerun
  resumes from the last periodic checkpoint, or follows again) or a whole one (the rerun resumes from it); a
  rerun finds the store complete and trains on the union directly. `clear()` (at every start) removes the
  protocol files of a killed run, so an old request never stops a new training.
- DFLASH_TEST_HANDOVER_HOLD=checkpoint|relaunch|start (tests only): the training before its handover
  checkpoint, the supervisor before the relaunch, or the relaunched rank 0 at its start writes
  `handover-hold-PHASE` and waits there until it is killed, so a test can kill -9 at that moment.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from stages.train_batch import nearest_accumulate

ENV_DIR = "DFLASH_HANDOVER_DIR"  # set for an expanding training: where it looks for the request
ENV_FIRST = "DFLASH_HANDOVER_FIRST"  # set for the relaunched training: where rank 0 writes its first step's time
ENV_HOLD = "DFLASH_TEST_HANDOVER_HOLD"
# tests: an expanding training hands over at exactly this optimizer step (stages/train_handover.py): it waits there
# for the request, and takes none before it. At the tiny size a whole run's steps take about a second, less than
# the extraction process's exit after its last commit, so the step the request met was anywhere up to the last.
ENV_AT = "DFLASH_TEST_HANDOVER_AT"
REQUEST, STOPPED, FIRST_STEP = "handover-request.json", "handover-stopped.json", "handover-first-step.json"
LOG = "handover.jsonl"


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a reader never sees half a file (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def hold(phase: str, logs: Path) -> None:
    """The tests' kill point (DFLASH_TEST_HANDOVER_HOLD=phase): say where, then wait to be killed."""
    if os.environ.get(ENV_HOLD) != phase:
        return
    (logs / f"handover-hold-{phase}").write_text(f"{os.getpid()}\n")
    while True:
        time.sleep(0.1)


def clear(logs: Path) -> None:
    for name in (REQUEST, STOPPED, FIRST_STEP):
        (logs / name).unlink(missing_ok=True)


def union_devices(extract_gpus: list[int], train_gpus: list[int], devices: Optional[int],
                  extract_shards: int) -> tuple[list[int], int]:
    """(GPUs, CPU processes) the expanded training runs on: both GPU lists, or on the CPU the training's
    processes plus one per extraction shard."""
    if train_gpus or extract_gpus:
        return sorted(set(train_gpus) | set(extract_gpus)), 0
    return [], (devices or 1) + extract_shards


def split_global_batch(cfg, split_world: int, gpus: list[int], cpus: int, say) -> list[str]:
    """The `--set` a fresh training on all devices (the store was complete at the start) needs to train the
    global batch the split would have (`train.keep_global_batch`), as an expansion's resume keeps it; said in one
    line when it changes the accumulation."""
    acc = cfg.train.accumulate_grad_batches
    new = nearest_accumulate(acc * split_world, len(gpus) or cpus)
    if not cfg.train.keep_global_batch or new == acc:
        return []
    say(f"run: the store is complete: training starts on {where(gpus, cpus)} with train.accumulate_grad_batches "
        f"{new} (was {acc}), the global batch of the split it replaces (train.keep_global_batch=false: let it grow "
        "with the ranks)")
    return [f"train.accumulate_grad_batches={new}"]


def warn_indivisible(cfg, split_world: int, world: int, say) -> None:
    """At the start of an expanding run: one line when the split's global batch (split_world x
    train.accumulate_grad_batches micro-batches) does not divide over the `world` ranks training moves to, so the
    handover will change it (stages/train_batch.py `nearest_accumulate`), with the accumulation that keeps it."""
    acc = cfg.train.accumulate_grad_batches
    total = acc * split_world
    if not cfg.train.keep_global_batch or total % world == 0:
        return
    new = nearest_accumulate(total, world)
    keep = next(a for a in range(acc, acc * world + 1) if (a * split_world) % world == 0)
    say(f"run: WARNING: the global batch ({split_world} x {acc} = {total} micro-batches) does not divide over the "
        f"{world} ranks training moves to: after the handover it becomes {world} x {new} = {world * new}; set "
        f"train.accumulate_grad_batches={keep} ({split_world} x {keep} = {world} x {keep * split_world // world}) to "
        "keep one global batch for the whole run, or pass --no-expand")


def where(gpus: list[int], cpus: int) -> str:
    return f"GPUs {','.join(map(str, gpus))}" if gpus else f"{cpus} CPU process(es)"


@dataclass
class Handover:
    """The supervisor's side of one expansion: ask (`request`), see the old training go (`stopped`), start the
    new one (`relaunched`), then `poll` for its first step and record the figures once."""

    logs: Path
    reason: str = "extraction finished"
    requested_at: Optional[float] = None
    exited_at: Optional[float] = None
    relaunched_at: Optional[float] = None
    recorded: Optional[dict] = None
    to: str = ""
    came_from: str = ""

    def request(self) -> None:
        self.requested_at = time.time()
        write_json(self.logs / REQUEST, {"requested_at": self.requested_at, "reason": self.reason})

    def stopped(self) -> Optional[dict]:
        """The old training's handover record, once its checkpoint is in place (None: it stopped otherwise)."""
        return read_json(self.logs / STOPPED) if self.requested_at is not None else None

    def relaunched(self, came_from: str, to: str) -> None:
        self.came_from, self.to, self.relaunched_at = came_from, to, time.time()

    def poll(self, final: bool = False) -> Optional[str]:
        """Once the new training's first step is logged (or at the end, `final`): record the figures, return the
        line to say (None: not yet, or already said)."""
        if self.recorded is not None or self.relaunched_at is None:
            return None
        first = read_json(self.logs / FIRST_STEP)
        if first is None and not final:
            return None
        self.record(first)
        return self.line()

    def record(self, first: Optional[dict]) -> dict:
        s = self.stopped() or {}
        r = lambda a, b: None if a is None or b is None else round(b - a, 3)  # noqa: E731
        step_at, ckpt_at = s.get("step_at"), s.get("checkpoint_at")
        first_at = (first or {}).get("time")
        self.recorded = {"event": "expanded", "reason": self.reason, "step": s.get("step"), "from": self.came_from,
                         "to": self.to, "requested_at": self.requested_at,
                         "wait_for_step_s": r(self.requested_at, step_at), "checkpoint_s": r(step_at, ckpt_at),
                         "stop_s": r(ckpt_at, self.exited_at), "relaunch_to_first_step_s": r(self.relaunched_at, first_at),
                         "total_s": r(self.requested_at, first_at)}
        with open(self.logs / LOG, "a") as f:
            f.write(json.dumps(self.recorded) + "\n")
        return self.recorded

    def line(self) -> str:
        x = self.recorded or {}
        fmt = lambda v: "n/a" if v is None else f"{v:.1f} s"  # noqa: E731
        return (f"run: expanded training from {x.get('from')} to {x.get('to')} at step {x.get('step')} ({x.get('reason')}): "
                f"handover {fmt(x.get('total_s'))} (wait for the step {fmt(x.get('wait_for_step_s'))}, checkpoint "
                f"{fmt(x.get('checkpoint_s'))}, stop {fmt(x.get('stop_s'))}, relaunch to the first step "
                f"{fmt(x.get('relaunch_to_first_step_s'))}); figures in {self.logs / LOG}")
