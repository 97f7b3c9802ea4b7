"""Training from a store that extraction is still writing (`dflash train --follow`).

Contract:
- Only committed samples are read: a shard's `progress` attribute is its commit record, and rows past it are
  ignored (pipeline/store.py's commit protocol). Commits only grow, so what was readable stays readable.
- The *stream*: the training samples of all shards merged in one fixed order, row k of shard i (of P_i
  planned rows) at key ((k + 0.5) / P_i, i). The order depends only on what the store will finally hold,
  never on timing, so every rank derives the same stream on its own, and a resumed run replays it: a
  following run's first epoch takes its global batches from it (data/sampler.py, a "stream" epoch).
  A sample can join the stream once every shard that could still put an earlier one there has committed
  past it; a shard that has not started, or stopped, holds the stream up.
- Waiting: when the stream runs short, `stream_batch` polls the store (0.2 s rising to 2 s), and rank 0
  prints what it waits for after 5 s and then every 30 s: samples needed and usable, the shard holding the
  stream up, and the extraction's last status. By default it never gives up: training waits while extraction is
  stopped and goes on when extraction is resumed (Ctrl-C stops the training as usual). With `timeout_s`
  (train.follow_timeout_s) a wait that sees no new commit for that long raises `FollowTimeout`: one line naming
  the committed sample count and the two ways forward (resume the extraction, or `dflash train --committed-only`,
  which trains on the committed samples as on a finished store).
- Validation: extraction writes each shard's validation samples first (stages/extract_worker.py records how
  many batches they fill), so the whole validation split is readable after the shards' first batches.
"""

from __future__ import annotations

import heapq
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from pipeline import store as st
from pipeline.store_reader import SampleRef, committed_refs

WAIT_FIRST_REPORT_S, WAIT_REPORT_S = 5.0, 30.0  # short waits at the frontier stay quiet


class FollowTimeout(st.StoreDataError):
    """A following run saw no new commit for train.follow_timeout_s seconds. A StoreDataError for its message
    handling only: raised in a loader worker, it reaches the training process as the same one line."""


class StreamSlot(NamedTuple):
    """Slot j of global batch g of a stream epoch (batches of `size`, drawn with a shuffle buffer of `buffer`
    samples), whose round ends at global batch `round_end`. The sampler deals slots without waiting; a loader
    worker resolves them (`GrowingStore.resolve`), so the DataLoader's prefetching never holds back a batch
    that is already readable."""

    g: int
    j: int
    size: int
    round_end: int
    buffer: int = 0


