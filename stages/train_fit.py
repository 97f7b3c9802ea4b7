"""`dflash train`'s last phases, run in order by stages/train.py's `_train` after those of stages/train_phases.py:
build the drafter on this rank's device (`build_drafter`), the Trainer with its checkpointing, loggers and
callbacks (`build_trainer`), fit (`fit`), and finish (`finish`: the final checkpoint, the export, summary.json).

Contract:
- `build_drafter` is the first phase that writes to the run directory (it creates it and logs this process's
  output there); the drafter's initial weights follow from train.seed (DDP broadcasts rank 0's).
- `build_trainer` refuses a Lightning whose global rank and world differ from dflash's reading of the launcher's
  variables, and global rank 0 writes RUN/config.yaml (resumable: `resumable_config`) and RUN/command.txt.
- `fit` tells a stop (Ctrl-C, SIGTERM, `dflash run`'s handover: exit 130 with the resume command,
  stages/train_stop.py) and a lost peer across nodes (stages/train_nodes.py) from other errors, which keep
  their traceback (the error behind a stop's teardown error first).
- `finish` saves the final checkpoint when fit returned without one, waits for every checkpoint write, and on
  global rank 0 exports the chosen checkpoint (stages/best_checkpoint.py) and writes RUN/summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.config import Config, dump_config
from stages.train_phases import Data, Opened, Ranks
from stages.train_store import TrainError


@dataclass(frozen=True)
class Fitting:
    """The Trainer and the checkpointing that `fit` and `finish` use."""
    trainer: Any
    checkpoint: Any  # stages.train_ckpt_io.LinkAfterWrite
    checkpoint_path: Path
    final: Any  # stages.progress.FinalCheckpoint


def resumable_config(cfg: Config, store_path: str) -> Config:
    """The config RUN/config.yaml records: `cfg` with the store this run trains on (--store included) and the run
    directory, local paths made absolute, so that `dflash train --config RUN/config.yaml --resume` continues the
    run from any directory."""
    local = lambda p: p if "://" in p else str(Path(p).resolve())  # noqa: E731
    return dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, path=local(store_path)),
                               train=dataclasses.replace(cfg.train, run_dir=local(cfg.train.run_dir)))


def build_drafter(*, cfg: Config, run_dir: Path, store_path: str, ranks: Ranks, opened: Opened, data: Data):
    """The run directory created and this process's output logged there; the drafter built and initialised on
    this rank's GPU (initialising ~1.7B parameters on the CPU took ~20 s), seeded from train.seed."""
    from pipeline.lifecycle import log_process_output
    from stages.train_task import DrafterTask

    run_dir.mkdir(parents=True, exist_ok=True)
    log_process_output(run_dir, ranks.rank)
    # seeded, so a run's initial weights follow from train.seed (DDP then broadcasts rank 0's to all ranks)
    torch.manual_seed(cfg.train.seed)
    attrs = opened.attrs
    with torch.device(f"cuda:{ranks.devs[ranks.top.local]}" if ranks.use_gpu else "cpu"):
        task = DrafterTask(data.task_cfg, data.layer_ids, attrs["target"]["vocab_size"], data.head,
                           data.steps_per_epoch, attrs["encoding"], target_meta=attrs["target"], store_path=store_path)
    return task


def _loggers(run_dir: Path, resume_state: Optional[dict]) -> list:
    """The CSV logger (a resumed run keeps the rows logged up to its checkpoint and drops those after it, logged
    again) and TensorBoard's when tensorboard is installed."""
    from stages.progress import one_step_count, resumable_csv_logger

    loggers = [resumable_csv_logger(run_dir, resume_state["logged_through"] if resume_state else None)]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger

        import tensorboard  # noqa: F401

        loggers.append(one_step_count(TensorBoardLogger(run_dir, name="tensorboard", version="")))
    except ImportError:
        pass
    return loggers


