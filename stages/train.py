"""`dflash train`: Lightning DDP training of the drafter from the store alone, then export.

`run_train` builds one frozen `TrainRequest` from its caller's options and the config; `_train` is the conductor:
the phases in order, each a function with named parameters (stages/train_phases.py: open the run, place the ranks,
open the store, build the data; stages/train_fit.py: build the drafter and the Trainer, fit, finish), with the
start-up timing line's marks between them. The store side is stages/train_store.py's (re-exported here: `TrainError`,
`check_store_matches`, `store_mismatch`).

Contract:
- Reads only the store (features, tokens, masks, frozen_head.safetensors); never loads the target.
- Refuses a store whose provenance does not match the config (target name and fingerprint, layer ids, hidden
  size, vocabulary/mask token, thinking mode; pipeline.provenance.config_differences), naming each difference.
- A store still being written is followed (`--follow`, or said so and done when the store is unfinished):
  training starts once the validation split and one optimizer step's samples are committed, reads committed
  samples only, waits when it has caught up, and ends after the configured epochs over the final store
  (data/follow.py; the first epoch takes samples in commit order, data/sampler.py).
- `strategy="ddp"` with one process per named GPU (`--gpus 5,6,7`), or CPU processes over gloo
  (`--devices N`). Lightning re-executes the command once per rank, so everything before `fit` here is
  deterministic and rank-independent (reading attrs, building objects, creating the same directories).
- Checkpoints every train.checkpoint_every steps and at the end into RUN/checkpoints (last.ckpt);
  `--resume` continues from last.ckpt with the same step, optimiser, scheduler and data position (the same
  sample of the same epoch; on another number of ranks the rest of the epoch is dealt over the new ranks),
  and RUN/logs/metrics.csv keeps the rows logged up to the checkpoint.
- After each validation that beats the best val/tau so far, RUN/checkpoints/best-step{N}.ckpt (weights only)
  replaces the previous best (stages/best_checkpoint.py; a resumed run keeps knowing the best so far).
- At the end, rank 0 exports the drafter to RUN/export (the serving directory format): the best checkpoint
  by val tau unless train.export_checkpoint is `last`, and says which one it exported and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.config import Config
from stages import train_fit, train_phases
from stages.train_store import TrainError, check_store_matches, store_mismatch  # noqa: F401  (their importers')
from stages.train_store import dataloaders as _dataloaders  # noqa: F401  (tests build the loaders by this name)


# `dflash train` options a later start of the same run does not repeat, each with whether it takes a value:
# --init-from (the run's weights are in its checkpoint now, and the two flags are refused together)
NOT_RESUMED = {"--init-from": True}


def resume_argv(words: list[str]) -> list[str]:
    """A `dflash train` command line that resumes its run: the same words without the options a resume does not
    repeat (NOT_RESUMED), with --resume (added at the end when missing). The resume hint of a stopped run
    (`resume_command`) and `dflash run`'s training child (stages/run.py) are both made by it."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in NOT_RESUMED:
            skip = NOT_RESUMED[w]
        elif not any(w.startswith(f"{flag}=") for flag in NOT_RESUMED):
            out.append(w)
    return out if "--resume" in out else out + ["--resume"]


def resume_command(command: str) -> str:
    """The command that resumes a stopped run (`resume_argv` of `command`)."""
    import shlex

    return shlex.join(resume_argv(shlex.split(command)))


def ddp_strategy(cfg: Config, use_gpu: bool, multi_node: bool = False):
    """Lightning's DDP (NCCL on GPUs, gloo on CPU) with the train.ddp_* options passed to DistributedDataParallel.
    Across nodes the group forms under train.rendezvous_timeout_s (stages/train_nodes.py lengthens it after the
    start-up check), so a node that cannot reach the master fails in minutes, not after torch's 30."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    t = cfg.train
    timeout = {"timeout": timedelta(seconds=t.rendezvous_timeout_s)} if multi_node else {}
    return DDPStrategy(process_group_backend="nccl" if use_gpu else "gloo", bucket_cap_mb=t.ddp_bucket_cap_mb,
                       gradient_as_bucket_view=t.ddp_gradient_as_bucket_view, static_graph=t.ddp_static_graph, **timeout)


@dataclass(frozen=True)
class TrainRequest:
    """One `dflash train` as asked: the config and every option of run_train's callers (the CLI, `dflash demo`),
    built once by run_train. `cfg` itself stays the run's one config object (--init-from and --num-nodes are
    recorded in it: stages/train_phases.py)."""
    cfg: Config
    store: Optional[str] = None  # --store, else cfg.store.path
    gpus: Optional[list[int]] = None  # [] : no GPU; None: GPU 0 when there is one
    devices: Optional[int] = None  # CPU processes without GPUs
    resume: bool = False
    command: str = "dflash train"  # the command line, for RUN/command.txt and the resume hint
    export: bool = True
    rebuild_compile_cache: bool = False
    follow: bool = False  # --follow, or set for its ranks by a following launcher (DFLASH_TRAIN_FOLLOW)
    init_from: Optional[str] = None
    num_nodes: Optional[int] = None
    committed_only: bool = False

    @property
    def store_path(self) -> str:
        return self.store or self.cfg.store.path

    @property
    def paths(self) -> train_phases.RunPaths:
        return train_phases.RunPaths(Path(self.cfg.train.run_dir))


def run_train(cfg: Config, *, store: Optional[str] = None, gpus: Optional[list[int]] = None,
              devices: Optional[int] = None, resume: bool = False, command: str = "dflash train", export: bool = True,
              rebuild_compile_cache: bool = False, follow: bool = False, init_from: Optional[str] = None,
              num_nodes: Optional[int] = None, committed_only: bool = False) -> int:
    """`dflash train`; a disk that fills (a checkpoint, the logs, the export) ends it with one line naming the
    disk and the resume command (pipeline.preflight.DiskFull, exit 2), not Lightning's traceback."""
    from pipeline.preflight import DiskFull, disk_full_error, disk_full_message

    req = TrainRequest(cfg, store=store, gpus=gpus, devices=devices, resume=resume, command=command, export=export,
                       rebuild_compile_cache=rebuild_compile_cache,
                       follow=follow or os.environ.get("DFLASH_TRAIN_FOLLOW") == "1",  # a following launcher's rank
                       init_from=init_from, num_nodes=num_nodes, committed_only=committed_only)
    try:
        return _train(req)
    except BaseException as e:
        full = disk_full_error(e)
        if full is None:
            raise
        raise DiskFull(disk_full_message(full, cfg.train.run_dir, resume_command(command))) from None


