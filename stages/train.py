"""`dflash train`: Lightning DDP training of the drafter from the store alone, then export.

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

import dataclasses
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from pipeline import store as st
from pipeline.config import Config, anchors_per_token, dump_config, pack_tokens
from pipeline.errors import UserError
from pipeline.provenance import config_differences, start_frozen_head_check


class TrainError(UserError, RuntimeError):
    pass


def check_store_matches(cfg: Config, attrs: dict) -> list[int]:
    """Return the layer ids to train with, or raise TrainError naming every mismatch (pipeline.provenance's
    config_differences)."""
    layer_ids, diffs = config_differences(cfg, attrs)
    if diffs:
        raise store_mismatch(diffs)
    return layer_ids


def store_mismatch(diffs: list[str], what: str = "this config") -> TrainError:
    """The one refusal of a store made for another target or config (train and eval)."""
    return TrainError(f"the store does not match {what}:\n  " + "\n  ".join(diffs)
                      + "\nPoint --store at a store made for this target/config, or fix the config.")


def _sources(reader) -> tuple:
    """(training samples, validation refs) of a finished store's reader or of a growing store (--follow)."""
    from data.follow import GrowingStore
    from data.sampler import FixedSamples

    if isinstance(reader, GrowingStore):
        return reader, reader.validation()
    train = [r for r in reader.samples if r.split == st.SPLITS["train"]]  # ordered by sample id
    return FixedSamples(train), [r for r in reader.samples if r.split == st.SPLITS["validation"]]


