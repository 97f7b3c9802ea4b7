"""Which samples each rank trains on, epoch by epoch, so that a run can stop anywhere and resume exactly.

Contract:
- An epoch is a list of *global* batches that does not depend on the number of ranks: a shuffled,
  length-grouped pass over a finished store's split (a "window" epoch), or, for the first epoch of a run that
  follows a store still being written, the samples in the order they were committed (a "stream" epoch,
  data/follow.py). Either way an epoch of N samples has K = ceil(N / batch_size) global batches.
- Ranks take the global batches in rounds: from the epoch's position p, rank r trains p + r, p + r + W, ...
  The last round is completed with filler batches (one sample with its loss mask zeroed: no loss, no
  gradient), so every sample is trained exactly once per epoch on exactly one rank, and every rank has the
  same number of batches.
- The state is (epoch, batches this rank finished, global batches finished). The global list is the same for
  any world size, so a run resumed on W' ranks deals the rest of the epoch over W' ranks: nothing is trained
  twice or skipped, whatever W' is.
- Lightning asks for the length and the iterator of the next epoch before it calls `set_epoch`; the sampler
  knows the next epoch itself (an epoch whose batches were all consumed is followed by the next one), so the
  order of those calls does not matter. `consumed` is set by the training step (batches finished this epoch).
- Packing (`pack_tokens`, train.packing): a finished store's epoch is a list of global batches of `batch_size`
  rows, each row several samples (data/packing.py `packed_plan`: seeded, world-size independent); K is that
  plan's length, and every item names its row. A stream epoch stays batches of `batch_size` samples, packed
  by the collate. The state records pack_tokens: a resume must pack the same way (stages/train.py checks).
- The state also records the plan's shape (micro-batch `batch_size`, `accumulate`, world size) and the samples of
  the finished global batches (`samples_done`). A resume whose accumulation differs (stages/train_batch.py keeps
  the global batch when the world size changes) counts the epoch's done batches in its own steps: k0 becomes
  (optimizer steps done) x the new accumulate, so Lightning's windows stay aligned; the data position, the
  global batches done, is unchanged and exact in samples.
"""

from __future__ import annotations

import math
import random
from typing import Any, Iterator, Optional, Sequence

import torch

from data.follow import StreamSlot
from data.packing import packed_plan


def window_plan(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, shuffle: bool = True,
                group_factor: int = 32) -> list[list[int]]:
    """An epoch's global batches (positions into `lengths`): shuffled, then sorted by length inside windows of
    batch_size * group_factor samples (little padding, still random overall), batches shuffled. group_factor 0:
    the shuffled order cut into batches (no grouping by length)."""
    n = len(lengths)
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    if group_factor == 0:
        return [order[i : i + batch_size] for i in range(0, n, batch_size)]
    group = batch_size * group_factor
    batches = []
    for g0 in range(0, n, group):
        window = sorted(order[g0 : g0 + group], key=lambda i: lengths[i])
        batches += [window[i : i + batch_size] for i in range(0, len(window), batch_size)]
    if shuffle:
        random.Random(seed * 7_919 + epoch).shuffle(batches)
    return batches


class FixedSamples:
    """A fixed list of samples (a finished store's split): `keys` as the dataset reads them, and their lengths."""

    final = True

    def __init__(self, keys: Sequence[Any], lengths: Optional[Sequence[int]] = None):
        self.keys = list(keys)
        self.lengths = list(lengths) if lengths is not None else [k.length for k in self.keys]

    @property
    def planned(self) -> int:
        return len(self.keys)

    def all(self) -> tuple[list, list[int]]:
        return self.keys, self.lengths

    def filler(self) -> Any:
        return self.keys[min(range(len(self.keys)), key=lambda i: self.lengths[i])]


class _EpochCounter:
    """Lightning calls `set_epoch` on `loader.batch_sampler.sampler`, not on the batch sampler: this forwards it."""

    def __init__(self, owner: "RankBatchSampler"):
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


