"""Training data from the store: a map-style dataset, the resumable loader, and collation.

Contract:
- `StoreDataset` opens the store lazily, inside whichever process first reads (DataLoader workers open their
  own: zarr's event loop and fsspec are not fork-safe). Items are `(key, epoch, filler)` from the sampler
  (data/sampler.py): key is a `SampleRef` (a sample of a finished store or of one still being written) or a
  position in `indices`. Anchors are drawn fresh each epoch yet reproducibly (seeded by seed, epoch and sample
  id); train.anchor_rule picks how many (pipeline/masks.py sample_anchors); with packing the sampler adds the
  item's row, and data/packing.py `collate_packed` builds the rows. A filler item keeps its tokens
  but has its loss mask zeroed: no anchors, no loss, no gradient.
- Features leave the loader still encoded (the encoding's parts, pipeline.encoding): decoding happens on the GPU.
- `collate` pads to a multiple of `pad_multiple` (128 on GPU, fixed shapes keep compiled graphs few) and keeps
  the sample ids (-1 for fillers).
- `ResumableLoader` checkpoints the sampler's position (what the trainer consumed, not what workers prefetched)
  and starts its iterator only when the first batch is asked for (Lightning creates one it then discards).
  Under gradient accumulation it tags each batch with its window's total loss weight, so the loss is
  normalised over the optimizer step's whole batch, not per micro-batch.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import sys
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from data.follow import GrowingStore, StreamSlot
from data.sampler import FixedSamples, RankBatchSampler  # noqa: F401 - re-exported: the loader's sampler
from pipeline.encoding import from_storage, part_names
from pipeline.lifecycle import watch_parent
from pipeline.masks import sample_anchors
from pipeline.store_reader import SampleRef, StoreReader


class StoreDataset(torch.utils.data.Dataset):
    def __init__(self, store_path: str, indices: list[int], num_anchors: int, seed: int,
                 fixed_anchors: bool = False, growing: bool = False,
                 wait_log: Optional[str] = None, anchors_per_token: Optional[float] = None,
                 follow_timeout_s: Optional[float] = None):
        self.store_path, self.indices = store_path, list(indices)
        self.num_anchors, self.seed, self.fixed_anchors = num_anchors, seed, fixed_anchors
        self.growing = growing  # growing: the store may still be written (--follow)
        self.anchors_per_token = anchors_per_token  # None: num_anchors each; r: ~r per labelled token (masks.py)
        self.wait_log = wait_log  # where a worker waiting for extraction says so (rank 0's log), besides stderr
        self.follow_timeout_s = follow_timeout_s  # a wait without a new commit this long fails (data/follow.py)
        self._reader: Optional[StoreReader] = None
        self._stream: Optional[GrowingStore] = None

    def _say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        with open(self.wait_log, "a") as f:
            f.write(line + "\n")

    @property
    def stream(self) -> GrowingStore:
        if self._stream is None:
            self._stream = GrowingStore(self.store_path, report=self.wait_log is not None, say=self._say,
                                        timeout_s=self.follow_timeout_s)
        return self._stream

    @property
    def reader(self) -> StoreReader:
        if self._reader is None:
            self._reader = StoreReader(self.store_path, require_complete=not self.growing)
        return self._reader

    def __getstate__(self):  # never pickle an open store into a worker
        state = dict(self.__dict__)
        state["_reader"] = state["_stream"] = None
        return state

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item) -> Optional[dict]:
        if not isinstance(item, tuple):  # a bare position (benchmarks, tests)
            item = (item, 0)
        row = item[3] if len(item) == 4 else None  # packing: the row of the sampler's plan (data/packing.py)
        key, epoch, filler = item[:3] if len(item) >= 3 else (*item, False)
        if isinstance(key, StreamSlot):  # a following run's first epoch: waits until the slot's round is committed
            key, filler = self.stream.resolve(key, self.seed, epoch)
            if key is None:
                return None  # past the stream's short last batch
        ref = key if isinstance(key, SampleRef) else self.reader.samples[self.indices[key]]
        s = self.reader.read_sample(ref.shard, ref.start, ref.length)
        g = torch.Generator().manual_seed(hash((self.seed, 0 if self.fixed_anchors else epoch, ref.sample_id)) & 0x7FFFFFFF)
        loss_mask = torch.from_numpy(s["loss_mask"].astype(np.bool_))
        if filler:
            loss_mask.zero_()
        anchors = sample_anchors(loss_mask, self.num_anchors, g, self.anchors_per_token)
        item = {
            "tokens": torch.from_numpy(s["tokens"].astype(np.int64)),  # [S]
            "loss_mask": loss_mask,  # [S] bool
            "anchors": anchors,  # [A] sorted
            "sample_id": -1 if filler else ref.sample_id,
        }
        if row is not None:
            item["row"] = row
        for name in part_names(self.reader.encoding):  # still encoded: features [S, L, ...], scales, outliers
            item[name] = from_storage(s[name])
        return item


def worker_init(_worker_id: int) -> None:
    """DataLoader workers decode chunks; one thread each keeps them from fighting the training step for cores.
    Ctrl-C in a terminal reaches the whole process group: workers ignore it and let the training process stop
    them (a worker dying of SIGINT would turn a clean stop into a DataLoader crash). A worker exits at once
    when its training process is gone (spawned by it, or forked by data/loader_workers.py's forkserver)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    import multiprocessing

    # the training process's pid as multiprocessing passed it: a worker whose parent died while it was still
    # importing would see os.getppid() == 1 here already and never notice (torch's own check has that blind
    # spot), and a forkserver's worker has the server for its parent
    parent = multiprocessing.parent_process()
    watch_parent(parent.pid if parent is not None and parent.pid else os.getppid())
    try:
        from numcodecs import blosc

        blosc.set_nthreads(1)
    except ImportError:  # pragma: no cover
        pass


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader Lightning can checkpoint: its state is the sampler's (epoch, batches the trainer consumed,
    global position), not what the workers prefetched, so a resumed run continues with exactly the next unseen
    batch. Its iterator starts at the first `next`: Lightning creates an iterator in `setup_data` that the
    epoch loop may replace at once, and a started one would prefetch (and wait for) batches for nothing.

    With `accumulate` > 1 and a `batch_weight` function, every batch also carries `window_weight`: the loss
    weight of its whole gradient-accumulation window (see `accumulation_windows`).

    With `ahead_epochs` = E (worker processes, a finished store: `RankBatchSampler.can_read_ahead`) the epochs up
    to E are one stream of batches (`RankBatchSampler.iter_ahead`) through one set of workers, and each epoch's
    iterator takes its own batches from it: the workers fetch the next epoch's first batches while this epoch's
    last ones train, instead of starting from empty at every epoch (issue 46 item 4). The batches are the same,
    in the same order. An epoch that starts anywhere but where the stream is (the first, a resume, an epoch left
    early, `set_epoch` to another epoch) starts a new stream."""

    accumulate: int = 1
    batch_weight: Optional[Callable[[dict], float]] = None
    ahead_epochs: Optional[int] = None
    _stream: Optional["_EpochStream"] = None

    def __iter__(self):
        return _Deferred(self._start)

    def _start(self):
        epoch, offset = self.batch_sampler.upcoming()  # a resumed epoch starts after its done batches
        if self.ahead_epochs and epoch < self.ahead_epochs and self.num_workers > 0 and \
                self.batch_sampler.can_read_ahead():
            it = self._epoch_from_stream(epoch, offset)
        else:
            it = super().__iter__()
        if self.accumulate <= 1 or self.batch_weight is None:
            return it
        return accumulation_windows(it, self.accumulate, offset, self.batch_weight)

    def _epoch_from_stream(self, epoch: int, offset: int) -> Iterator:
        s = self.batch_sampler
        n = s.epoch_length(epoch) - offset
        if self._stream is None or self._stream.next_at != (epoch, offset):
            self.close_stream()
            inner = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=_Once(s.iter_ahead(self.ahead_epochs)), num_workers=self.num_workers,
                collate_fn=self.collate_fn, worker_init_fn=self.worker_init_fn, pin_memory=self.pin_memory,
                multiprocessing_context=self.multiprocessing_context, prefetch_factor=self.prefetch_factor,
                timeout=self.timeout)
            self._stream = _EpochStream(iter(inner), (epoch, offset))
        return self._stream.take(epoch, n)

    def close_stream(self) -> None:
        """End the read-ahead stream's workers (a new stream, or the end of training)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)


