"""The training's side of `dflash run`'s expansion (stages/run_expand.py): checkpoint at the next optimizer step
when asked, then stop, so that the supervisor resumes the run on more GPUs.

Contract:
- `handover_callback(run_dir)`: None unless the supervisor set DFLASH_HANDOVER_DIR (an expanding training) or
  DFLASH_HANDOVER_FIRST (the relaunched one); a plain `dflash train` gets nothing.
- At the end of each optimizer step (Lightning's global step moved on; never inside an accumulation window)
  every rank looks for RUN/logs/handover-request.json and the ranks agree (one all-reduce over a gloo group:
  a CPU collective, no wait for the GPU), so all stop at the same step. Then: a step checkpoint still being
  written is finished, the step's checkpoint is written to RUN/checkpoints/last.ckpt and waited for
  (stages/progress.save_final, as at the end of a fit), rank 0 writes handover-stopped.json, and the ranks
  stop the way Ctrl-C stops them (stages/train_stop.py: StopRequest, exit 130, the resume hint). On a GPU the
  weights and optimizer state are dropped first (the checkpoint holds them), as at the end of a fit
  (stages/progress.FinalCheckpoint): Lightning's teardown would copy them to host memory before the exit.
- A request met at the run's last optimizer step (the data plan leaves no step: DrafterTask.remaining_steps) is
  declined: the training finishes where it is (final checkpoint, export) and exits 0, instead of stopping only for
  more ranks to start, write that checkpoint and export. Each rank decides from its own plan (no collective);
  if any rank still has steps, all hand over.
- The relaunched training's rank 0 writes handover-first-step.json (the time and the step) at the end of its
  first optimizer step.
- Tests only: DFLASH_TEST_HANDOVER_AT=N makes the handover step N whenever the extraction ends (a request before
  step N waits; at step N every rank waits for the request).
Nothing here touches the training math or the data position; the resume is stages/train.py's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from stages.run_expand import ENV_AT, ENV_DIR, ENV_FIRST, REQUEST, STOPPED, hold, read_json, write_json


class HandoverCallback(L.Callback):
    def __init__(self, logs: Path, expanding: bool, first_step: Optional[Path]):
        self.logs, self.expanding, self.first_step = logs, expanding, first_step
        self.seen_step, self.group, self.declined = None, None, False
        self.test_at = int(os.environ[ENV_AT]) if os.environ.get(ENV_AT) else None  # tests only (module contract)

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen_step = trainer.global_step
        if self.expanding and trainer.world_size > 1:
            import torch.distributed as dist

            # the agreement is a CPU collective: under NCCL a device all-reduce would wait for the GPU every step
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if self.first_step is not None and trainer.is_global_zero:
            hold("start", self.logs)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.seen_step:
            return  # inside an accumulation window (or no step taken)
        self.seen_step = trainer.global_step
        if self.first_step is not None:
            if trainer.is_global_zero:
                write_json(self.first_step, {"time": time.time(), "step": trainer.global_step})
            self.first_step = None
        if self.expanding and self._asked(trainer, pl_module):
            self._hand_over(trainer, pl_module)

    def _asked(self, trainer, pl_module) -> bool:
        """Whether every rank hands over at this step: asked, and not at the run's last step (module contract)."""
        asked = (self.logs / REQUEST).exists()
        if self.test_at is not None:  # tests: exactly at step test_at (see the module contract)
            while trainer.global_step == self.test_at and not asked:
                time.sleep(0.05)
                asked = (self.logs / REQUEST).exists()
            asked = asked and trainer.global_step >= self.test_at
        if asked and pl_module.remaining_steps() == 0:
            asked = False
            if trainer.is_global_zero and not self.declined:
                print(f"train: asked to hand over at step {trainer.global_step}, the run's last: finishing here "
                      "(final checkpoint and export) instead of restarting on more GPUs", file=sys.stderr, flush=True)
            self.declined = True
        if trainer.world_size == 1:
            return asked
        import torch.distributed as dist

        flag = torch.tensor([int(asked)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _hand_over(self, trainer, pl_module) -> None:
        from stages.progress import save_final
        from stages.train_ckpt_io import wait_for_checkpoints
        from stages.train_stop import StopRequest

        step_at = time.time()
        if trainer.is_global_zero:
            hold("checkpoint", self.logs)
        checkpoint = trainer.checkpoint_callback
        last = Path(checkpoint.dirpath) / "last.ckpt"
        wait_for_checkpoints(trainer, sync=True)  # a step checkpoint still being written (last.ckpt links it)
        save_final(trainer, checkpoint, last)
        wait_for_checkpoints(trainer, sync=True)  # in place on disk before anyone is told
        if trainer.is_global_zero:
            request = read_json(self.logs / REQUEST) or {}
            write_json(self.logs / STOPPED, {"step": trainer.global_step, "requested_at": request.get("requested_at"),
                                             "step_at": step_at, "checkpoint_at": time.time()})
            print(f"train: handing over at step {trainer.global_step} ({request.get('reason', 'asked')}): checkpoint "
                  f"{last} in place in {time.time() - step_at:.1f} s; stopping so the run resumes on more GPUs",
                  file=sys.stderr, flush=True)
        if trainer.strategy.root_device.type == "cuda":  # the checkpoint holds them: Lightning's teardown after
            for opt in trainer.optimizers:  # the stop would copy them to host memory first (21 s at the 27B shape)
                opt.state.clear()
            for p in pl_module.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        StopRequest.record("the handover to more GPUs")
        raise KeyboardInterrupt("handover")  # Lightning's Ctrl-C path on every rank (stages/train_stop.py)


def handover_callback(run_dir: Path) -> Optional[HandoverCallback]:
    expanding, first = os.environ.get(ENV_DIR), os.environ.get(ENV_FIRST)
    if not expanding and not first:
        return None
    return HandoverCallback(Path(run_dir) / "logs", bool(expanding), Path(first) if first else None)

