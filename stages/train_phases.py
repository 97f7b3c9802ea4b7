"""`dflash train`'s phases up to the drafter, each one function with named parameters, run in order by
stages/train.py's `_train` (the conductor, which marks the start-up timing line's phases between them:
stages/train_startup.py); the later phases (drafter, trainer, fit, finish) are stages/train_fit.py's.

The phases: open the run (`open_run`: flags that contradict each other or the run directory, the launcher's
clean-up of the names a kill left), place this process (`place_ranks`: accelerator, devices, precision, its rank),
open the store (`open_training_store`: a resume's pre-read, the store checks, the wait for a followed store), load
Lightning (`import_lightning`), build the data (`build_data`: --init-from's fit, the compile cache, the loaders,
the data plan, a resume's data position) and the callbacks (`extra_callbacks`).

Contract:
- Side effects happen in the order they always have: nothing here writes to the run directory (the launcher only
  removes a kill's leftovers from its checkpoints), so a bad flag, store, checkpoint, data plan or --init-from
  export stops the run before anything is written (stages/train_fit.build_drafter creates the directory).
- Everything here is deterministic and rank-independent (Lightning re-executes the command per rank), except
  what only the launcher says, checks or cleans up.
- `cfg` is the run's one config object: `open_run` records --init-from in it and `place_ranks` --num-nodes
  (both then recorded in RUN/config.yaml and the checkpoints).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pipeline import store as st
from pipeline.config import Config, dump_config
from stages.train_store import TrainError, checkpoint_state, dataloaders, open_store


@dataclass(frozen=True)
class RunPaths:
    """The run directory and the checkpoint a resume continues from."""
    run_dir: Path

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def last(self) -> Path:
        return self.ckpt_dir / "last.ckpt"


@dataclass(frozen=True)
class Ranks:
    """Where this process trains: the accelerator, its devices and precision, and its place among the ranks."""
    use_gpu: bool
    accel: str
    devs: Any  # the GPU ids (a list), or the number of CPU processes
    precision: str
    top: Any  # stages.train_nodes.Topology: global and local rank, nodes
    launcher: bool  # the process the user started (Lightning sets LOCAL_RANK in the ranks it starts)

    @property
    def world(self) -> int:
        return self.top.world  # global: the sampler deals over nodes x ranks per node

    @property
    def rank(self) -> int:
        return self.top.rank


@dataclass(frozen=True)
class Opened:
    """The store as this run reads it (stages/train_store.open_store) and a resume's pre-read checkpoint."""
    resume_state: Optional[dict]
    attrs: dict
    reader: Any
    stream_epochs: tuple
    head_check: Callable[[], None]  # waits for the frozen head's checksum; raises if it failed


@dataclass(frozen=True)
class Data:
    """The loaders, their sampler and the data plan, and the config the drafter is built from."""
    task_cfg: Config  # cfg, less init_from on a resume (its weights come from the checkpoint)
    layer_ids: list
    head: str
    train_dl: Any
    val_dl: Any
    sampler: Any
    planned: int  # the LR schedule's length in optimizer steps
    steps_per_epoch: int


def open_run(*, cfg: Config, paths: RunPaths, resume: bool, init_from: Optional[str]) -> None:
    """Refuse --resume with --init-from, a resume without a checkpoint and a new run over an old one; record
    --init-from in cfg; the launcher removes the names a kill left in the checkpoint directory (issue 40)."""
    run_dir, ckpt_dir, last = paths.run_dir, paths.ckpt_dir, paths.last
    if resume and init_from:
        raise TrainError(f"--init-from starts a new run from an export's weights; --resume continues this run from "
                         f"{last} (its weights, optimizer and data position). Pass one of them, not both")
    if init_from:
        cfg.drafter.init_from = str(Path(init_from).resolve())  # recorded in RUN/config.yaml and the checkpoints
    if "LOCAL_RANK" not in os.environ:  # the launcher, before its ranks start: names left by a kill (issue 40)
        from pipeline.ckpt_io import remove_stale_temps, repair_last_link

        remove_stale_temps(ckpt_dir)
        if resume:
            repair_last_link(ckpt_dir)
    if resume and not last.exists():
        raise TrainError(f"--resume: no checkpoint at {last}; start without --resume")
    if not resume and (last.exists() or last.is_symlink()):
        raise TrainError(f"{run_dir} already holds a run (checkpoint {last}); pass --resume to continue it, "
                         "or set --set train.run_dir=NEW_DIR for a new run")


