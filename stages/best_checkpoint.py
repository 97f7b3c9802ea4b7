"""The run's best checkpoint by held-out tau, and which checkpoint an export takes (best or last).

Contract:
- RUN/checkpoints holds `last.ckpt` (the full state that `--resume` continues from; a link to the newest
  step checkpoint) and, once validation has run, exactly one `best-step{N}.ckpt`: the drafter's weights and
  the `dflash` metadata (no optimizer state: it is for export and eval, not for resuming) of the validation
  whose val/tau is the highest so far. A later validation replaces it only with a strictly higher tau (ties
  keep the earlier step). The new file is in place before the old one is removed (a kill between leaves two;
  the next start keeps the better one).
- The best so far survives a resume twice over: the callback's state (tau, step, path) is in every full
  checkpoint, and at the start of a run the best-step files on disk are read too, because a step checkpoint
  is written before that step's validation (a resumed run would otherwise forget a best found at its own
  resume step). The best of both wins; rank 0 decides and every rank follows (the save is collective).
- Every checkpoint's metadata carries `step` and `val` (the latest validation's metrics and the step it ran at).
- `choose_checkpoint(ckpt_dir, which)` picks the checkpoint to export (`train.export_checkpoint`: best, the
  default, or last) and says which one and why, e.g. "step 1200 (best val tau 3.410; the last step, 1500,
  had 3.380)". Without a validation split there is no best: the last is taken, and the message says so; a
  best-step file that the scan skips (`scan_best_files`: a symlink, a file the loader refuses) is named with
  the reason instead. A last.ckpt link left dangling (or missing) takes the newest step checkpoint present, and
  the reason says so; the run directory is not changed (`dflash train --resume` repairs the link).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning as L

from pipeline.acceptance import VAL_TAU as TAU, checkpoint_val_tau
from pipeline.config import ConfigError

BEST_RE = re.compile(r"^best-step(\d+)\.ckpt$")


def best_name(step: int) -> str:
    return f"best-step{step}.ckpt"


def checkpoint_info(path: Path) -> dict:
    """{"step", "val"} of a dflash checkpoint (memory-mapped: the weights are not read). `val` may be {}."""
    from pipeline.ckpt_io import load_training_checkpoint

    ckpt = load_training_checkpoint(path, mmap=True)  # weights_only: never runs code from the file
    meta = ckpt.get("dflash") or {}
    return {"step": int(meta.get("step", ckpt.get("global_step", 0))), "val": dict(meta.get("val") or {})}


def best_files(ckpt_dir: Path) -> list[tuple[float, int, Path]]:
    """(tau, step, path) of every best-step file, best first (higher tau, then the earlier step)."""
    return scan_best_files(ckpt_dir)[0]


def scan_best_files(ckpt_dir: Path) -> tuple[list[tuple[float, int, Path]], list[str]]:
    """`best_files`, and one "NAME (why)" per best-step file it skipped: a symlink (a best checkpoint is a file
    of its run, never a link to elsewhere), one the loader refused or could not read (its first error line),
    or one without a val tau."""
    out, skipped = [], []
    for f in sorted(Path(ckpt_dir).glob("best-step*.ckpt")) if Path(ckpt_dir).is_dir() else []:
        if not BEST_RE.match(f.name):
            continue
        if f.is_symlink():
            skipped.append(f"{f.name} (a symlink, not a file of this run)")
            continue
        try:
            tau = checkpoint_info(f)["val"].get(TAU)
        except Exception as e:  # noqa: BLE001 - a torn, refused or foreign file is not a best checkpoint
            skipped.append(f"{f.name} (refused: {(str(e).splitlines() or [type(e).__name__])[0]})")
            continue
        if tau is None:
            skipped.append(f"{f.name} (no {TAU} recorded)")
            continue
        out.append((float(tau), int(BEST_RE.match(f.name).group(1)), f))
    return sorted(out, key=lambda t: (-t[0], t[1])), skipped


def is_better(tau: Optional[float], best: Optional[float]) -> bool:
    """Strictly higher (so a tie keeps the earlier checkpoint); a missing or NaN tau never wins."""
    if tau is None or tau != tau:
        return False
    return best is None or tau > best


class BestCheckpoint(L.Callback):
    """After each validation: if val/tau beats the best so far, write RUN/checkpoints/best-step{N}.ckpt
    (weights only) and remove the previous best file. See the module contract."""

    def __init__(self, ckpt_dir: Path):
        self.dir = Path(ckpt_dir)
        self.tau: Optional[float] = None
        self.step: Optional[int] = None

    @property
    def state_key(self) -> str:
        return "dflash-best-checkpoint"

    def state_dict(self) -> dict:
        return {"tau": self.tau, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.tau, self.step = state.get("tau"), state.get("step")

    @property
    def path(self) -> Optional[Path]:
        return None if self.step is None else self.dir / best_name(self.step)

    def on_train_start(self, trainer, pl_module) -> None:
        state = None
        if trainer.is_global_zero:
            known = [(self.tau, self.step)] if self.tau is not None and self.path.exists() else []
            files = best_files(self.dir)
            cands = sorted(known + [(t, s) for t, s, _ in files], key=lambda c: (-c[0], c[1]))
            state = cands[0] if cands else (None, None)
            for _t, s, f in files:  # one best file: those beaten (a kill between save and removal) go
                if s != state[1]:
                    f.unlink(missing_ok=True)
        self.tau, self.step = trainer.strategy.broadcast(state, src=0)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        tau = (getattr(pl_module, "last_val", None) or {}).get(TAU)  # the same on every rank (all-reduced)
        if not is_better(tau, self.tau):
            return
        old, step = self.path, trainer.global_step
        trainer.save_checkpoint(self.dir / best_name(step), weights_only=True)  # collective; rank 0 writes
        self.tau, self.step = float(tau), step
        if trainer.is_global_zero:
            if old is not None and old != self.path:  # once the new one is written (stages/train_ckpt_io.py)
                trainer.strategy.checkpoint_io.remove_checkpoint(old)
            print(f"train: new best val tau {self.tau:.3f} at step {step}: {self.path}", file=sys.stderr, flush=True)


@dataclass
class Choice:
    path: Path
    kind: str  # "best" | "last"
    step: int
    tau: Optional[float]  # the chosen checkpoint's val tau (None: not validated at its step)
    reason: str  # one line: which checkpoint and why

    def as_dict(self) -> dict:
        return {"checkpoint": str(self.path), "selected": self.kind, "step": self.step, "val_tau": self.tau,
                "reason": self.reason}


def _tau_at(info: dict) -> Optional[float]:
    """The checkpoint's own val tau: only when its latest validation ran at its step."""
    return checkpoint_val_tau(info["val"], info["step"])


