"""The epoch plans of data/sampler.py: every sample once per epoch on one rank, fillers, resume at any world
size, the next epoch found without Lightning's set_epoch, the optimizer steps left, and the LR schedule's
replan (stages/train_task.WarmupCosine)."""

from __future__ import annotations

import math
import random

import pytest

from data.sampler import FixedSamples, RankBatchSampler, remaining_steps, window_plan


def _epoch(samplers, consume=None):
    """Iterate every rank's sampler for one epoch (as Lightning's loop would: the step sets `consumed`)."""
    out = []
    for s in samplers:
        batches = list(s)
        s.consumed = s.k0 + len(batches) if consume is None else s.k0 + consume
        out.append(batches[: consume] if consume is not None else batches)
    return out


def _real(batches):
    return [k for b in batches for k, _, filler in b if not filler]


@pytest.mark.parametrize("n,bs,world", [(23, 2, 3), (7, 4, 3), (2, 4, 4), (64, 8, 2)])
def test_every_sample_once_per_epoch_fillers_complete_the_last_round(n, bs, world):
    lengths = [30 + (i * 7) % 50 for i in range(n)]
    ranks = [RankBatchSampler(lengths, bs, rank=r, world_size=world, seed=1) for r in range(world)]
    orders = []
    for epoch in (0, 1):
        per_rank = _epoch(ranks)
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == math.ceil(math.ceil(n / bs) / world)
        flat = [k for b in per_rank for k in _real(b)]
        assert sorted(flat) == list(range(n))  # each sample exactly once, on one rank
        assert all(e == epoch for b in per_rank for batch in b for _, e, _ in batch)
        fillers = [batch for b in per_rank for batch in b if batch[0][2]]
        assert len(fillers) == world * len(per_rank[0]) - math.ceil(n / bs)
        assert all(len(f) == 1 and f[0][0] == min(range(n), key=lambda i: lengths[i]) for f in fillers)
        orders.append(_real(per_rank[0]))
    assert orders[0] != orders[1] or n <= bs  # a new order each epoch


def test_the_global_plan_does_not_depend_on_the_world_size():
    lengths = list(range(30, 130))
    one = _real(_epoch([RankBatchSampler(lengths, 4, seed=3)])[0])
    four = _epoch([RankBatchSampler(lengths, 4, rank=r, world_size=4, seed=3) for r in range(4)])
    rounds = [b for i in range(len(four[0])) for b in (four[r][i] for r in range(4)) if not b[0][2]]
    assert [k for b in rounds for k, _, _ in b] == one  # rank r takes global batches r, r + W, ...
    assert one == [i for b in window_plan(lengths, 4, 3, 0) for i in b]


@pytest.mark.parametrize("w_old,w_new,done", [(2, 2, 5), (1, 2, 7), (2, 1, 4), (3, 8, 3), (2, 3, 6)])
def test_resume_on_another_world_size_trains_the_rest_of_the_epoch_once(w_old, w_new, done):
    lengths = [20 + (i * 13) % 90 for i in range(101)]
    old = [RankBatchSampler(lengths, 3, rank=r, world_size=w_old, seed=5) for r in range(w_old)]
    first = _epoch(old, consume=done)
    state = old[0].state_dict()
    assert state["global_done"] == done * w_old and all(s.state_dict() == state for s in old)
    new = [RankBatchSampler(lengths, 3, rank=r, world_size=w_new, seed=5) for r in range(w_new)]
    for s in new:
        s.load_state_dict(state)
    assert len({len(s) for s in new}) == 1 and len(new[0]) == done + math.ceil((34 - done * w_old) / w_new)
    rest = _epoch(new)
    seen = [k for b in first + rest for k in _real(b)]
    assert sorted(seen) == list(range(101))  # nothing twice, nothing skipped
    nxt = _epoch(new)  # the next epoch starts from its beginning on every rank
    assert all(b[0][0][1] == 1 for b in nxt) and sorted(k for b in nxt for k in _real(b)) == list(range(101))


def test_next_epoch_known_before_set_epoch_and_old_states_resume():
    """Lightning asks for len() and iter() of the next epoch before it calls set_epoch: the sampler must already
    serve that epoch. A state of the previous dflash (epoch, batches_done) resumes at the same position."""
    lengths = list(range(40, 63))
    s = RankBatchSampler(lengths, 2, seed=1)
    full = list(s)
    s.consumed = len(full)  # the last batch of epoch 0 was trained
    assert len(s) == len(full) and all(e == 1 for b in list(s) for _, e, _ in b)
    s.set_epoch(1)  # what Lightning then says changes nothing
    assert s.epoch == 1 and s.consumed == 0
    r = RankBatchSampler(lengths, 2, seed=1)
    r.load_state_dict({"epoch": 0, "batches_done": 3})
    assert list(r) == full[3:] and len(r) == len(full)