class RankBatchSampler(torch.utils.data.Sampler):
    """Batches of items (key, epoch, filler) for one rank; see the module docstring.

    `samples`: a list of lengths (keys are positions), `FixedSamples`, or a growing store (data/follow.py).
    `stream_epochs`: epochs taken as a stream of commits (a following run's first epoch)."""

    def __init__(self, samples, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, group_factor: int = 32, stream_epochs: Sequence[int] = (), buffer: int = 0,
                 pack_tokens: Optional[int] = None, accumulate: int = 1):
        self.source = samples if hasattr(samples, "all") else FixedSamples(range(len(samples)), samples)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle, self.group_factor = seed, shuffle, group_factor
        self.stream_epochs, self.buffer = set(stream_epochs), buffer  # buffer: a stream epoch's shuffle buffer
        self.sampler = _EpochCounter(self)  # Lightning sets the epoch here at the start of every epoch
        self.epoch = 0
        self.k0 = self.p0 = 0  # this rank's and the global batches done in `epoch` when this process took it up
        self.consumed = 0  # batches of `epoch` this rank has finished (set by the training step)
        self.pack_tokens = pack_tokens  # None: one sample per row; N: packed rows of <= N tokens
        self.accumulate = accumulate  # micro-batches per optimizer step (the step's windows in this epoch)
        self._plans: dict[int, list[list[int]]] = {}  # epoch -> its plan: the epoch under way and the next
        self._packed_counts: dict[int, int] = {}  # epoch -> global batches of its packed plan

    # -- sizes ----------------------------------------------------------------------------------------------
    def global_batches(self, epoch: int, planned: bool = False) -> int:
        """K: global batches of `epoch`. Stream epochs (and `planned`) count the store's planned samples; an
        epoch that ends short of them (samples dropped for NaN features) is completed with fillers; so are the
        other epochs of a run that streamed one. A run on a finished store counts its samples."""
        # a following run deals every epoch to the planned count (fillers make up for dropped samples): one
        # length for all epochs, an exact LR schedule, and nothing decided on how far a rank has seen the store
        if self.pack_tokens and epoch not in self.stream_epochs and not planned and (
                epoch == self.epoch or self.source.final):  # a packed epoch: its plan's batches of rows
            if epoch not in self._packed_counts:
                self._packed_counts[epoch] = len(self._window(epoch)) if epoch == self.epoch else len(
                    packed_plan(self.source.all()[1], self.batch_size, self.seed, epoch, self.pack_tokens, self.shuffle))
            return max(1, self._packed_counts[epoch])
        # (a following run's packed epochs before the store is final: the unpacked count, an upper bound that
        # the LR schedule replaces by the plan's once the epoch starts, stages/train_task.py _plan_lr)
        n = self.source.planned if planned or self.stream_epochs else len(self.source.all()[0])
        return max(1, math.ceil(n / self.batch_size))

    def epoch_length(self, epoch: int, planned: bool = False) -> int:
        """This rank's batches in `epoch`; for the epoch under way, counted from its start (what Lightning counts)."""
        K = self.global_batches(epoch, planned)
        if epoch == self.epoch:
            return self.k0 + math.ceil(max(0, K - self.p0) / self.world_size)
        return math.ceil(K / self.world_size)

    def global_done(self) -> int:
        return min(self.global_batches(self.epoch), self.p0 + (self.consumed - self.k0) * self.world_size)

    def _roll(self) -> None:
        """An epoch whose batches were all consumed is followed by the next one, from its start."""
        if self.consumed and self.consumed >= self.epoch_length(self.epoch):
            self.epoch, self.k0, self.p0, self.consumed = self.epoch + 1, 0, 0, 0

    def upcoming(self) -> tuple[int, int]:
        """(epoch, batches of it already done) of the epoch the next iteration serves."""
        self._roll()
        return self.epoch, self.k0

    def set_epoch(self, epoch: int) -> None:
        self._roll()
        if epoch != self.epoch:  # Lightning knows better (e.g. a checkpoint without loader state): start it afresh
            self.epoch, self.k0, self.p0, self.consumed = epoch, 0, 0, 0

    def __len__(self) -> int:
        self._roll()
        return self.epoch_length(self.epoch)

    # -- iteration -----------------------------------------------------------------------------------------
    def _window(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            _, lengths = self.source.all()
            if self.pack_tokens:
                plan = packed_plan(lengths, self.batch_size, self.seed, epoch, self.pack_tokens, self.shuffle)
            else:
                plan = window_plan(lengths, self.batch_size, self.seed, epoch, self.shuffle, self.group_factor)
            # two kept: the loader reads the next epoch's first batches while this one ends (iter_ahead)
            self._plans = {e: p for e, p in self._plans.items() if e in (epoch - 1, epoch + 1)} | {epoch: plan}
        return self._plans[epoch]

    def __iter__(self) -> Iterator[list[tuple]]:
        self._roll()
        return self.batches(self.epoch, self.p0)

    def can_read_ahead(self) -> bool:
        """Whether later epochs can be dealt before they start: a finished store and no stream epoch (a stream
        epoch's batches depend on what is committed when it is read)."""
        return not self.stream_epochs and bool(getattr(self.source, "final", False))

    def iter_ahead(self, last_epoch: int) -> Iterator[list[tuple]]:
        """The batches of the upcoming epoch from its position, then of every later epoch before `last_epoch`,
        in one stream: what `__iter__` gives epoch after epoch, without waiting for an epoch to start (the loader's
        workers fetch the next epoch's first batches while the last ones of this epoch train). Changes no
        state: `set_epoch`, `consumed` and the checkpointed position stay the training's."""
        e, k0 = self.upcoming()
        yield from self.batches(e, self.p0)
        for later in range(e + 1, last_epoch):
            yield from self.batches(later, 0)

    def batches(self, e: int, p0: int) -> Iterator[list[tuple]]:
        """This rank's batches of epoch `e` from global batch `p0`: ceil((K - p0) / W) of them (see the
        module contract); reads no position state."""
        W = self.world_size
        K = self.global_batches(e)
        stream = e in self.stream_epochs
        keys = None if stream else self.source.all()[0]
        plan = None if stream else self._window(e)
        for i in range(math.ceil(max(0, K - p0) / W)):
            g = p0 + i * W + self.rank
            if stream:  # slots a loader worker resolves once the whole round is committed (data/follow.py)
                yield [(StreamSlot(g, j, self.batch_size, p0 + (i + 1) * W, self.buffer), e, False)
                       for j in range(self.batch_size)]
                continue
            if self.pack_tokens and g < len(plan):  # rows of samples: each item names its row
                yield [(keys[j], e, False, r) for r, row in enumerate(plan[g]) for j in row]
                continue
            batch = [keys[j] for j in plan[g]] if g < len(plan) else []
            if batch:
                yield [(k, e, False) for k in batch]
            else:  # the epoch's last round: this rank has no batch left, it trains a zero-weight filler
                yield [(self.source.filler(), e, True)]

    # -- state ---------------------------------------------------------------------------------------------
    def samples_done(self) -> int:
        """Samples in the global batches finished this epoch (fillers not counted)."""
        done = self.global_done()
        if self.epoch in self.stream_epochs:
            return min(done * self.batch_size, self.source.planned)
        plan = self._window(self.epoch)[:done]
        return sum(len(row) for b in plan for row in b) if self.pack_tokens else sum(len(b) for b in plan)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.consumed, "global_done": self.global_done(),
                "world_size": self.world_size, "stream_epochs": sorted(self.stream_epochs), "buffer": self.buffer,
                "group_factor": self.group_factor, "pack_tokens": self.pack_tokens, "batch_size": self.batch_size,
                "accumulate": self.accumulate, "samples_done": self.samples_done()}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was saved, possibly with another world size. A state of an older dflash (epoch
        and batches_done only, same world size) means the same position: its ranks also took batches in rounds."""
        self.epoch = int(state["epoch"])
        self.k0 = self.consumed = int(state["batches_done"])
        self.p0 = int(state.get("global_done", self.k0 * int(state.get("world_size", self.world_size))))
        saved_accumulate = int(state.get("accumulate", self.accumulate))
        if saved_accumulate != self.accumulate:  # the same optimizer steps done, counted in the new windows
            self.k0 = self.consumed = -(-self.k0 // saved_accumulate) * self.accumulate
        if "stream_epochs" in state:
            self.stream_epochs = set(int(e) for e in state["stream_epochs"])
        self.buffer = int(state.get("buffer", self.buffer))  # the stream epoch's batches as they were drawn
        # the epochs' batches as they were planned; a checkpoint older than the setting was planned with 32
        group_factor = int(state.get("group_factor", 32))
        if group_factor != self.group_factor:
            self.group_factor, self._plans = group_factor, {}
        self.saved_pack_tokens = state.get("pack_tokens")  # stages/train.py refuses a resume that packs otherwise

    def resume(self, epoch: int, batches_done: int) -> None:
        """Skip the first `batches_done` batches of `epoch` on this rank (the same world size trained them)."""
        self.load_state_dict({"epoch": epoch, "batches_done": batches_done, "group_factor": self.group_factor,
                              "pack_tokens": self.pack_tokens})


def remaining_steps(sampler: RankBatchSampler, epochs: int, accumulate: int, planned: bool = False) -> int:
    """Optimizer steps left: the rest of the upcoming epoch, then whole epochs up to `epochs`. Lightning steps
    every `accumulate` batches of an epoch (counted from its start) and on its last batch. None are left once the
    last epoch's batches are all done (the sampler has rolled on to an epoch the run does not train)."""
    e, _ = sampler.upcoming()
    if e >= epochs:
        return 0
    done, length = sampler.consumed, sampler.epoch_length(e, planned)
    steps = math.ceil(length / accumulate) - done // accumulate if done < length else 0
    return steps + sum(math.ceil(sampler.epoch_length(x, planned) / accumulate) for x in range(e + 1, epochs))


def shapes_vary(sampler: Optional[RankBatchSampler], pad_multiple: int) -> bool:
    """Whether the training batches come in more than one shape (issue 46 item 2: then the compiled step is
    dynamic from its first compile, not static first and recompiled at each newly varying size): packed rows
    (the anchor width follows the documents in a row), a stream (lengths not known ahead), or samples whose
    lengths pad (to `pad_multiple`) to more than one width. False only for a finished store of one padded length,
    whose static kernels then stay (a fixed-length benchmark store)."""
    if sampler is None or sampler.pack_tokens or sampler.stream_epochs or not getattr(sampler.source, "final", False):
        return True
    _, lengths = sampler.source.all()
    return len({-(-int(n) // max(1, pad_multiple)) for n in lengths}) > 1