def place_ranks(*, cfg: Config, gpus: Optional[list[int]], devices: Optional[int], num_nodes: Optional[int]) -> Ranks:
    """The accelerator and devices (--gpus, else --devices CPU processes), this process's rank from the launcher's
    variables; a started rank dies with its launcher, and the launcher checks that its GPUs are free."""
    use_gpu = torch.cuda.is_available() and gpus != []
    if use_gpu:
        accel, devs = "gpu", (gpus if gpus else [0])
        per_node = len(devs)
        precision = cfg.train.precision
    else:
        accel, devs = "cpu", (devices or 1)
        per_node = devs
        precision = "32-true"
        # share the cores: OpenMP threads that outnumber cores spin against each other (10x slower steps);
        # an explicit OMP_NUM_THREADS (several runs side by side) wins
        from pipeline.preflight import cpu_threads

        torch.set_num_threads(cpu_threads(per_node, reserve=1 if cfg.train.num_workers > 0 else 0))
    from stages.train_nodes import Topology

    if num_nodes is not None:
        cfg.train.num_nodes = num_nodes  # recorded in RUN/config.yaml
    top = Topology.detect(cfg.train.num_nodes, per_node)  # which rank this is, from SLURM/torchrun/Lightning's variables
    launcher = "LOCAL_RANK" not in os.environ  # Lightning sets it in the per-rank processes it starts
    if not launcher:
        from pipeline.lifecycle import die_with_parent

        die_with_parent()  # a rank whose launcher died must not hang on in a collective
    if use_gpu and launcher and not top.external:  # before any rank touches a GPU (srun/torchrun: the scheduler's)
        from pipeline.preflight import check_gpus_free

        check_gpus_free(list(devs), need_gib=16)
    return Ranks(use_gpu=use_gpu, accel=accel, devs=devs, precision=precision, top=top, launcher=launcher)


def open_training_store(*, cfg: Config, store_path: str, follow: bool, committed_only: bool, resume: bool, last: Path,
                        ranks: Ranks, command: str, hint: str) -> Optional[Opened]:
    """A resume's checkpoint pre-read and its global batch on this world size, then the store opened and checked;
    None after a Ctrl-C while waiting for the store (said in one line: the caller exits STOPPED)."""
    resume_state = checkpoint_state(last) if resume else None
    from stages.train_batch import resume_accumulate

    resume_accumulate(cfg, resume_state, ranks.world, say=ranks.rank == 0)  # the global batch kept on another world size
    try:
        attrs, reader, stream_epochs, head_check = open_store(cfg, store_path, follow, resume_state, ranks.launcher,
                                                              ranks.rank, ranks.world, committed_only,
                                                              head_to=head_device(ranks))
    except KeyboardInterrupt:  # Ctrl-C while waiting for extraction, before the first step: no "Aborted!"
        done = (f"resume with: {hint}" if resume else
                f"no step was trained, so nothing to resume; start again with: {command}")
        print(f"train: stopped while waiting for the store at {store_path} before the first step; {done}",
              file=sys.stderr, flush=True)
        return None
    return Opened(resume_state=resume_state, attrs=attrs, reader=reader, stream_epochs=stream_epochs,
                  head_check=head_check)