class GrowingStore:
    """What a training run may read of a store still being written; also the sampler's sample source."""

    def __init__(self, path: str, report: bool = True, say: Callable[[str], None] = None,
                 timeout_s: Optional[float] = None):
        self.path, self.report, self.timeout_s = path, report, timeout_s
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.attrs = st.read_root_attrs(path)
        if self.attrs is None:
            raise st.StoreError(f"no store at {path}")
        ds = self.attrs.get("dataset", {})
        if "samples" not in ds:
            raise st.StoreError(f"{path} does not record its planned sample count (dataset.samples); a store "
                                "written by an older dflash can be trained on only after extraction finished")
        S, N = int(self.attrs["num_shards"]), int(ds["samples"])
        self.planned = N - int(ds.get("validation_samples", 0))  # training samples the store will hold
        self.planned_rows = [len(st.shard_rows(range(N), i, S)) for i in range(S)]  # shard i's samples
        self.rows: list[list[SampleRef]] = [[] for _ in range(S)]
        self.progress: list[Optional[st.Progress]] = [None] * S
        self.stream: list[SampleRef] = []  # training samples in stream order
        self._next = [0] * S  # per shard: the next row to merge into the stream
        self._heap = [(self._key(i, 0), i) for i in range(S) if self.planned_rows[i]]
        self.blocked: Optional[int] = None  # the shard holding the stream up
        self._final: Optional[tuple[list, list[int]]] = None
        self._mix: Optional[list] = None  # the shuffle buffer's state (mixed_batch)
        self.refresh()

    def _key(self, shard: int, row: int) -> tuple[float, int]:
        return (row + 0.5) / self.planned_rows[shard], shard

    # -- reading the commits -------------------------------------------------------------------------------
    @property
    def final(self) -> bool:
        return all(p is not None and p.done for p in self.progress)

    def refresh(self) -> bool:
        """Read every unfinished shard's new commits and extend the stream; True if anything was new."""
        grew = False
        for i, p in enumerate(self.progress):
            if p is not None and p.done:
                continue
            prog, refs = committed_refs(self.path, i, len(self.rows[i]))
            grew |= bool(refs) or (prog is not None and (p is None or prog.done != p.done))
            self.progress[i] = prog
            self.rows[i] += refs
        self._merge()
        return grew

    def _merge(self) -> None:
        train = st.SPLITS["train"]
        self.blocked = None
        while self._heap:
            _, i = self._heap[0]
            k = self._next[i]
            if k >= len(self.rows[i]):
                p = self.progress[i]
                if p is not None and p.done:  # this shard has nothing more
                    heapq.heappop(self._heap)
                    continue
                self.blocked = i  # its next row may still come before every other candidate
                return
            heapq.heappop(self._heap)
            if self.rows[i][k].split == train:
                self.stream.append(self.rows[i][k])
            self._next[i] = k + 1
            heapq.heappush(self._heap, (self._key(i, k + 1), i))

    # -- what the sampler asks -----------------------------------------------------------------------------
    def stream_batch(self, g: int, batch_size: int, round_end: int) -> list[SampleRef]:
        """Global batch g of the stream (samples [g B, (g + 1) B)), once the stream holds the whole round up to
        global batch `round_end` or is complete; [] past the stream's end."""
        self.wait_for(min(round_end * batch_size, self.planned))
        return self.stream[g * batch_size : (g + 1) * batch_size]

    def mixed_batch(self, g: int, size: int, round_end: int, buffer: int, seed: int, epoch: int) -> list[SampleRef]:
        """Global batch g of a stream epoch with a shuffle buffer: batch k draws `size` samples at random from the
        stream's first (k + 1) size + buffer samples not drawn before (all of them once the stream is complete).
        Every sample once; what a batch holds depends only on the stream and (seed, epoch, k), not on timing.
        Waits until the stream holds the whole round's window. buffer 0: the stream's own order."""
        key = (size, buffer, seed, epoch)
        if self._mix is None or self._mix[0] != key or self._mix[1] > g:
            self._mix = [key, 0, 0, []]  # (what it is for, next batch, stream samples added, pool of positions)
        self.wait_for(min(round_end * size + buffer, self.planned))
        _, k, added, pool = self._mix
        out: list[int] = []
        while k <= g:  # replay the batches before g (a resumed run, another rank's batches) then draw g
            target = min((k + 1) * size + buffer, len(self.stream))
            pool.extend(range(added, target))
            added = max(added, target)
            rng = random.Random((seed * 1_000_003 + epoch) * 1_000_033 + k)
            out = []
            for _ in range(min(size, len(pool))):
                i = rng.randrange(len(pool))
                pool[i], pool[-1] = pool[-1], pool[i]
                out.append(pool.pop())
            k += 1
        self._mix[1:3] = [k, added]
        return [self.stream[p] for p in sorted(out)]  # in stream order within the batch

    def resolve(self, slot: StreamSlot, seed: int = 0, epoch: int = 0) -> tuple[Optional[SampleRef], bool]:
        """(sample, filler) at a stream slot, once its round is readable: (None, False) past a short last batch;
        the shortest sample as a filler for the first slot of a batch past the stream's end."""
        batch = self.mixed_batch(slot.g, slot.size, slot.round_end, slot.buffer, seed, epoch)
        if slot.j < len(batch):
            return batch[slot.j], False
        return (self.filler(), True) if not batch and slot.j == 0 else (None, False)

    def all(self) -> tuple[list[SampleRef], list[int]]:
        """The finished store's training samples, ordered by sample id (as a run on a finished store has them);
        waits for the last shards to mark themselves done (an epoch after the stream's)."""
        if self._final is None:
            self.wait_for(None)
            refs = sorted(self.stream, key=lambda r: r.sample_id)
            self._final = (refs, [r.length for r in refs])
        return self._final

    def filler(self) -> SampleRef:
        refs, lengths = self.all()  # fillers only come after the stream's end: the store is finished then
        return refs[min(range(len(refs)), key=lambda i: lengths[i])]

    # -- validation and the start --------------------------------------------------------------------------
    def validation_ready(self) -> bool:
        """Every shard's validation samples are committed (they come first in every shard's plan)."""
        for i, p in enumerate(self.progress):
            if p is not None and p.done:
                continue
            if p is not None and p.validation_batches < 0:
                raise st.StoreError(
                    f"shard {i} of {self.path} was started by a dflash that did not extract validation samples "
                    "first; train on this store after its extraction has finished")
            if p is None or p.committed_batches < p.validation_batches:
                return False
        return True

    def validation(self) -> list[SampleRef]:
        code = st.SPLITS["validation"]
        return sorted((r for rows in self.rows for r in rows if r.split == code), key=lambda r: r.sample_id)

    def wait_until_trainable(self, samples: int) -> None:
        """Block until the validation split and the first `samples` training samples are readable."""
        self.wait_for(min(samples, self.planned), validation=True)

    def wait_for(self, samples: Optional[int], validation: bool = False) -> None:
        """Block until the stream holds `samples` (None: until the store is finished) or the store is finished,
        and, with `validation`, the validation split is committed."""
        def ready() -> bool:
            enough = self.final or (samples is not None and len(self.stream) >= samples)
            return enough and (not validation or self.validation_ready())

        if ready() or (self.refresh() and ready()):
            return
        delay, started = 0.2, time.time()
        last, new = started - WAIT_REPORT_S + WAIT_FIRST_REPORT_S, started
        while not ready():
            if time.time() - last >= WAIT_REPORT_S:
                last = time.time()
                if self.report:
                    self.say(self.waiting_line(samples, time.time() - started))
            if self.timeout_s is not None and time.time() - new >= self.timeout_s:
                raise FollowTimeout(self.timeout_line(samples))
            time.sleep(delay)
            grew = self.refresh()
            delay, new = (0.2, time.time()) if grew else (min(2.0, delay * 1.5), new)

    def committed(self) -> int:
        """Samples committed in all (training and validation), as the shards' commit records say."""
        return sum(p.committed_samples for p in self.progress if p is not None)

    def timeout_line(self, samples: Optional[int]) -> str:
        need = "the finished store" if samples is None else f"{samples} training samples in commit order"
        return (f"no new sample was committed to {self.path} for {self.timeout_s:g} s (train.follow_timeout_s) while "
                f"training waited for {need}: {self.committed()} samples are committed; resume the extraction "
                "(rerun the same `dflash extract`) and rerun this training (with --resume once it has a checkpoint), "
                "or train on the committed samples alone: the same `dflash train` with --committed-only")

    def waiting_line(self, samples: Optional[int], waited: float) -> str:
        have = len(self.stream)
        committed = self.committed()
        why = ""
        if self.blocked is not None:
            i, p = self.blocked, self.progress[self.blocked]
            done = 0 if p is None else p.committed_samples
            why = (f"; shard {i} holds it up ({'not started' if p is None else f'{done}/{self.planned_rows[i]} samples'})")
        need = ("the next epoch needs the finished store" if samples is None else
                f"the next batches need {samples} training samples in commit order")
        return (f"train: waiting for extraction ({waited:.0f} s so far): {need}, {have} are readable "
                f"({committed} samples committed in all){why}; {extraction_state(self.path)}")


