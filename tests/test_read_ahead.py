"""Issue 46 item 4: the training loader reads the next epoch's first batches while the current epoch ends.

`RankBatchSampler.iter_ahead` is every epoch's batches in one stream, equal to what `__iter__` deals epoch after
epoch (plain, packed, another rank and world size, from a resumed position), and it moves no position state;
`ResumableLoader` with `ahead_epochs` serves each epoch from that stream through one set of workers: the same
batches in the same order as a loader without it, the next epoch dealt to the workers before this epoch's last
batch is handed out, and a new stream where an epoch starts elsewhere (a resume).
"""

from __future__ import annotations

import pytest
import torch

from data.sampler import RankBatchSampler
from data.store_dataset import ResumableLoader

LENGTHS = [5 + (i * 7) % 23 for i in range(22)]


def _per_epoch(sampler: RankBatchSampler, epochs: int) -> list:
    """What Lightning sees epoch after epoch: set_epoch, the epoch's iterator, each batch consumed."""
    out = []
    for e in range(sampler.upcoming()[0], epochs):
        sampler.set_epoch(e)
        for b in sampler:
            out.append(b)
            sampler.consumed += 1
    return out


@pytest.mark.parametrize("kw", [dict(rank=1, world_size=2), dict(pack_tokens=40), dict(world_size=3, rank=2)],
                         ids=["rank1of2", "packed", "rank2of3"])
def test_the_stream_is_what_the_epochs_deal_and_moves_no_state(kw):
    a = RankBatchSampler(LENGTHS, 3, seed=4, **kw)
    ahead = list(a.iter_ahead(3))
    assert (a.epoch, a.consumed, a.k0, a.p0) == (0, 0, 0, 0)  # dealing ahead changed no position
    assert ahead == _per_epoch(RankBatchSampler(LENGTHS, 3, seed=4, **kw), 3)
    assert {b[0][1] for b in ahead} == {0, 1, 2}
    resumed = RankBatchSampler(LENGTHS, 3, seed=4, **kw)
    resumed.load_state_dict({"epoch": 1, "batches_done": 2, "global_done": 2 * resumed.world_size})
    again = RankBatchSampler(LENGTHS, 3, seed=4, **kw)
    again.load_state_dict({"epoch": 1, "batches_done": 2, "global_done": 2 * again.world_size})
    assert list(resumed.iter_ahead(3)) == _per_epoch(again, 3)


def test_a_stream_epoch_or_a_growing_store_is_not_read_ahead():
    assert RankBatchSampler(LENGTHS, 3).can_read_ahead()
    assert not RankBatchSampler(LENGTHS, 3, stream_epochs=(0,)).can_read_ahead()


class _Items(torch.utils.data.Dataset):
    """Items (key, epoch, filler) -> the same tuple: what the loader fetched, for whom."""

    def __getitem__(self, item):
        return item


def _collate(items):
    return [tuple(i) for i in items]


def _loader(workers: int, ahead: bool, sampler: RankBatchSampler) -> ResumableLoader:
    dl = ResumableLoader(_Items(), batch_sampler=sampler, num_workers=workers, collate_fn=_collate,
                         multiprocessing_context="fork" if workers else None, persistent_workers=workers > 0,
                         prefetch_factor=2 if workers else None)
    dl.ahead_epochs = 3 if ahead else None
    return dl


def _epochs(dl: ResumableLoader, epochs: int, seen_at_end: list | None = None) -> list:
    s, out = dl.batch_sampler, []
    for e in range(s.upcoming()[0], epochs):
        s.set_epoch(e)
        n = len(dl) - s.upcoming()[1]  # a resumed epoch: Lightning counts its done batches in the length
        it = iter(dl)
        for i in range(n):  # as Lightning, which knows the length: never a next() past the epoch's last batch
            out.append(next(it))
            s.consumed += 1
            if seen_at_end is not None and i == n - 1:
                seen_at_end.append(list(DEALT))
    return out


DEALT: list = []


def test_the_loader_reads_the_next_epoch_ahead_with_the_same_batches(monkeypatch):
    plain = _epochs(_loader(0, False, RankBatchSampler(LENGTHS, 3, seed=1)), 3)
    real = RankBatchSampler.batches

    def dealt(self, e, p0):  # what the stream handed the workers so far
        for b in real(self, e, p0):
            DEALT.append(b[0][1])
            yield b

    monkeypatch.setattr(RankBatchSampler, "batches", dealt)
    DEALT.clear()
    dl = _loader(2, True, RankBatchSampler(LENGTHS, 3, seed=1))
    at_end: list = []
    got = _epochs(dl, 3, at_end)
    streams = dl._stream
    assert got == plain  # the same batches, in the same order
    # when epoch 0's last batch and epoch 1's were handed out, the next epoch was already with the workers
    assert 1 in at_end[0] and 2 in at_end[1], at_end
    assert streams is not None and streams.next_at == (3, 0)  # one stream served all three epochs
    dl.close_stream()

    resumed = RankBatchSampler(LENGTHS, 3, seed=1)
    resumed.load_state_dict({"epoch": 1, "batches_done": 3, "global_done": 3})
    dl = _loader(2, True, resumed)
    n0 = len(RankBatchSampler(LENGTHS, 3, seed=1))
    assert _epochs(dl, 3) == plain[n0 + 3:]  # a resume starts its own stream at its position
    dl.close_stream()
