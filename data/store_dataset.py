"""Training data from the store: a map-style dataset, an epoch-aware per-rank batch sampler, and collation.

Contract:
- `StoreDataset` opens the store lazily, inside whichever process first reads (DataLoader workers open their
  own: zarr's event loop and fsspec are not fork-safe). Items are `(sample_index, epoch)` so anchors are
  drawn fresh each epoch yet reproducibly (seeded by seed, epoch and sample id).
- Features leave the loader still encoded (the encoding's parts, pipeline.encoding): decoding happens on the GPU.
- `RankBatchSampler` gives every rank the same number of batches per epoch (the last few batches of a
  shuffled epoch are dropped so the count divides the world size), groups samples of similar length to
  limit padding, and can skip the batches of an epoch that a resumed run already trained on.
- `collate` pads to a multiple of `pad_multiple` (128 on GPU, fixed shapes keep compiled graphs few).
- Under gradient accumulation `ResumableLoader` tags each batch with its window's total loss weight, so the
  loss is normalised over the optimizer step's whole batch, not per micro-batch.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import threading
import time
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from pipeline.encoding import from_storage, part_names
from pipeline.masks import sample_anchors
from pipeline.store import StoreReader


class StoreDataset(torch.utils.data.Dataset):
    def __init__(self, store_path: str, indices: list[int], num_anchors: int, seed: int,
                 lengths: Optional[list[int]] = None, fixed_anchors: bool = False):
        self.store_path, self.indices = store_path, list(indices)
        self.num_anchors, self.seed, self.fixed_anchors = num_anchors, seed, fixed_anchors
        self.lengths = lengths
        self._reader: Optional[StoreReader] = None

    @property
    def reader(self) -> StoreReader:
        if self._reader is None:
            self._reader = StoreReader(self.store_path)
        return self._reader

    def __getstate__(self):  # never pickle an open store into a worker
        state = dict(self.__dict__)
        state["_reader"] = None
        return state

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key) -> dict:
        pos, epoch = key if isinstance(key, tuple) else (key, 0)
        index = self.indices[pos]
        s = self.reader.read(index)
        sid = self.reader.samples[index].sample_id
        g = torch.Generator().manual_seed(hash((self.seed, 0 if self.fixed_anchors else epoch, sid)) & 0x7FFFFFFF)
        loss_mask = torch.from_numpy(s["loss_mask"].astype(np.bool_))
        anchors = sample_anchors(loss_mask, self.num_anchors, g)
        item = {
            "tokens": torch.from_numpy(s["tokens"].astype(np.int64)),  # [S]
            "loss_mask": loss_mask,  # [S] bool
            "anchors": anchors,  # [A] sorted
        }
        for name in part_names(self.reader.encoding):  # still encoded: features [S, L, ...], scales, outliers
            item[name] = from_storage(s[name])
        return item


class _EpochCounter:
    """Lightning calls `set_epoch` on `loader.batch_sampler.sampler`, not on the batch sampler: this is that."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class RankBatchSampler(torch.utils.data.Sampler):
    """Shuffled, length-grouped batches of (sample_position, epoch), the same count on every rank."""

    def __init__(self, lengths: list[int], batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, group_factor: int = 32):
        self.lengths, self.batch_size = list(lengths), batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.group_factor = group_factor
        self.sampler = _EpochCounter()  # Lightning sets the epoch here at the start of every epoch
        self.skip, self.skip_epoch = 0, -1
        self.consumed = 0  # batches of the current epoch the trainer has finished (set by the training step)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def resume(self, epoch: int, batches_done: int) -> None:
        """Skip the first `batches_done` batches of `epoch` (a resumed run already trained on them)."""
        self.skip_epoch, self.skip, self.consumed = epoch, batches_done, batches_done

    def _all_batches(self) -> list[list[int]]:
        n = len(self.lengths)
        order = list(range(n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        group = self.batch_size * self.group_factor
        batches = []
        for g0 in range(0, n, group):  # sort each window by length: little padding, still random overall
            window = sorted(order[g0 : g0 + group], key=lambda i: self.lengths[i])
            batches += [window[i : i + self.batch_size] for i in range(0, len(window), self.batch_size)]
        if self.shuffle:
            random.Random(self.seed * 7_919 + self.epoch).shuffle(batches)
        usable = len(batches) // self.world_size * self.world_size if len(batches) >= self.world_size else len(batches)
        return batches[:usable]

    def __len__(self) -> int:
        total = math.ceil(len(self.lengths) / self.batch_size)
        per_rank = total // self.world_size if total >= self.world_size else 1
        return max(1, per_rank)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batches = self._all_batches()
        if len(batches) < self.world_size:  # tiny data: every rank sees the same batch
            mine = batches[:1]
        else:
            mine = batches[self.rank :: self.world_size]
        skip = self.skip if self.epoch == self.skip_epoch else 0
        self.skip, self.skip_epoch = 0, -1
        for b in mine[skip:]:
            yield [(i, self.epoch) for i in b]


def worker_init(_worker_id: int) -> None:
    """DataLoader workers decode chunks; one thread each keeps them from fighting the training step for cores.
    Ctrl-C in a terminal reaches the whole process group: workers ignore it and let the training process stop
    them (a worker dying of SIGINT would turn a clean stop into a DataLoader crash). A worker exits at once
    when its training process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    import multiprocessing

    # the parent's pid as multiprocessing passed it: a worker whose parent died while it was still importing
    # would see os.getppid() == 1 here already and never notice (torch's own check has that blind spot)
    parent = multiprocessing.parent_process()
    pid = parent.pid if parent is not None and parent.pid else os.getppid()
    threading.Thread(target=_exit_with_parent, args=(pid,), name="dflash-parent-watch", daemon=True).start()
    try:
        from numcodecs import blosc

        blosc.set_nthreads(1)
    except ImportError:  # pragma: no cover
        pass


def _exit_with_parent(parent: int) -> None:
    """A worker whose training process died (SIGKILL, the OOM killer) must not run on. torch's own check
    compares with getppid() at start-up (1 already for a worker that was still importing: such orphans were
    seen) and runs only between batches. Loader workers only read the store, so a hard exit loses nothing."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader Lightning can checkpoint: its state is (epoch, batches the trainer consumed), not what the
    workers prefetched, so a resumed run continues with exactly the next unseen batch.

    With `accumulate` > 1 and a `batch_weight` function, every batch also carries `window_weight`: the loss
    weight of its whole gradient-accumulation window (see `accumulation_windows`)."""

    accumulate: int = 1
    batch_weight: Optional[Callable[[dict], float]] = None

    def __iter__(self):
        it = super().__iter__()
        if self.accumulate <= 1 or self.batch_weight is None:
            return it
        bs = self.batch_sampler
        offset = bs.skip if bs.epoch == bs.skip_epoch else 0  # a resumed epoch starts after its done batches
        return accumulation_windows(it, self.accumulate, offset, self.batch_weight)

    def state_dict(self) -> dict:
        bs = self.batch_sampler
        return {"epoch": bs.epoch, "batches_done": bs.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.resume(int(state["epoch"]), int(state["batches_done"]))


def accumulation_windows(batches: Iterator[dict], accumulate: int, offset: int,
                         batch_weight: Callable[[dict], float]) -> Iterator[dict]:
    """Yield `batches` unchanged but for batch["window_weight"] (float64 [] tensor): the summed loss weight of
    the accumulation window the batch is in. Windows are the epoch's batch indices [kA, (k+1)A), as Lightning
    steps the optimizer; an epoch resumed at `offset` starts inside one, and the epoch's last may be short.
    Reads up to A - 1 batches ahead."""
    pos = offset
    while True:
        group = list(itertools.islice(batches, accumulate - pos % accumulate))
        if not group:
            return
        w = torch.tensor(sum(batch_weight(b) for b in group), dtype=torch.float64)
        for b in group:
            b["window_weight"] = w
            yield b
        pos += len(group)


def collate(items: list[dict], pad_multiple: int = 1, num_anchors: Optional[int] = None) -> dict:
    """Pad a list of samples into a batch; anchors padded with -1."""
    B = len(items)
    S = max(len(it["tokens"]) for it in items)
    S = int(math.ceil(S / pad_multiple) * pad_multiple)
    A = num_anchors or max(1, max(len(it["anchors"]) for it in items))
    out = {
        "tokens": torch.zeros(B, S, dtype=torch.long),
        "loss_mask": torch.zeros(B, S, dtype=torch.bool),
        "anchors": torch.full((B, A), -1, dtype=torch.long),
        "seq_lens": torch.tensor([len(it["tokens"]) for it in items], dtype=torch.long),
    }
    parts = [k for k in items[0] if k not in ("tokens", "loss_mask", "anchors")]  # the encoding's parts
    for k in parts:  # padding tokens decode to finite values (scales 1, codes 0) and are masked out
        t = items[0][k]
        out[k] = (torch.ones if k == "scales" else torch.zeros)(B, S, *t.shape[1:], dtype=t.dtype)
    for b, it in enumerate(items):
        n = len(it["tokens"])
        out["tokens"][b, :n] = it["tokens"]
        out["loss_mask"][b, :n] = it["loss_mask"]
        a = it["anchors"][:A]
        out["anchors"][b, : len(a)] = a
        for k in parts:
            out[k][b, :n] = it[k]
    return out