def test_length_grouping_off_and_its_factor_kept_across_a_resume():
    """train.length_group_factor: 32 sorts each window of 32 batches by length (little padding); 0 cuts the
    shuffled order into batches. A resumed run keeps its checkpoint's factor, so the rest of its epoch is the
    one it planned."""
    lengths = [10 + (i * 37) % 200 for i in range(256)]
    grouped, plain = window_plan(lengths, 8, 2, 0), window_plan(lengths, 8, 2, 0, group_factor=0)
    for plan in (grouped, plain):
        assert sorted(i for b in plan for i in b) == list(range(256))  # every sample once
    spread = lambda plan: sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in plan) / len(plan)
    assert spread(grouped) < 0.2 * spread(plain)  # grouped batches hold similar lengths; plain ones do not
    order = list(range(256))

    random.Random(2 * 1_000_003).shuffle(order)
    assert plain == [order[i : i + 8] for i in range(0, 256, 8)]  # the shuffled order, unsorted
    s = RankBatchSampler(lengths, 8, seed=2, group_factor=0)
    first = list(s)
    s.consumed = 5
    state = s.state_dict()
    assert state["group_factor"] == 0
    r = RankBatchSampler(lengths, 8, seed=2)  # the config now says 32: the checkpoint's 0 wins
    r.load_state_dict(state)
    assert r.group_factor == 0 and list(r) == first[5:]
    old = RankBatchSampler(lengths, 8, seed=2, group_factor=0)  # a checkpoint from before the setting: 32
    old.load_state_dict({"epoch": 0, "batches_done": 5, "global_done": 5, "world_size": 1})
    assert old.group_factor == 32 and list(old) == list(RankBatchSampler(lengths, 8, seed=2, group_factor=32))[5:]


def test_remaining_steps_follow_lightnings_accumulation_windows():
    lengths = [50] * 40  # 10 global batches of 4
    s = RankBatchSampler(lengths, 4, rank=0, world_size=2, seed=0)  # 5 batches per rank and epoch
    assert remaining_steps(s, epochs=3, accumulate=2) == 3 * 3  # windows [0,2), [2,4), [4,5) per epoch
    s.load_state_dict({"epoch": 1, "batches_done": 2, "global_done": 4, "world_size": 2})
    assert remaining_steps(s, epochs=3, accumulate=2) == 2 + 3
    w4 = RankBatchSampler(lengths, 4, rank=0, world_size=4, seed=0)
    w4.load_state_dict(s.state_dict())  # 6 global batches left: 2 per rank, one window; epoch 2: 3 batches
    assert len(w4) == 2 + 2 and remaining_steps(w4, epochs=3, accumulate=2) == 1 + 2


@pytest.mark.parametrize("world, accumulate", [(1, 2), (2, 1), (4, 1)])
def test_no_steps_remain_after_the_last_epoch_whatever_the_ranks_resuming(world, accumulate):
    """A checkpoint at the end of the last epoch (a handover at the last step), resumed on 1, 2 or 4 ranks:
    the sampler rolls on to the next epoch, which the run does not train (it once counted it: "the learning-rate
    schedule now ends after 4 more steps (step 12, planned 8)", then "training done at step 8")."""
    lengths = [50] * 32  # 16 global batches of 2
    s = RankBatchSampler(lengths, 2, rank=0, world_size=1, seed=0, accumulate=2)
    assert remaining_steps(s, epochs=2, accumulate=2) == 2 * 8
    s.load_state_dict({"epoch": 1, "batches_done": 16, "global_done": 16, "world_size": 1, "accumulate": 2})
    assert remaining_steps(s, epochs=2, accumulate=2) == 0
    for rank in range(world):
        r = RankBatchSampler(lengths, 2, rank=rank, world_size=world, seed=0, accumulate=accumulate)
        r.load_state_dict(s.state_dict())
        assert remaining_steps(r, epochs=2, accumulate=accumulate) == 0
        assert remaining_steps(r, epochs=3, accumulate=accumulate) == -(-16 // (world * accumulate))  # one more


def test_warmup_cosine_replan_keeps_the_rate_continuous():
    from stages.train_task import WarmupCosine

    plain = WarmupCosine(100, 0.04)
    ref = [plain(s) for s in range(101)]
    stretched = WarmupCosine(100, 0.04)
    assert [stretched(s) for s in range(40)] == ref[:40]
    assert stretched.remaining(40) == 60
    stretched.replan(40, 120)  # e.g. resumed on half the ranks: twice the steps left
    assert stretched(40) == ref[40] and stretched.remaining(40) == pytest.approx(120)
    assert stretched(40 + 60) == pytest.approx(ref[70]) and stretched(160) == pytest.approx(0.0, abs=1e-12)
    steps = [stretched(s) for s in range(40, 161)]
    assert steps == sorted(steps, reverse=True) and max(abs(a - b) for a, b in zip(steps, steps[1:])) < 0.02
    state = dict(stretched.__dict__)  # what LambdaLR checkpoints for a callable object
    again = WarmupCosine(7, 0.5)
    again.__dict__.update(state)
    assert again(100) == stretched(100)


def test_fixed_samples_filler_is_the_shortest():
    src = FixedSamples(["a", "b", "c"], [5, 2, 9])
    assert src.filler() == "b" and src.planned == 3 and src.all() == (["a", "b", "c"], [5, 2, 9])


def test_length_group_factor_must_not_be_negative():
    from pipeline.config import ConfigError, load_config

    assert load_config(None, ["train.length_group_factor=0"]).train.length_group_factor == 0
    with pytest.raises(ConfigError, match="train.length_group_factor must be 0"):
        load_config(None, ["train.length_group_factor=-1"])