class _Once:
    """A batch sampler that is one iterator (the read-ahead stream's batches: a DataLoader iterates it once)."""

    def __init__(self, batches: Iterator):
        self._batches = batches

    def __iter__(self):
        return self._batches


class _EpochStream:
    """One DataLoader iterator over several epochs' batches; `take(epoch, n)` yields the next n of them as that
    epoch's, and `next_at` says where the stream stands: (the next epoch, 0) once an epoch was taken whole, None
    when one was left early (the next epoch then needs a new stream)."""

    def __init__(self, it: Iterator, at: tuple[int, int]):
        self.it, self.next_at = it, at

    def take(self, epoch: int, n: int) -> Iterator:
        self.next_at = None if n else (epoch + 1, 0)  # until this epoch's last batch is handed out
        for i in range(n):  # never one more: the next batch is the next epoch's
            batch = next(self.it)
            if i == n - 1:  # set before the last yield: Lightning, knowing the length, asks no further
                self.next_at = (epoch + 1, 0)
            yield batch

    def close(self) -> None:
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class _Deferred:
    """An iterator made by `start()` at the first `next`."""

    def __init__(self, start: Callable[[], Iterator]):
        self._start, self._it = start, None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self._start())
        return next(self._it)


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


def collate(items: list[Optional[dict]], pad_multiple: int = 1, num_anchors: Optional[int] = None) -> dict:
    """Pad a list of samples into a batch; anchors padded with -1; None items (empty stream slots) left out."""
    items = [it for it in items if it is not None]
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
    out["sample_ids"] = [int(it.get("sample_id", -1)) for it in items]  # -1: a filler (or unknown)
    parts = [k for k in items[0] if k not in ("tokens", "loss_mask", "anchors", "sample_id")]  # the encoding's parts
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