def build_trainer(*, cfg: Config, run_dir: Path, ckpt_dir: Path, store_path: str, command: str, ranks: Ranks,
                  strategy: Any, task, data: Data, callbacks: list, resume_state: Optional[dict], phases) -> Fitting:
    """The Trainer with its checkpoints (every train.checkpoint_every steps, last.ckpt a link to the newest),
    progress lines, stop handling and best checkpoint; the drafter's size said; RUN/config.yaml and command.txt."""
    import lightning as L

    from stages.best_checkpoint import BestCheckpoint
    from stages.progress import FinalCheckpoint, ProgressLines, ValidateAtEnd, ValidateSkippedOnResume
    from stages.train_batch import plan_changed
    from stages.train_ckpt_io import AsyncCheckpointIO, LinkAfterWrite
    from stages.train_stop import ForceOnSecondCtrlC, SigtermLikeCtrlC

    task.train_sampler = data.sampler  # the step records consumed batches; Lightning checkpoints the loader's state
    task.planned_steps = data.planned
    # save_last="link": last.ckpt is a symlink to the newest step checkpoint, not a second full copy
    checkpoint = LinkAfterWrite(dirpath=ckpt_dir, every_n_train_steps=cfg.train.checkpoint_every, save_last="link",
                                save_top_k=1, filename="step{step}", auto_insert_metric_name=False)
    checkpoint_path = ckpt_dir / "last.ckpt"
    progress = ProgressLines(run_dir, cfg.train.log_every, phases=phases)
    task.on_train_finished = final = FinalCheckpoint(checkpoint, checkpoint_path, free=ranks.use_gpu,
                                                     progress=progress)
    loggers = _loggers(run_dir, resume_state)
    logged_through = resume_state["logged_through"] if resume_state else None
    trainer = L.Trainer(
        accelerator=ranks.accel, devices=ranks.devs, strategy=strategy, precision=ranks.precision,
        max_epochs=cfg.train.epochs, max_steps=cfg.train.max_steps,
        gradient_clip_val=None,  # train.grad_clip: DrafterTask.configure_gradient_clipping
        accumulate_grad_batches=cfg.train.accumulate_grad_batches,
        callbacks=[*callbacks, checkpoint, progress, ForceOnSecondCtrlC(), ValidateAtEnd(), SigtermLikeCtrlC(),
                   BestCheckpoint(ckpt_dir), ValidateSkippedOnResume(run_dir, logged_through)],
        num_nodes=ranks.top.num_nodes,
        # a resume on another number of ranks makes its first epoch another length than the next ones: only then
        # is the loader asked for its length every epoch (each ask is a collective). Validation counts batches
        # across epochs (every train.val_every batches, and after the last one: ValidateAtEnd)
        reload_dataloaders_every_n_epochs=1 if plan_changed(resume_state, ranks.world,
                                                            cfg.train.accumulate_grad_batches) else 0,
        logger=loggers,
        log_every_n_steps=cfg.train.log_every,
        val_check_interval=cfg.train.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,  # one display on a terminal too: ProgressLines' step line (stages/progress.py)
        default_root_dir=run_dir, deterministic=False,
        plugins=[AsyncCheckpointIO()],  # copied to host memory, written in the background (train_ckpt_io.py)
        enable_model_summary=False,  # its table goes to stdout and warns on bf16-mixed; the line below says it
    )
    top, rank, world = ranks.top, ranks.rank, ranks.world
    if (trainer.global_rank, trainer.world_size) != (rank, world):  # our reading of the environment is Lightning's
        raise TrainError(f"{top.where}: Lightning sees global rank {trainer.global_rank} of {trainer.world_size}, "
                         f"dflash read {rank} of {world} from the {top.env} environment; report this with the "
                         "launcher's variables (RANK, LOCAL_RANK, NODE_RANK, SLURM_*)")
    if ranks.launcher and rank == 0:
        n = sum(p.numel() for p in task.drafter.parameters())
        print(f"train: drafter {n / 1e6:.2f}M parameters ({cfg.drafter.arch}), on "
              f"{f'GPU {list(ranks.devs)}' if ranks.use_gpu else f'{ranks.devs} CPU process(es)'}, precision "
              f"{ranks.precision}", file=sys.stderr, flush=True)
    if trainer.is_global_zero:  # with the store and run dir used, absolute: `--config RUN/config.yaml --resume` works
        (run_dir / "config.yaml").write_text(dump_config(resumable_config(cfg, store_path)))
        (run_dir / "command.txt").write_text(command + "\n")
    return Fitting(trainer=trainer, checkpoint=checkpoint, checkpoint_path=checkpoint_path, final=final)