def head_device(ranks: Ranks) -> tuple:
    """(device, dtype) the training module will hold the frozen head on: Lightning's device for this local rank
    (`parallel_devices[local_rank]`, the --gpus entry) and its compute dtype. The head is loaded there while the
    set-up goes on (issue 46); were this ever not the module's device, the fit moves it (correct, only slower)."""
    from pipeline.train_step import compute_dtype  # torch only: this runs before Lightning is imported

    if not ranks.use_gpu:
        return torch.device("cpu"), compute_dtype("cpu", ranks.precision)
    return torch.device("cuda", ranks.devs[ranks.top.local]), compute_dtype("cuda", str(ranks.precision))


def import_lightning() -> None:
    """Lightning and the training modules (~5 s of imports), loaded while the head's checksum runs in its thread
    (the phases after this one import from them at no cost); third-party lines quietened (pipeline/quiet_log.py).
    torchmetrics is reduced to the two classes Lightning imports (stages/lightning_import.py: its optional
    backends, transformers among them, were most of this phase)."""
    from stages.lightning_import import import_lightning as light_import

    light_import()

    import stages.best_checkpoint  # noqa: F401
    import stages.progress  # noqa: F401
    import stages.train_stop  # noqa: F401
    import stages.train_ckpt_io  # noqa: F401
    import stages.train_task  # noqa: F401
    from pipeline.quiet_log import quiet_third_party

    quiet_third_party()  # each third-party line fixed or filtered, with its reason (pipeline/quiet_log.py)


def compile_cache(cfg: Config, rebuild: bool, report: bool) -> Path:
    """Point inductor/triton caches at a directory keyed by torch, dflash and the drafter's shape, shared by
    every run of that shape on this machine (pipeline.preflight.compile_cache_root)."""
    from pipeline import __version__
    from pipeline.preflight import compile_cache_dir, compile_cache_root, use_compile_cache

    drafter = {**dataclasses.asdict(cfg.drafter), "init_from": None}  # the weights' origin changes no kernel
    key = {"torch": torch.__version__, "dflash": __version__, "drafter": drafter,
           "precision": cfg.train.precision, "compile": cfg.train.compile, "num_anchors": cfg.train.num_anchors}
    d = compile_cache_dir(compile_cache_root(), key, rebuild=rebuild)
    warm = (d / "inductor").is_dir()
    use_compile_cache(d)
    if report:
        print(f"train: compile cache {d} ({'warm: the first step reuses earlier kernels' if warm else 'cold: the first step compiles, a few minutes'})",
              file=sys.stderr, flush=True)
    return d