def _train(req: TrainRequest) -> int:
    """The conductor: the phases in order (stages/train_phases.py, stages/train_fit.py), each start-up phase's
    seconds marked between them (one line at the first batch, issue 31 item 1)."""
    from stages.train_startup import StartupPhases

    phases = StartupPhases()
    phases.mark("launch and imports")  # the interpreter, the CLI's imports (torch), the config
    cfg, paths, store_path, hint = req.cfg, req.paths, req.store_path, resume_command(req.command)
    train_phases.open_run(cfg=cfg, paths=paths, resume=req.resume, init_from=req.init_from)
    ranks = train_phases.place_ranks(cfg=cfg, gpus=req.gpus, devices=req.devices, num_nodes=req.num_nodes)
    if cfg.train.num_workers > 0:  # the loader workers' forkserver imports torch beside this process's set-up
        from data.loader_workers import start_early

        start_early()
    opened = train_phases.open_training_store(cfg=cfg, store_path=store_path, follow=req.follow,
                                              committed_only=req.committed_only, resume=req.resume, last=paths.last,
                                              ranks=ranks, command=req.command, hint=hint)
    if opened is None:  # Ctrl-C while waiting for the store, before the first step (said so)
        from pipeline.lifecycle import ExitCode

        return ExitCode.STOPPED
    phases.mark("store checks")
    train_phases.import_lightning()  # while the frozen head's checksum runs in its thread
    phases.mark("Lightning imports")
    strategy = ddp_strategy(cfg, ranks.use_gpu, multi_node=ranks.top.num_nodes > 1) if ranks.world > 1 else "auto"
    data = train_phases.build_data(cfg=cfg, store_path=store_path, resume=req.resume, last=paths.last, ranks=ranks,
                                   opened=opened, rebuild_compile_cache=req.rebuild_compile_cache)
    callbacks, nodes = train_phases.extra_callbacks(cfg=cfg, run_dir=paths.run_dir, store_path=store_path, ranks=ranks,
                                                    opened=opened, data=data)
    phases.mark("compile cache and loaders")
    task = train_fit.build_drafter(cfg=cfg, run_dir=paths.run_dir, store_path=store_path, ranks=ranks,
                                   opened=opened, data=data)
    phases.mark("drafter")
    fitting = train_fit.build_trainer(cfg=cfg, run_dir=paths.run_dir, ckpt_dir=paths.ckpt_dir, store_path=store_path,
                                      command=req.command, ranks=ranks, strategy=strategy, task=task, data=data,
                                      callbacks=callbacks, resume_state=opened.resume_state, phases=phases)
    phases.mark("trainer")
    if task.compiles("cuda" if ranks.use_gpu else "cpu"):  # Inductor's imports, while the head's check and load finish
        from pipeline.compile_setup import import_inductor

        import_inductor()
        phases.mark("compile imports")
    opened.head_check()  # the frozen head's checksum and load, overlapped with the set-up above
    phases.mark("frozen-head check wait")
    stopped = train_fit.fit(cfg=cfg, fitting=fitting, task=task, data=data, resume=req.resume, last=paths.last,
                            ckpt_dir=paths.ckpt_dir, ranks=ranks, nodes=nodes, hint=hint)
    if stopped is not None:  # a stopped run's exit code, its last words said
        return stopped
    return train_fit.finish(cfg=cfg, fitting=fitting, task=task, run_dir=paths.run_dir, ckpt_dir=paths.ckpt_dir,
                            export=req.export)