def fit(*, cfg: Config, fitting: Fitting, task, data: Data, resume: bool, last: Path, ckpt_dir: Path, ranks: Ranks,
        nodes, hint: str) -> Optional[int]:
    """Trainer.fit (from `last` on a resume); None when it returned, the exit code of a stopped run (130, its
    last words said), or the error: a lost peer's or rendezvous's one line, else the error behind a stop's."""
    from stages.train_stop import StopRequest, end_stopped_run, error_behind, stopped_by_user

    trainer = fitting.trainer
    StopRequest.install()
    try:
        trainer.fit(task, train_dataloaders=data.train_dl, val_dataloaders=data.val_dl,
                    ckpt_path=str(last) if resume else None, weights_only=True)
        fitting.final.mark("Lightning teardown")  # (after the final checkpoint: fit's own end)
    except BaseException as e:  # Lightning turns SIGTERM and Ctrl-C into SystemExit
        if not stopped_by_user(e, trainer):
            if nodes is not None:  # across nodes: a group that never formed, or a node that went away
                from stages.train_nodes import exit_lost_peer, lost_peer, rendezvous_error

                if not nodes.passed and lost_peer(e):
                    raise rendezvous_error(ranks.top, e, cfg.train.rendezvous_timeout_s) from None
                if lost_peer(e):
                    exit_lost_peer(e, trainer, ranks.top, ckpt_dir, hint)
            behind = error_behind(e)
            if behind is not e:
                raise behind from None
            raise
        return end_stopped_run(e, trainer, launcher=ranks.launcher, ckpt_dir=ckpt_dir, hint=hint)
    finally:  # loader workers end with the fit, not at the interpreter's exit (a leaked semaphore)
        close = getattr(data.train_dl, "close_stream", None)
        if close is not None:
            close()
        shutdown = getattr(getattr(data.val_dl, "_iterator", None), "_shutdown_workers", None)
        if shutdown is not None:  # the validation loader's persistent worker
            shutdown()
        fitting.final.mark("loaders")
    return None


def finish(*, cfg: Config, fitting: Fitting, task, run_dir: Path, ckpt_dir: Path, export: bool) -> int:
    """The final checkpoint when fit saved none, every write in place; on global rank 0 the export (the best
    checkpoint by val tau unless train.export_checkpoint is `last`), RUN/summary.json and the last line."""
    from stages.progress import save_final
    from stages.train_ckpt_io import wait_for_checkpoints

    trainer, checkpoint_path = fitting.trainer, fitting.checkpoint_path
    if not fitting.final.saved:  # fit returned without on_train_end (nothing to train: resumed at the last step)
        wait_for_checkpoints(trainer, sync=True)
        save_final(trainer, fitting.checkpoint, checkpoint_path)
    wait_for_checkpoints(trainer)  # every write in place before the export reads one and before the exit
    fitting.final.mark("checkpoint wait")
    if trainer.is_global_zero:
        summary = {"global_step": trainer.global_step, "epochs": trainer.current_epoch,
                   "val": getattr(task, "last_val", {}), "checkpoint": str(checkpoint_path)}
        if export:
            from pipeline.acceptance import checkpoint_val_tau
            from stages.best_checkpoint import choose_checkpoint
            from stages.export import export_checkpoint

            val = summary["val"]  # the final validation's, when it ran at the last step (ValidateAtEnd)
            last_tau = checkpoint_val_tau(val, trainer.global_step)
            choice = choose_checkpoint(ckpt_dir, cfg.train.export_checkpoint, last_tau)
            summary["export"] = str(export_checkpoint(str(choice.path), str(run_dir / "export"), choice=choice))
            summary["exported"] = choice.as_dict()
            print(f"train: exported {choice.reason} to {summary['export']}", file=sys.stderr, flush=True)
            print(serve_lines(summary["export"]), file=sys.stderr, flush=True)
            fitting.final.mark("export")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        fitting.final.mark("summary")
        say_end(fitting.final.end)
        tau = summary['val'].get('val/tau')
        print(f"train: {trainer.global_step} steps; val tau {'n/a' if tau is None else f'{tau:.3f}'}; "
              f"checkpoint {checkpoint_path}" + (f"; export {summary.get('export')}" if export else ""), file=sys.stderr)
    return 0


def say_end(end) -> None:
    """The end line (`train: end T s: final checkpoint s, Lightning teardown s, loaders s, checkpoint wait s,
    export s, summary s`, from the last step), then what keeps the process alive after it (issue 46): one line when
    the interpreter's exit handlers begin (`train: exit handlers begin S s after the end line`: the wait for
    threads that are not daemons comes before them) where DFLASH_EXIT_STACKS is set, as benches set it; with it
    the stacks are also sampled every S seconds from the final checkpoint on (stages/progress.sample_stacks)."""
    if end is None:  # no completed fit here (resumed at its last step): nothing measured
        return
    import atexit
    import time

    print(end.line(phase="end"), file=sys.stderr, flush=True)
    import os

    if not os.environ.get("DFLASH_EXIT_STACKS"):  # a bench's diagnostic only (the user's last line stays the run's)
        return
    said = time.time()
    # registered last, so it runs first of the exit handlers
    atexit.register(lambda: print(f"train: exit handlers begin {time.time() - said:.1f} s after the end line",
                                  file=sys.stderr, flush=True))


def serve_lines(export_dir: str) -> str:
    """The vLLM and SGLang commands that serve the run's export (`dflash export` prints the same), as train's
    lines: each heading and note `train: `-prefixed, the commands indented under them."""
    from stages.export import serve_commands_text

    return "\n".join(x if x.startswith("  ") else f"train: {x}" for x in serve_commands_text(export_dir).splitlines())

