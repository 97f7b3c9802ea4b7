"""Training's reading of the store: the provenance check, opening the store (finished, followed while it is
written, or its committed samples only), the train and validation loaders, and a resume's pre-read of its
checkpoint (the data position and the last logged step).

Contract:
- `check_store_matches` refuses a store made for another target or config with one `TrainError` naming every
  difference (`store_mismatch`, train's and eval's one refusal).
- `open_store` reads nothing but the store and never writes to the run directory: a store that fails here stops
  the run before anything is written. A store still being written is followed (data/follow.py) once the
  validation split and one optimizer step's samples are committed; `--committed-only` reads what is committed.
- `dataloaders` builds the same loaders on every rank from the config alone (Lightning re-executes the command
  per rank): the sampler deals world-size-independent global batches (data/sampler.py), validation stays one
  sample per row so its metrics compare with or without packing.
- `checkpoint_state` reads the checkpoint memory-mapped with weights_only (no code from the file, no weights).
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from pipeline import store as st
from pipeline.config import Config, anchors_per_token, pack_tokens
from pipeline.errors import UserError
from pipeline.provenance import config_differences, start_frozen_head_check
from pipeline.store_reader import StoreReader


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


def dataloaders(cfg: Config, store_path: str, reader, rank: int, world: int, pad_multiple: int,
                 stream_epochs: tuple = ()):
    from data import loader_workers
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
    # never forked from this process (it runs zarr's IO thread): from the forkserver started early, or spawned
    kw = dict(num_workers=t.num_workers, collate_fn=col, worker_init_fn=worker_init,
              multiprocessing_context=loader_workers.context() if t.num_workers > 0 else None,
              pin_memory=torch.cuda.is_available(),
              persistent_workers=t.num_workers > 0, prefetch_factor=4 if t.num_workers > 0 else None)
    train_dl = ResumableLoader(train_ds, batch_sampler=sampler, **kw)
    train_dl.ahead_epochs = None if growing else t.epochs  # the next epoch read while this one ends (a finished store)
    if t.accumulate_grad_batches > 1:  # normalise the loss over each accumulation window, not per micro-batch
        from pipeline.masks import loss_weight_sum

        train_dl.accumulate = t.accumulate_grad_batches
        train_dl.batch_weight = lambda b: loss_weight_sum(b["tokens"], b["loss_mask"], b["anchors"],
                                                          cfg.drafter.block_size, t.gamma, b.get("doc_ids"))
    val_dl = None
    if val:
        val_ds = StoreDataset(store_path, [], t.num_anchors, t.seed, fixed_anchors=True, growing=partial_store)
        val_sampler = RankBatchSampler(FixedSamples(val), t.batch_size, rank, world, t.seed, shuffle=False)
        # validation stays one sample per row (the unpacked collate): val metrics comparable with or without packing.
        # Its workers persist between validations (one at most: the split is small): a spawned worker's start
        # (imports, the store opened) cost 8-9 s a validation on the 2-core machine; fit's end shuts it down
        val_kw = {**kw, "num_workers": min(t.num_workers, 1), "collate_fn": partial(collate, pad_multiple=pad_multiple,
                                                                                     num_anchors=n_anchor)}
        val_dl = torch.utils.data.DataLoader(val_ds, batch_sampler=val_sampler, **val_kw)
    return train_dl, val_dl, sampler


def checkpoint_state(path: Path) -> dict:
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


def open_store(cfg: Config, store_path: str, follow: bool, resume_state: Optional[dict], launcher: bool, rank: int,
                world: int, committed_only: bool = False, head_to: Optional[tuple] = None):
    """(root attrs, reader, stream epochs, head check): a finished store's reader, or a growing store once it is
    trainable; `head check()` waits for the frozen head's checksum (a background thread) and raises if it failed.
    `committed_only`: an unfinished store's committed samples are read as a finished store's (no following).
    `head_to=(device, dtype)`: the checked head is loaded there in the same thread (pipeline/provenance.py)."""
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
        reader = StoreReader(store_path, require_complete=False)
        if launcher:
            print(f"train: --committed-only: training on the {len(reader.samples)} samples committed to {store_path} "
                  f"(shard(s) {unfinished} not finished), as on a finished store", file=sys.stderr, flush=True)
        return attrs, reader, (), start_frozen_head_check(store_path, to=head_to)
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
        head_check = start_frozen_head_check(store_path, to=head_to)  # a changed or damaged head stops before fit
        return attrs, StoreReader(store_path), stream_epochs, head_check
    head_check = start_frozen_head_check(store_path, to=head_to)  # written (checksum first) before any shard's first batch
    head_check()  # at once: a following run may wait long for samples, and a bad head must not wait with it
    t = cfg.train
    growing = GrowingStore(store_path, report=rank == 0, timeout_s=t.follow_timeout_s)
    saved_buffer = saved.get("buffer", t.follow_buffer)  # a resumed run draws as it did
    growing.wait_until_trainable(min_start_samples(world, t.batch_size, t.accumulate_grad_batches) + saved_buffer)
    return attrs, growing, stream_epochs, head_check


def _unfinished_shards(store_path: str, attrs: dict) -> list[int]:
    return [s.index for s in st.read_all_progress(store_path) if not s.done]