def build_data(*, cfg: Config, store_path: str, resume: bool, last: Path, ranks: Ranks, opened: Opened,
               rebuild_compile_cache: bool) -> Data:
    """--init-from's fit to the store (before anything is written), the compile cache, the loaders, the LR
    schedule's length, and a resume's data position (refused when the checkpoint packed otherwise)."""
    launcher, attrs, resume_state = ranks.launcher, opened.attrs, opened.resume_state
    layer_ids, head = list(attrs["layer_ids"]), st.frozen_head_path(store_path)  # matched by open_store
    task_cfg = cfg
    if cfg.drafter.init_from and resume:  # a resumed run's weights come from its checkpoint
        task_cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, init_from=None))
    elif cfg.drafter.init_from:  # before anything is written: a misfit export stops here
        from stages.init_from import check_init_from

        check_init_from(cfg, attrs, layer_ids, cfg.drafter.init_from)
        if launcher:
            print(f"train: starting from the weights of {cfg.drafter.init_from} (fresh optimizer and schedule)",
                  file=sys.stderr, flush=True)
    if ranks.use_gpu:
        compile_cache(cfg, rebuild=rebuild_compile_cache and launcher, report=launcher)
    train_dl, val_dl, sampler = dataloaders(cfg, store_path, opened.reader, ranks.rank, ranks.world,
                                            128 if ranks.use_gpu else 1, opened.stream_epochs)
    if val_dl is None and launcher:
        print("train: the store has no validation split, so the run validates nothing (val tau n/a)",
              file=sys.stderr, flush=True)
    from data.sampler import remaining_steps

    # the LR schedule's length: a fresh run's plan (a following run counts the samples the store will hold);
    # a resumed run gets its schedule back from the checkpoint and adjusts it when the plan changed (train_task)
    planned = remaining_steps(sampler, cfg.train.epochs, cfg.train.accumulate_grad_batches,
                              planned=bool(opened.stream_epochs))
    if cfg.train.max_steps > planned and launcher and ranks.rank == 0:  # Lightning stops at whichever comes first
        print(f"train: train.max_steps={cfg.train.max_steps} is more than train.epochs={cfg.train.epochs} give on "
              f"this store ({planned} steps): the run stops after {planned}; raise train.epochs to train longer",
              file=sys.stderr, flush=True)
    if cfg.train.max_steps >= 0:
        planned = min(planned, cfg.train.max_steps)
    if resume_state and resume_state["loader"]:
        sampler.load_state_dict(resume_state["loader"])
        if sampler.group_factor != cfg.train.length_group_factor and launcher:
            print(f"train: resuming with train.length_group_factor={sampler.group_factor}, the checkpoint's (its "
                  f"epochs were planned with it; the config says {cfg.train.length_group_factor}); a new run "
                  "takes the new value", file=sys.stderr, flush=True)
        if sampler.saved_pack_tokens != sampler.pack_tokens:
            said = lambda n: f"train.packing=true, pack_tokens {n}" if n else "train.packing=false"  # noqa: E731
            raise TrainError(f"{last} was trained with {said(sampler.saved_pack_tokens)}, the config says "
                             f"{said(sampler.pack_tokens)}: its data position holds only under the same plan; resume "
                             "with the checkpoint's setting (--set train.packing=... train.pack_tokens=...) or start "
                             "a new train.run_dir")
    steps_per_epoch = max(1, len(sampler) // cfg.train.accumulate_grad_batches)
    return Data(task_cfg=task_cfg, layer_ids=layer_ids, head=head, train_dl=train_dl, val_dl=val_dl, sampler=sampler,
                planned=planned, steps_per_epoch=steps_per_epoch)


def extra_callbacks(*, cfg: Config, run_dir: Path, store_path: str, ranks: Ranks, opened: Opened,
                    data: Data) -> tuple[list, Any]:
    """(callbacks, nodes check or None): a resume's batch realignment, the step profile, `dflash run`'s handover,
    and across nodes the start-up check that every rank agrees on config, store, data plan and checkpoint."""
    resume_state, sampler = opened.resume_state, data.sampler
    from stages.train_batch import realign_callback

    callbacks, nodes = ([realign_callback(sampler, resume_state)] if resume_state else []), None
    if cfg.train.profile_steps is not None:  # where a step's time goes (stages/train_profile.py)
        from stages.train_profile import StepProfile

        callbacks.append(StepProfile(*cfg.train.profile_steps, run_dir / "logs", cuda=ranks.use_gpu))
    from stages.train_handover import handover_callback

    handover = handover_callback(run_dir)  # `dflash run`'s expansion: checkpoint and stop when asked
    if handover is not None:
        callbacks.append(handover)
    if ranks.top.num_nodes > 1:  # every rank's config, store, data plan and checkpoint compared once the group forms
        from stages.train_nodes import nodes_check, store_facts

        facts = {"config": dump_config(cfg), "store": store_facts(store_path, opened.attrs, opened.reader),
                 "plan": {"stream_epochs": sorted(opened.stream_epochs), "batches": len(sampler),
                          "steps": data.planned},
                 "resume": resume_state and {"step": resume_state["global_step"], "loader": resume_state["loader"]}}
        nodes = nodes_check(ranks.top, facts, run_dir, cfg.train.collective_timeout_s)
        callbacks.append(nodes)
    return callbacks, nodes