def _dataloaders(cfg: Config, store_path: str, reader, rank: int, world: int, pad_multiple: int,
                 stream_epochs: tuple = ()):
    from data.follow import GrowingStore
    from data.sampler import FixedSamples
    from data.store_dataset import RankBatchSampler, ResumableLoader, StoreDataset, collate, worker_init

    t = cfg.train
    train, val = _sources(reader)
    if not train.planned:
        raise TrainError(f"the store at {store_path} has no training samples")
    growing = isinstance(reader, GrowingStore)
    partial_store = growing or not all(p.done for p in reader.progress.values())  # --committed-only: what is committed
    a_mult = max(1, 128 // cfg.drafter.block_size) if pad_multiple > 1 else 1
    n_anchor = int(-(-t.num_anchors // a_mult) * a_mult)
    col = partial(collate, pad_multiple=pad_multiple, num_anchors=n_anchor)
    packing = pack_tokens(cfg)
    if packing:  # rows of several samples (data/packing.py); the anchor width a multiple of the unpacked one
        from data.packing import collate_packed

        col = partial(collate_packed, pack_tokens=packing, pad_multiple=pad_multiple, anchor_multiple=n_anchor)
    wait_log = str(Path(t.run_dir) / "logs" / "rank0.log") if growing and rank == 0 else None  # waits said there
    train_ds = StoreDataset(store_path, [], t.num_anchors, t.seed, growing=partial_store, wait_log=wait_log,
                            anchors_per_token=anchors_per_token(cfg), follow_timeout_s=t.follow_timeout_s)  # validation keeps the fixed rule: comparable
    sampler = RankBatchSampler(train, t.batch_size, rank, world, t.seed, stream_epochs=stream_epochs,
                               buffer=t.follow_buffer, group_factor=t.length_group_factor, pack_tokens=packing,
                               accumulate=t.accumulate_grad_batches)
    # spawn, not fork: this process already runs zarr's IO thread, and forking beside it can deadlock
    kw = dict(num_workers=t.num_workers, collate_fn=col, worker_init_fn=worker_init,
              multiprocessing_context="spawn" if t.num_workers > 0 else None, pin_memory=torch.cuda.is_available(),
              persistent_workers=t.num_workers > 0, prefetch_factor=4 if t.num_workers > 0 else None)
    train_dl = ResumableLoader(train_ds, batch_sampler=sampler, **kw)
    if t.accumulate_grad_batches > 1:  # normalise the loss over each accumulation window, not per micro-batch
        from pipeline.masks import loss_weight_sum

        train_dl.accumulate = t.accumulate_grad_batches
        train_dl.batch_weight = lambda b: loss_weight_sum(b["tokens"], b["loss_mask"], b["anchors"],
                                                          cfg.drafter.block_size, t.gamma, b.get("doc_ids"))
    val_dl = None
    if val:
        val_ds = StoreDataset(store_path, [], t.num_anchors, t.seed, fixed_anchors=True, growing=partial_store)
        val_sampler = RankBatchSampler(FixedSamples(val), t.batch_size, rank, world, t.seed, shuffle=False)
        # validation stays one sample per row (the unpacked collate): val metrics comparable with or without packing
        val_kw = {**kw, "persistent_workers": False, "collate_fn": partial(collate, pad_multiple=pad_multiple,
                                                                            num_anchors=n_anchor)}
        val_dl = torch.utils.data.DataLoader(val_ds, batch_sampler=val_sampler, **val_kw)
    return train_dl, val_dl, sampler


def _checkpoint_state(path: Path) -> dict:
    """What a resume needs before Lightning loads the checkpoint: the data position and the last logged step.

    The data position is restored here, not left to Lightning: Lightning 2.6 restores a loader's state in
    FitLoop.setup_data only, and a train loader already set up by then (as Lightning's
    `estimated_stepping_batches` does from configure_optimizers) never got it: a resumed epoch restarted at
    batch 0 (issue 23). Memory-mapped: the weights are not read."""
    from pipeline.ckpt_io import load_training_checkpoint

    ckpt = load_training_checkpoint(path, mmap=True)  # weights_only: never runs code from the file
    loop = ckpt.get("loops", {}).get("fit_loop", {})
    loaders = loop.get("state_dict", {}).get("combined_loader") or [None]
    saved_train = ((ckpt.get("dflash") or {}).get("config") or {}).get("train") or {}
    return {"loader": loaders[0], "global_step": int(ckpt.get("global_step", 0)),
            "accumulate": saved_train.get("accumulate_grad_batches"),  # a checkpoint whose loader lacks it
            "logged_through": int(loop.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", -1))}


def _open_store(cfg: Config, store_path: str, follow: bool, resume_state: Optional[dict], launcher: bool, rank: int,
                world: int, committed_only: bool = False):
    """(root attrs, reader, stream epochs, head check): a finished store's reader, or a growing store once it is
    trainable; `head check()` waits for the frozen head's checksum (a background thread) and raises if it failed.
    `committed_only`: an unfinished store's committed samples are read as a finished store's (no following)."""
    from data.follow import GrowingStore, min_start_samples, wait_for_store

    try:
        attrs = st.read_root_attrs(store_path)
    except st.StoreError:
        if not follow:
            raise
        attrs = None  # being created by the extraction this run follows
    if attrs is None and not follow:
        raise TrainError(f"no store at {store_path}; run `dflash extract` first or pass --store PATH")
    if attrs is None or (follow and not st.exists(st.frozen_head_path(store_path))):
        attrs = wait_for_store(store_path, say=None if rank == 0 else (lambda _m: None))
    check_store_matches(cfg, attrs)
    unfinished = _unfinished_shards(store_path, attrs)
    if committed_only and follow:
        raise TrainError("--committed-only trains on the samples committed now and --follow waits for more: pass one")
    if unfinished and committed_only:
        reader = st.StoreReader(store_path, require_complete=False)
        if launcher:
            print(f"train: --committed-only: training on the {len(reader.samples)} samples committed to {store_path} "
                  f"(shard(s) {unfinished} not finished), as on a finished store", file=sys.stderr, flush=True)
        return attrs, reader, (), start_frozen_head_check(store_path)
    if unfinished and not follow:
        if launcher:
            print(f"train: the store at {store_path} is still being written (shard(s) {unfinished} not finished): "
                  "training follows the extraction, as with --follow (waits when it has caught up, ends after "
                  f"train.epochs over the final store)", file=sys.stderr, flush=True)
        follow = True
    if follow and launcher:
        os.environ["DFLASH_TRAIN_FOLLOW"] = "1"  # the ranks Lightning starts follow too, whatever they find
    saved = (resume_state or {}).get("loader") or {}  # a resumed run keeps the epochs its checkpoint streamed
    stream_epochs = tuple(saved.get("stream_epochs", ())) if resume_state else ((0,) if follow else ())
    if not follow and not stream_epochs:
        head = st.frozen_head_path(store_path)
        if not st.exists(head):
            raise TrainError(f"{head} is missing: the store is incomplete; resume `dflash extract` to write it")
        head_check = start_frozen_head_check(store_path)  # a changed or damaged head stops before fit
        return attrs, st.StoreReader(store_path), stream_epochs, head_check
    head_check = start_frozen_head_check(store_path)  # written (checksum first) before any shard's first batch
    head_check()  # at once: a following run may wait long for samples, and a bad head must not wait with it
    t = cfg.train
    growing = GrowingStore(store_path, report=rank == 0, timeout_s=t.follow_timeout_s)
    saved_buffer = saved.get("buffer", t.follow_buffer)  # a resumed run draws as it did
    growing.wait_until_trainable(min_start_samples(world, t.batch_size, t.accumulate_grad_batches) + saved_buffer)
    return attrs, growing, stream_epochs, head_check


def _unfinished_shards(store_path: str, attrs: dict) -> list[int]:
    return [s.index for s in st.read_all_progress(store_path) if not s.done]


def _compile_cache(cfg: Config, rebuild: bool, report: bool) -> Path:
    """Point inductor/triton caches at a directory keyed by torch, dflash and the drafter's shape, shared by
    every run of that shape on this machine (pipeline.preflight.compile_cache_root)."""
    import dataclasses

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


def resumable_config(cfg: Config, store_path: str) -> Config:
    """The config RUN/config.yaml records: `cfg` with the store this run trains on (--store included) and the run
    directory, local paths made absolute, so that `dflash train --config RUN/config.yaml --resume` continues the
    run from any directory."""
    local = lambda p: p if "://" in p else str(Path(p).resolve())  # noqa: E731
    return dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, path=local(store_path)),
                               train=dataclasses.replace(cfg.train, run_dir=local(cfg.train.run_dir)))


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


def run_train(cfg: Config, *, store: Optional[str] = None, gpus: Optional[list[int]] = None,
              devices: Optional[int] = None, resume: bool = False, command: str = "dflash train", export: bool = True,
              rebuild_compile_cache: bool = False, follow: bool = False, init_from: Optional[str] = None,
              num_nodes: Optional[int] = None, committed_only: bool = False) -> int:
    """`dflash train`; a disk that fills (a checkpoint, the logs, the export) ends it with one line naming the
    disk and the resume command (pipeline.preflight.DiskFull, exit 2), not Lightning's traceback."""
    from pipeline.preflight import DiskFull, disk_full_error, disk_full_message

    try:
        return _train(cfg, store, gpus, devices, resume, command, export, rebuild_compile_cache, follow, init_from,
                      num_nodes, committed_only)
    except BaseException as e:
        full = disk_full_error(e)
        if full is None:
            raise
        raise DiskFull(disk_full_message(full, cfg.train.run_dir, resume_command(command))) from None


def _train(cfg: Config, store: Optional[str], gpus: Optional[list[int]], devices: Optional[int], resume: bool,
           command: str, export: bool, rebuild_compile_cache: bool, follow: bool, init_from: Optional[str],
           num_nodes: Optional[int], committed_only: bool = False) -> int:
    from stages.train_startup import StartupPhases

    phases = StartupPhases()  # each start-up phase's seconds, one line at the first batch (issue 31 item 1)
    phases.mark("launch and imports")  # the interpreter, the CLI's imports (torch), the config
    store_path = store or cfg.store.path
    follow = follow or os.environ.get("DFLASH_TRAIN_FOLLOW") == "1"  # set for its ranks by a following launcher
    run_dir = Path(cfg.train.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    last = ckpt_dir / "last.ckpt"
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
        if not os.environ.get("OMP_NUM_THREADS"):
            from pipeline.preflight import usable_cores

            spare = usable_cores() // per_node - (1 if cfg.train.num_workers > 0 else 0)
            torch.set_num_threads(max(1, spare))
    from stages.train_nodes import Topology

    if num_nodes is not None:
        cfg.train.num_nodes = num_nodes  # recorded in RUN/config.yaml
    top = Topology.detect(cfg.train.num_nodes, per_node)  # which rank this is, from SLURM/torchrun/Lightning's variables
    world, rank = top.world, top.rank  # global: the sampler deals over nodes x ranks per node
    launcher = "LOCAL_RANK" not in os.environ  # Lightning sets it in the per-rank processes it starts
    if not launcher:
        from pipeline.lifecycle import die_with_parent

        die_with_parent()  # a rank whose launcher died must not hang on in a collective
    if use_gpu and launcher and not top.external:  # before any rank touches a GPU (srun/torchrun: the scheduler's)
        from pipeline.preflight import check_gpus_free

        check_gpus_free(list(devs), need_gib=16)
    resume_state = _checkpoint_state(last) if resume else None
    from stages.train_batch import plan_changed, realign_callback, resume_accumulate

    resume_accumulate(cfg, resume_state, world, say=rank == 0)  # the global batch kept on another world size
    try:
        attrs, reader, stream_epochs, head_check = _open_store(cfg, store_path, follow, resume_state, launcher, rank,
                                                               world, committed_only)
    except KeyboardInterrupt:  # Ctrl-C while waiting for extraction, before the first step: no "Aborted!"
        from pipeline.lifecycle import ExitCode

        done = (f"resume with: {resume_command(command)}" if resume else
                f"no step was trained, so nothing to resume; start again with: {command}")
        print(f"train: stopped while waiting for the store at {store_path} before the first step; {done}",
              file=sys.stderr, flush=True)
        return ExitCode.STOPPED
    phases.mark("store checks")
    # Lightning and the training module (~5 s of imports) load while the head's checksum runs in its thread
    import lightning as L

    from stages.best_checkpoint import BestCheckpoint
    from stages.progress import (FinalCheckpoint, ProgressLines, ValidateAtEnd, ValidateSkippedOnResume,
                                 one_step_count, resumable_csv_logger, save_final)
    from stages.train_stop import (ForceOnSecondCtrlC, SigtermLikeCtrlC, StopRequest, end_stopped_run, error_behind,
                                   stopped_by_user)
    from stages.train_ckpt_io import AsyncCheckpointIO, LinkAfterWrite, wait_for_checkpoints
    from stages.train_task import DrafterTask
    from pipeline.quiet_log import quiet_third_party

    quiet_third_party()  # each third-party line fixed or filtered, with its reason (pipeline/quiet_log.py)
    phases.mark("Lightning imports")

    strategy = ddp_strategy(cfg, use_gpu, multi_node=top.num_nodes > 1) if world > 1 else "auto"
    layer_ids, head = list(attrs["layer_ids"]), st.frozen_head_path(store_path)  # matched by _open_store
    task_cfg = cfg
    if cfg.drafter.init_from and resume:  # a resumed run's weights come from its checkpoint
        task_cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, init_from=None))
    elif cfg.drafter.init_from:  # before anything is written: a misfit export stops here
        from stages.init_from import check_init_from

        check_init_from(cfg, attrs, layer_ids, cfg.drafter.init_from)
        if launcher:
            print(f"train: starting from the weights of {cfg.drafter.init_from} (fresh optimizer and schedule)",
                  file=sys.stderr, flush=True)
    if use_gpu:
        _compile_cache(cfg, rebuild=rebuild_compile_cache and launcher, report=launcher)
    train_dl, val_dl, sampler = _dataloaders(cfg, store_path, reader, rank, world, 128 if use_gpu else 1, stream_epochs)
    if val_dl is None and launcher:
        print("train: the store has no validation split, so the run validates nothing (val tau n/a)",
              file=sys.stderr, flush=True)
    from data.sampler import remaining_steps

    # the LR schedule's length: a fresh run's plan (a following run counts the samples the store will hold);
    # a resumed run gets its schedule back from the checkpoint and adjusts it when the plan changed (train_task)
    planned = remaining_steps(sampler, cfg.train.epochs, cfg.train.accumulate_grad_batches, planned=bool(stream_epochs))
    if cfg.train.max_steps > planned and launcher and rank == 0:  # Lightning stops at whichever comes first
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
    callbacks, nodes = ([realign_callback(sampler, resume_state)] if resume_state else []), None
    if cfg.train.profile_steps is not None:  # where a step's time goes (stages/train_profile.py)
        from stages.train_profile import StepProfile

        callbacks.append(StepProfile(*cfg.train.profile_steps, run_dir / "logs", cuda=use_gpu))
    from stages.train_handover import handover_callback

    handover = handover_callback(run_dir)  # `dflash run`'s expansion: checkpoint and stop when asked
    if handover is not None:
        callbacks.append(handover)
    if top.num_nodes > 1:  # every rank's config, store, data plan and checkpoint compared once the group forms
        from stages.train_nodes import nodes_check, store_facts

        facts = {"config": dump_config(cfg), "store": store_facts(store_path, attrs, reader),
                 "plan": {"stream_epochs": sorted(stream_epochs), "batches": len(sampler), "steps": planned},
                 "resume": resume_state and {"step": resume_state["global_step"], "loader": resume_state["loader"]}}
        nodes = nodes_check(top, facts, run_dir, cfg.train.collective_timeout_s)
        callbacks.append(nodes)
    phases.mark("compile cache and loaders")
    run_dir.mkdir(parents=True, exist_ok=True)
    from pipeline.lifecycle import log_process_output

    log_process_output(run_dir, rank)
    # build and initialise the drafter on this rank's GPU (initialising ~1.7B parameters on the CPU took ~20 s);
    # seeded, so a run's initial weights follow from train.seed (DDP then broadcasts rank 0's to all ranks)
    torch.manual_seed(cfg.train.seed)
    with torch.device(f"cuda:{devs[top.local]}" if use_gpu else "cpu"):
        task = DrafterTask(task_cfg, layer_ids, attrs["target"]["vocab_size"], head, steps_per_epoch, attrs["encoding"],
                           target_meta=attrs["target"], store_path=store_path)

    phases.mark("drafter")
    task.train_sampler = sampler  # the step records consumed batches; Lightning checkpoints the loader's state
    task.planned_steps = planned
    # save_last="link": last.ckpt is a symlink to the newest step checkpoint, not a second full copy
    checkpoint = LinkAfterWrite(dirpath=ckpt_dir, every_n_train_steps=cfg.train.checkpoint_every, save_last="link",
                                 save_top_k=1, filename="step{step}", auto_insert_metric_name=False)
    checkpoint_path = ckpt_dir / "last.ckpt"
    progress = ProgressLines(run_dir, cfg.train.log_every, phases=phases)
    task.on_train_finished = final = FinalCheckpoint(checkpoint, checkpoint_path, free=use_gpu, progress=progress)
    # a resumed run keeps the CSV rows logged up to its checkpoint and drops those after it (logged again)
    loggers = [resumable_csv_logger(run_dir, resume_state["logged_through"] if resume_state else None)]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger

        import tensorboard  # noqa: F401

        loggers.append(one_step_count(TensorBoardLogger(run_dir, name="tensorboard", version="")))
    except ImportError:
        pass
    trainer = L.Trainer(
        accelerator=accel, devices=devs, strategy=strategy, precision=precision, max_epochs=cfg.train.epochs,
        max_steps=cfg.train.max_steps, gradient_clip_val=None,  # train.grad_clip: DrafterTask.configure_gradient_clipping
        accumulate_grad_batches=cfg.train.accumulate_grad_batches,
        callbacks=[*callbacks, checkpoint, progress, ForceOnSecondCtrlC(), ValidateAtEnd(), SigtermLikeCtrlC(),
                   BestCheckpoint(ckpt_dir),
                   ValidateSkippedOnResume(run_dir, resume_state["logged_through"] if resume_state else None)],
        num_nodes=top.num_nodes,
        # a resume on another number of ranks makes its first epoch another length than the next ones: only then
        # is the loader asked for its length every epoch (each ask is a collective). Validation counts batches
        # across epochs (every train.val_every batches, and after the last one: ValidateAtEnd)
        reload_dataloaders_every_n_epochs=1 if plan_changed(resume_state, world, cfg.train.accumulate_grad_batches)
        else 0, logger=loggers,
        log_every_n_steps=cfg.train.log_every,
        val_check_interval=cfg.train.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,  # one display on a terminal too: ProgressLines' step line (stages/progress.py)
        default_root_dir=run_dir, deterministic=False,
        plugins=[AsyncCheckpointIO()],  # copied to host memory, written in the background (train_ckpt_io.py)
        enable_model_summary=False,  # its table goes to stdout and warns on bf16-mixed; the line below says it
    )
    if (trainer.global_rank, trainer.world_size) != (rank, world):  # our reading of the environment is Lightning's
        raise TrainError(f"{top.where}: Lightning sees global rank {trainer.global_rank} of {trainer.world_size}, "
                         f"dflash read {rank} of {world} from the {top.env} environment; report this with the "
                         "launcher's variables (RANK, LOCAL_RANK, NODE_RANK, SLURM_*)")
    if launcher and rank == 0:
        n = sum(p.numel() for p in task.drafter.parameters())
        print(f"train: drafter {n / 1e6:.2f}M parameters ({cfg.drafter.arch}), on "
              f"{f'GPU {list(devs)}' if use_gpu else f'{devs} CPU process(es)'}, precision {precision}",
              file=sys.stderr, flush=True)
    if trainer.is_global_zero:  # with the store and run dir used, absolute: `--config RUN/config.yaml --resume` works
        (run_dir / "config.yaml").write_text(dump_config(resumable_config(cfg, store_path)))
        (run_dir / "command.txt").write_text(command + "\n")
    phases.mark("trainer")
    head_check()  # the frozen head's checksum, overlapped with the set-up above
    phases.mark("frozen-head check wait")
    StopRequest.install()
    try:
        trainer.fit(task, train_dataloaders=train_dl, val_dataloaders=val_dl, ckpt_path=str(last) if resume else None,
                    weights_only=True)
    except BaseException as e:  # Lightning turns SIGTERM and Ctrl-C into SystemExit
        if not stopped_by_user(e, trainer):
            if nodes is not None:  # across nodes: a group that never formed, or a node that went away
                from stages.train_nodes import exit_lost_peer, lost_peer, rendezvous_error

                if not nodes.passed and lost_peer(e):
                    raise rendezvous_error(top, e, cfg.train.rendezvous_timeout_s) from None
                if lost_peer(e):
                    exit_lost_peer(e, trainer, top, ckpt_dir, resume_command(command))
            behind = error_behind(e)
            if behind is not e:
                raise behind from None
            raise
        return end_stopped_run(e, trainer, launcher=launcher, ckpt_dir=ckpt_dir, hint=resume_command(command))
    if not final.saved:  # fit returned without on_train_end (nothing to train: resumed at the last step)
        wait_for_checkpoints(trainer, sync=True)
        save_final(trainer, checkpoint, checkpoint_path)
    wait_for_checkpoints(trainer)  # every write in place before the export reads one and before the exit
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
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        tau = summary['val'].get('val/tau')
        print(f"train: {trainer.global_step} steps; val tau {'n/a' if tau is None else f'{tau:.3f}'}; "
              f"checkpoint {checkpoint_path}" + (f"; export {summary.get('export')}" if export else ""), file=sys.stderr)
    return 0
