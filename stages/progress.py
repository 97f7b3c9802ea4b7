"""Plain progress lines for training runs (step, loss, tau, steps/s, tokens/s, ETA) and the end of a run.

Contract: rank 0 prints one line every `every` optimizer steps to stderr (which works under nohup, tmux or
a scheduler's log, unlike a redrawn bar) and mirrors it to RUN/progress.json, which `dflash status`-style
tools and people in another shell can read while the run goes on. Nothing here touches the training math.
The end of a run: `FinalCheckpoint` writes RUN/checkpoints/last.ckpt at the end of a completed fit (before
Lightning's teardown), writing nothing when a checkpoint already holds the last step; `ValidateAtEnd` makes
the last batch validate, so the run's reported tau is the final drafter's. `resumable_csv_logger`: a resumed
run's RUN/logs/metrics.csv keeps the rows logged up to its checkpoint (Lightning's CSVLogger deleted them); its
steps, and TensorBoard's, count optimizer steps done, as everything else does (`one_step_count`).
How a run stops on Ctrl-C or SIGTERM, and what it exits with then, is stages/train_stop.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import lightning as L

from stages.train_startup import (StartupPhases, compile_summary, dynamo_times,  # noqa: F401
                                  process_start_time, thread_line)  # (process_start_time: callers here)


class ProgressLines(L.Callback):
    def __init__(self, run_dir: Path, every: int, started: float | None = None, phases: StartupPhases | None = None):
        self.run_dir, self.every = Path(run_dir), max(1, every)
        self.phases = phases
        self.started = process_start_time() if started is None else started  # when the command began (the user's wait)
        self.t0 = self.step0 = None
        self.tokens = 0.0
        self.first_step_s: float | None = None
        self.last_line: int | None = None
        self.done_at: float | None = None  # when fit's last step ended (on_train_end)
        self.after_first: tuple[float, int, float] | None = None  # (time, step, tokens) at the first batch's end
        self.fit_parts: StartupPhases | None = None  # fit set-up's parts (stages/train_startup.py)

    def setup(self, trainer, pl_module, stage):
        if self.phases is not None and self.first_step_s is None:  # fit set-up's parts, at Lightning's hooks
            self.fit_parts = StartupPhases(self.phases.t)
            self.fit_parts.mark("environment and setup hooks")

    def on_fit_start(self, trainer, pl_module):
        if self.fit_parts is not None:
            self.fit_parts.mark("model optimizer and restore")

    def on_sanity_check_end(self, trainer, pl_module):
        if self.fit_parts is not None:
            self.fit_parts.mark("sanity check")

    def on_train_start(self, trainer, pl_module):
        if self.phases is not None and self.first_step_s is None:
            if self.fit_parts is not None:
                for name, secs in getattr(pl_module, "fit_start_parts", []):  # the module's on_fit_start (after ours)
                    self.fit_parts.took(name, secs)
                self.fit_parts.mark("loops and loaders")
            self.phases.mark("fit set-up")  # ranks started, compile settings, optimizer, a resume's restore
        self.t0, self.step0, self.tokens = time.time(), trainer.global_step, 0.0
        self.first_step_s, self.last_line, self.after_first = None, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tokens += float(batch["seq_lens"].sum()) * trainer.world_size
        if self.first_step_s is None:  # the first batch carries the compile; say when it is over
            self.first_step_s = time.time() - self.started
            where = f" on rank {trainer.global_rank}" if trainer.world_size > 1 else ""  # each rank compiles on its own
            text = (f"train: first batch done {self.first_step_s:.1f} s after start{where} (includes loading and "
                    f"compiling); {time.time() - self.t0:.1f} s of it in the batch\n")
            if self.phases is not None:
                self.phases.mark("first batch")  # its loading and compiling
                text += self.phases.line(where) + "\n"
                if self.fit_parts is not None and self.fit_parts.phases:
                    text += self.fit_parts.line(where, "fit set-up") + "\n"
                text += compile_summary(*dynamo_times(), where=where) + "\n"  # the first batch's compiles
                from pipeline.provenance import HEAD_THREAD

                head = thread_line(list(HEAD_THREAD), self.started, where)
                text += head + "\n" if head else ""
            sys.stderr.write(text)  # one write: under DDP another rank's line cannot land inside it
            sys.stderr.flush()
            self.after_first = (time.time(), trainer.global_step, self.tokens)
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every or step in (self.step0, self.last_line):
            return  # (with gradient accumulation several batches end at one optimizer step: one line)
        self.last_line = step
        # rates from the end of the first batch, so that its compile does not inflate the ETA for long
        t1, step1, tokens1 = self.after_first if step > self.after_first[1] else (self.t0, self.step0, 0.0)
        dt = max(1e-6, time.time() - t1)
        rate, tok_rate = (step - step1) / dt, (self.tokens - tokens1) / dt
        planned = getattr(pl_module, "total_steps", None)  # the data plan's (it changes on a resume, ...)
        total = planned() if callable(planned) else trainer.estimated_stepping_batches
        eta = (total - step) / rate if rate > 0 else float("nan")
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("train/", "val/"))}
        state = {"state": "running", "step": step, "total_steps": int(total), "epoch": trainer.current_epoch,
                 "steps_per_s": rate, "tokens_per_s": tok_rate, "eta_s": eta, "time": time.time(),
                 "first_batch_s": self.first_step_s, "metrics": m}
        data = getattr(pl_module, "data_state", None)
        if callable(data):  # where the data plan stands (a following run: how far behind extraction)
            state["data"] = data()
        line = (f"train: step {step}/{int(total)} epoch {trainer.current_epoch} loss {m.get('train/loss', float('nan')):.4f} "
                f"tau {m.get('train/tau', float('nan')):.2f} {rate:.2f} steps/s {tok_rate:,.0f} tok/s "
                f"ETA {eta / 60:.1f} min")
        if "docs_per_row" in batch:  # train.packing: this batch's padded slots and documents per row
            from data.packing import padding_stats

            pad, per_row = padding_stats(batch)
            line += f" pad {100 * pad:.1f}% {per_row:.2f} docs/row"
        print(line, file=sys.stderr, flush=True)
        self._write(state)

    def on_train_end(self, trainer, pl_module):
        # runs before ModelCheckpoint's own end-of-training save (Lightning orders checkpoint callbacks last)
        self.done_at = time.time()
        if trainer.is_global_zero:
            print(f"train: training done at step {trainer.global_step}; writing the final checkpoint",
                  file=sys.stderr, flush=True)
            self._write({"state": "finished", "step": trainer.global_step, "time": time.time()})

    def on_exception(self, trainer, pl_module, exception):
        if trainer.is_global_zero:
            if isinstance(exception, (KeyboardInterrupt, SystemExit)):  # Ctrl-C, SIGTERM: resumable
                self._write({"state": "stopped", "step": trainer.global_step, "time": time.time()})
                return
            self._write({"state": "failed", "step": trainer.global_step, "error": f"{type(exception).__name__}: {exception}",
                         "time": time.time()})

    def _write(self, state: dict) -> None:
        tmp = self.run_dir / "progress.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.run_dir / "progress.json")


def final_writes(trainer, checkpoint, last: Path) -> bool:
    """Whether `save_final` writes: not when a checkpoint of this very step exists (or is being written)."""
    return not (getattr(checkpoint, "_last_global_step_saved", -1) == trainer.global_step and last.exists())


def save_final(trainer, checkpoint, last: Path) -> None:
    """Make RUN/checkpoints/last.ckpt hold the final state, writing only if no checkpoint has this step yet."""
    if not final_writes(trainer, checkpoint, last):
        return  # last.ckpt links the step checkpoint written at this very step
    from stages.train_ckpt_io import AsyncCheckpointIO

    # a new file, never an overwrite of the step checkpoint the link names. The atomic writer's rename replaces
    # the link itself, so last.ckpt names a checkpoint throughout; any other writer needs the link gone first
    atomic = isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO) and "://" not in str(last)
    if trainer.is_global_zero and last.is_symlink() and not atomic:
        last.unlink()
    trainer.save_checkpoint(last, weights_only=False)  # every rank calls it (it synchronises); rank 0 writes


class FinalCheckpoint:
    """The end of a completed fit: write last.ckpt while the weights are still on the GPU, then free them.

    Called from the LightningModule's `on_train_end`, which Lightning runs after every callback's (so after
    ModelCheckpoint's own end-of-training save, which would otherwise write once more, from freed weights) and
    before its teardown, which copies the module and the optimizer state to host memory (at the 27B shape
    ~21 GB of pageable copies, in the way of the user's final checkpoint) though nothing uses them after
    this. A stopped run (Ctrl-C, SIGTERM) never gets here. `free`: drop the weights, their gradients and the
    optimizer state afterwards, and end Inductor's compile workers while the write goes on (on GPU; the process
    ends next). `progress`: its `done_at` (the end of training, before
    ModelCheckpoint's own save) is where the reported time counts from. `end` times what follows, phase by
    phase (`mark`), for the end line stages/train_fit.finish prints (issue 46: the process's exit)."""

    def __init__(self, checkpoint, last: Path, free: bool, progress: ProgressLines | None = None):
        self.checkpoint, self.last, self.free, self.saved = checkpoint, last, free, False
        self.progress = progress
        self.end: StartupPhases | None = None  # the end's phases from the last step (`end_mark`, train_fit)

    def __call__(self, trainer, pl_module) -> None:
        from stages.train_ckpt_io import wait_for_checkpoints

        from stages.train_ckpt_io import AsyncCheckpointIO

        t = (self.progress.done_at if self.progress is not None else None) or time.time()
        io = trainer.strategy.checkpoint_io
        if trainer.is_global_zero and isinstance(io, AsyncCheckpointIO) and final_writes(trainer, self.checkpoint,
                                                                                         self.last):
            io.supersede()  # an older step checkpoint still being written: the final one replaces it (issue 46)
        wait_for_checkpoints(trainer, sync=True)  # a step checkpoint still being written (last.ckpt follows it)
        save_final(trainer, self.checkpoint, self.last)
        self.saved = True
        if self.free:  # the checkpoint is a host copy now, written in the background
            for opt in trainer.optimizers:
                opt.state.clear()
            for p in pl_module.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None  # Lightning's teardown copies what is left to host memory (5.3 s at the 27B shape)
            end_compile_workers()  # beside the write, not at the interpreter's exit
        wait_for_checkpoints(trainer)  # before the export reads it and before the process ends
        if trainer.is_global_zero:
            print(f"train: final checkpoint {self.last} in place {time.time() - t:.1f} s after training ended",
                  file=sys.stderr, flush=True)
        self.end = StartupPhases(t)
        self.end.mark("final checkpoint")
        sample_stacks()  # what the rest of the end does (Lightning's teardown, the exit), for benches

    def mark(self, name: str) -> None:
        """End the end's phase `name` (after the final checkpoint: Lightning's teardown, the loaders, the export)."""
        if self.end is not None:
            self.end.mark(name)


def end_compile_workers() -> None:
    """Inductor's compile-worker processes, shut down now (the final checkpoint's write goes on meanwhile) where
    the process compiled anything; torch's own exit handler otherwise waits for them after the run's last line
    (~4 s at the 27B shape on an H100, 2026-12-06). A later compile in this process starts a new pool."""
    if "torch._inductor.async_compile" in sys.modules:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()


def sample_stacks() -> None:
    """With DFLASH_EXIT_STACKS=S: every thread's Python stack every S seconds from now until the process is gone
    (faulthandler's watchdog: a sampling profile of a run's end for benches, issue 46); else nothing."""
    import faulthandler

    every = float(os.environ.get("DFLASH_EXIT_STACKS", "0") or 0)
    if every > 0:
        faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)


class ValidateAtEnd(L.Callback):
    """Validation runs every train.val_every batches (counted across epochs); this makes the last batch of the
    run validate too, so the summary's tau is the final drafter's. Lightning validates after a batch whenever
    `should_stop` is set, and the run ends there anyway."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        last_epoch = trainer.current_epoch >= trainer.max_epochs - 1 and batch_idx + 1 >= trainer.num_training_batches
        if last_epoch or 0 <= trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


class ValidateSkippedOnResume(L.Callback):
    """A step checkpoint is written at the end of its batch, before that batch's validation, and Lightning's
    restart from such a checkpoint takes the validation as done (it fast-forwards past it). A run killed between
    the two lost that validation: its metrics row, and the step's best-checkpoint candidacy. On resume, when the
    checkpoint's batch is a validation batch and RUN/logs/metrics.csv has no validation row logged for it (at
    the checkpoint's last logged step), the resumed run validates first, as the uninterrupted run did, and
    then trains on. Rank 0 reads the file before the logger rewrites it; every rank follows its decision."""

    def __init__(self, run_dir: Path, logged_through: int | None):
        # the checkpoint's last logged step counts before its batch's optimizer step; metrics.csv's after it
        self.pending = logged_through is not None and not _val_row_logged(run_dir, logged_through + 1)

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.strategy.broadcast(self.pending, src=0):
            return
        loop = trainer.fit_loop.epoch_loop
        train_one = loop.advance

        def advance(data_fetcher):
            loop.advance = train_one  # only the first batch of the resumed run is looked at
            if (loop.restarting and loop.restarted_on_train_batch_end and not loop.val_loop.restarted_mid_evaluation
                    and loop._should_check_val_fx(data_fetcher)):
                loop.val_loop.restarting = False  # a fresh validation, not the continuation of one
                loop._batches_that_stepped -= 1  # on_advance_end counts the checkpoint's batch again
                return  # on_advance_end runs the validation, as after the batch in the uninterrupted run
            return train_one(data_fetcher)

        loop.advance = advance


def _val_row_logged(run_dir: Path, step: int) -> bool:
    import csv

    try:
        with open(Path(run_dir) / "logs" / "metrics.csv", newline="") as f:
            return any(r.get("step") == str(step) and r.get("val/tau") for r in csv.DictReader(f))
    except OSError:
        return False


def resumable_csv_logger(run_dir: Path, logged_through: int | None):
    """Lightning's CSVLogger writing RUN/logs/metrics.csv. It deletes an existing file when it starts; for a
    resumed run (`logged_through` = the checkpoint's last logged step) this one keeps the rows up to that step
    and drops those after it, which the resumed run logs again."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    class KeepingWriter(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            path = Path(self.metrics_file_path)
            rows = []
            if logged_through is not None and path.exists():
                with open(path, newline="") as f:
                    rows = [r for r in csv.DictReader(f)  # steps one on from Lightning's (one_step_count)
                            if r.get("step", "").isdigit() and int(r["step"]) <= logged_through + 1]
            path.unlink(missing_ok=True)
            if rows:
                self.metrics_keys = sorted(rows[0])
                with open(path, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=self.metrics_keys)
                    w.writeheader()
                    w.writerows(rows)

    class KeepingCSVLogger(CSVLogger):
        @property
        @rank_zero_experiment
        def experiment(self):
            if self._experiment is None:
                os.makedirs(self.root_dir, exist_ok=True)
                self._experiment = KeepingWriter(log_dir=self.log_dir)
            return self._experiment

    return one_step_count(KeepingCSVLogger(run_dir, name="logs", version=""))


def one_step_count(logger):
    """`logger` with each row's step the optimizer steps done when it was logged, the count of the progress line,
    the checkpoints, summary.json and the eval report. Lightning logs a training row before its batch's optimizer
    step and validation before the step counter moves, one less (metrics.csv said 11 of a 12-step run)."""
    log = logger.log_metrics

    def log_metrics(metrics, step=None):
        return log(metrics, None if step is None else step + 1)

    logger.log_metrics = log_metrics
    return logger
