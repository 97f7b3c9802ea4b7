"""The global batch across a change of world size (issue 41 item 2): a resume keeps its samples per optimizer step.

Contract:
- A training checkpoint's data state (data/sampler.py `state_dict`) records the world size, the accumulation,
  the micro-batch and the samples done. The global batch of a step is world x accumulate micro-batches (each
  of train.batch_size samples: rows when packing).
- With `train.keep_global_batch` (the default), a resume recomputes `train.accumulate_grad_batches` so that the
  new world keeps the checkpoint's global batch: 3 ranks x 8 become 8 ranks x 3, on one node or several. When
  the new world size does not divide it, one line says so and the nearest global batch it divides is used
  (a tie takes the larger). The config's accumulation applies to new runs only: a resume on the checkpoint's
  own world size keeps the checkpoint's. `false` is the old behaviour: the config's accumulation, so the global
  batch grows with the ranks.
- The data position stays exact in samples: the epoch's global batches are the same for every world size and
  micro-batch count; a resume with another micro-batch is refused (its plan would be another one). The
  optimizer steps done in the epoch are counted in the new windows: the sampler's k0 and Lightning's batch
  counter (the checkpoint's loop state, shifted by `realign_callback` before Lightning restores it) become
  (steps done) x the new accumulation. The LR schedule then keeps its length in samples: stages/train_task.py
  replans the rest over the steps the data plan leaves, which are the checkpoint's unless the global batch
  had to change.
"""

from __future__ import annotations

import sys
from typing import Optional

from pipeline.config import Config
from pipeline.errors import UserError


class GlobalBatchError(UserError, ValueError):
    pass


def nearest_accumulate(global_micro: int, world: int) -> int:
    """Micro-batches per rank and step whose global batch (x world) is nearest `global_micro`; a tie takes the
    larger; at least 1."""
    lo = global_micro // world
    if lo >= 1 and global_micro - lo * world < (lo + 1) * world - global_micro:
        return lo
    return lo + 1


def saved_accumulate(resume_state: Optional[dict]) -> Optional[int]:
    """The accumulation the checkpoint trained with: its data state's, else (a dflash before it recorded
    one) its config's."""
    loader = (resume_state or {}).get("loader") or {}
    value = loader.get("accumulate", (resume_state or {}).get("accumulate"))
    return None if value is None else int(value)


def resume_accumulate(cfg: Config, resume_state: Optional[dict], world: int, say: bool) -> int:
    """Set and return cfg.train.accumulate_grad_batches for a resume on `world` ranks (see the module docstring);
    `say`: print what changed (one line). A fresh run, or a checkpoint without a data state, keeps the config's."""
    t = cfg.train
    loader = (resume_state or {}).get("loader") or {}
    old_bs = loader.get("batch_size")
    if old_bs is not None and int(old_bs) != t.batch_size:
        raise GlobalBatchError(
            f"the checkpoint was trained with train.batch_size {old_bs}, the config says {t.batch_size}: its data "
            f"position counts global batches of {old_bs}; resume with --set train.batch_size={old_bs} (accumulation "
            "keeps the global batch on any number of ranks) or start a new train.run_dir")
    old_acc = saved_accumulate(resume_state)
    if loader and old_acc is not None:
        loader.setdefault("accumulate", old_acc)  # the sampler counts the done steps in the new windows
    if not loader or old_acc is None or not t.keep_global_batch:
        return t.accumulate_grad_batches
    old_world = int(loader.get("world_size", world))
    global_micro = old_world * old_acc
    new_acc = nearest_accumulate(global_micro, world)
    unit = f"micro-batches of {t.batch_size} {'row' if t.packing else 'sample'}(s)"
    if new_acc * world != global_micro:
        if say:
            print(f"train: the checkpoint's global batch ({old_world} rank(s) x {old_acc} = {global_micro} {unit}) "
                  f"does not divide over {world} rank(s): using the nearest it divides, {world} x {new_acc} = "
                  f"{world * new_acc} (train.accumulate_grad_batches {new_acc}); the learning-rate schedule keeps its "
                  "length in samples", file=sys.stderr, flush=True)
    elif say and old_world != world:
        print(f"train: resuming on {world} rank(s) (the checkpoint's {old_world}): train.accumulate_grad_batches "
              f"{new_acc} (was {old_acc}), so the global batch stays {global_micro} {unit} per optimizer step "
              "(train.keep_global_batch=false: let it grow with the ranks)", file=sys.stderr, flush=True)
    elif say and new_acc != t.accumulate_grad_batches:
        print(f"train: resuming with the checkpoint's train.accumulate_grad_batches {new_acc} (the config says "
              f"{t.accumulate_grad_batches}): its global batch of {global_micro} {unit} stays "
              "(train.keep_global_batch=false: the config's)", file=sys.stderr, flush=True)
    t.accumulate_grad_batches = new_acc
    return new_acc


def plan_changed(resume_state: Optional[dict], world: int, accumulate: int) -> bool:
    """Whether the resumed epoch is dealt otherwise than the checkpoint's (another world or accumulation): then
    its length differs from the next epochs' and Lightning must ask the loader for it each epoch."""
    loader = (resume_state or {}).get("loader") or {}
    old_acc = saved_accumulate(resume_state)
    return int(loader.get("world_size", world)) != world or (old_acc is not None and old_acc != accumulate)


def shift_batch_progress(checkpoint: dict, delta: int) -> None:
    """Move the loop's batch counters of the checkpoint's epoch by `delta` (all of them: their relations, which
    tell Lightning where in a batch the checkpoint was taken, stay)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not progress or not delta:
        return
    for part in ("total", "current"):
        for key in ("ready", "started", "processed", "completed"):
            if key in progress.get(part, {}):
                progress[part][key] = int(progress[part][key]) + delta


def realign_callback(sampler, resume_state: Optional[dict]):
    """A Lightning callback that, as the checkpoint loads (before the loops are restored), counts the epoch's done
    batches as `sampler` now does (data/sampler.py load_state_dict) and gives the loader state the accumulation
    it was saved with, so a second load of it by Lightning realigns alike."""
    from lightning.pytorch import Callback

    loader = dict((resume_state or {}).get("loader") or {})
    old_acc = saved_accumulate(resume_state)

    class RealignBatchCount(Callback):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
            if not loader:
                return
            states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")
            if states and old_acc is not None:
                states[0].setdefault("accumulate", old_acc)
            if int(loader.get("epoch", -1)) == sampler.epoch:
                shift_batch_progress(checkpoint, sampler.k0 - int(loader.get("batches_done", sampler.k0)))

    return RealignBatchCount()