def extraction_state(store: str) -> str:
    """What STORE/logs/extract-status.json says about the extraction, in a few words (local stores)."""
    f = Path(store) / "logs" / "extract-status.json"
    try:
        rec = json.loads(f.read_text())
    except (OSError, ValueError):
        return "no extraction status found: is `dflash extract` running?"
    state, age = rec.get("state", "unknown"), time.time() - float(rec.get("time", 0))
    if state == "running" and age > 120:
        state = "silent"
    hint = "" if state == "running" else "; training goes on when it is resumed (rerun the same `dflash extract`)"
    return f"extraction {state} (last status {age:.0f} s ago){hint}"


def wait_for_store(path: str, say: Callable[[str], None] = None) -> dict:
    """Root attributes of a store that `dflash extract` may not have created yet (a following run started
    alongside it): wait for them and for the frozen head, which the first worker writes before its first batch."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    started, last, attrs = time.time(), 0.0, None
    while True:
        try:
            attrs, problem = st.read_root_attrs(path), ""
        except st.StoreError as e:  # being created: a directory, then the group, then its attributes
            attrs, problem = None, f" ({e})"
        if attrs is not None and st.exists(st.frozen_head_path(path)):
            return attrs
        if time.time() - last >= WAIT_REPORT_S:
            last = time.time()
            what = "the store" if attrs is None else "its frozen head (written by the first extraction worker)"
            say(f"train: waiting for {what} at {path}{problem} ({time.time() - started:.0f} s so far); "
                f"{extraction_state(path)}")
        time.sleep(1.0)


def min_start_samples(world: int, batch_size: int, accumulate: int) -> int:
    """Samples needed before the first optimizer step: one accumulation window on every rank."""
    return max(1, world * batch_size * accumulate)