def choose_checkpoint(ckpt_dir: Path, which: str = "best", last_tau: Optional[float] = None) -> Choice:
    """The checkpoint to export from RUN/checkpoints: the best by val tau (which="best") or last.ckpt.
    `last_tau`: the last step's val tau when the caller knows it (training: its final validation)."""
    ckpt_dir = Path(ckpt_dir)
    if which not in ("best", "last"):
        raise ConfigError(f"which checkpoint: {which!r} is not one of best, last")
    last, note = _last_checkpoint(ckpt_dir)
    info = checkpoint_info(last)
    lstep = info["step"]
    ltau = last_tau if last_tau is not None else _tau_at(info)
    lwhat = (f"{ltau:.3f}" if ltau is not None else "no validation at that step") + note
    files, skipped = scan_best_files(ckpt_dir)
    if not files and skipped:
        return Choice(last, "last", lstep, ltau, f"the last step, {lstep} (val tau {lwhat}; no usable best "
                                                 f"checkpoint: skipped {', '.join(skipped)})")
    if not files:
        return Choice(last, "last", lstep, ltau, f"the last step, {lstep} (val tau {lwhat}; there is no best "
                                                 "checkpoint: the run had no validation)")
    btau, bstep, bpath = files[0]
    if which == "last":
        return Choice(last, "last", lstep, ltau, f"the last step, {lstep} (val tau {lwhat}), as asked; the best "
                                                 f"val tau was {btau:.3f} at step {bstep} ({bpath})")
    if bstep == lstep:
        return Choice(bpath, "best", bstep, btau, f"step {bstep} (best val tau {btau:.3f}; it is also the last step)")
    return Choice(bpath, "best", bstep, btau, f"step {bstep} (best val tau {btau:.3f}; the last step, {lstep}, "
                                              f"had {lwhat})")


def _last_checkpoint(ckpt_dir: Path) -> tuple[Path, str]:
    """(last.ckpt, "") when it names a checkpoint; else the newest step checkpoint present and a note saying
    so (a link left dangling by a crash: read as it is, the run directory is not changed here); else
    FileNotFoundError."""
    import os

    from pipeline.ckpt_io import newest_step_checkpoint

    last = ckpt_dir / "last.ckpt"
    if last.exists():
        return last, ""
    newest = newest_step_checkpoint(ckpt_dir)
    if newest is None:
        raise FileNotFoundError(f"no checkpoint at {last}: train first (`dflash train`), or pass a .ckpt file")
    why = f"names {os.readlink(last)}, which is missing" if last.is_symlink() else "is missing"
    return newest, f"; last.ckpt {why}, so the last step is {newest.name}, the newest checkpoint present"


def resolve_checkpoint(path: str, which: Optional[str]) -> Choice | Path:
    """`dflash export`/`eval` argument: a .ckpt file is itself (Path; `which` must be unset); a run directory
    or its checkpoints directory -> `choose_checkpoint` (best unless which="last")."""
    p = Path(path)
    if p.is_file():
        if which is not None:
            raise ConfigError(f"--which {which} picks a checkpoint of a run directory; {p} is already one checkpoint")
        return p
    ckpt_dir = p if (p / "last.ckpt").exists() or p.name == "checkpoints" else p / "checkpoints"
    return choose_checkpoint(ckpt_dir, which or "best")
