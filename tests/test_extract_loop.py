"""Extraction's inner loop (stages/extract_loop.py): the host-built token rows equal the boolean-mask selection
they replaced, the loop hands the writer exactly the features of each sample's real tokens (padded and unpadded
batches, lossless and int5), a batch without padding runs without a mask to the same features, and the loop's
figures (batches, writer busy, waits on a full queue) are real."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import load_config
from pipeline.encoding import decode, encode, from_storage
from pipeline.target import FeatureCapture, capture_features, load_target, truncate_layers
from stages.extract_loop import pipelined_extract, token_rows

ROOT = Path(__file__).resolve().parent.parent
HANG_S = 3600  # only a guard against a hang (tests/helpers_cli.py)
TINY = str(ROOT / "configs" / "tiny.yaml")
LAYERS = [1, 3, 5]


@pytest.mark.parametrize("lengths,S", [([5, 3, 1], 5), ([4, 4], 4), ([7], 9), ([2, 6, 6, 1], 6)])
def test_token_rows_equal_the_boolean_mask_selection(lengths, S):
    att = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]
    rows, sample = token_rows(lengths, S)
    grid = torch.arange(len(lengths) * S).view(len(lengths), S)
    assert rows.tolist() == grid[att].tolist()  # the order feats[att] had: samples back to back
    assert sample.tolist() == np.repeat(np.arange(len(lengths)), lengths).tolist()


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(TINY)
    model = load_target(cfg.target.path, torch.float32, torch.device("cpu"))
    truncate_layers(model, max(LAYERS) + 1)
    return model


def _batches(vocab: int):
    g = torch.Generator().manual_seed(0)
    out = []
    for k, lens in enumerate([[12, 9, 4], [8, 8], [6, 2, 5, 1]]):  # padded, unpadded, padded
        S = max(lens)
        ids = torch.randint(4, vocab, (len(lens), S), generator=g)
        for r, n in enumerate(lens):
            ids[r, n:] = 0
        out.append((k, ids, lens))
    return out


@pytest.mark.parametrize("encoding", ["bf16", "int5"])
def test_the_writer_gets_each_samples_real_tokens(tiny, encoding):
    batches = _batches(tiny.config.vocab_size)
    got: list = []
    stats = pipelined_extract(tiny, FeatureCapture(tiny, LAYERS), encoding, torch.device("cpu"), iter(batches),
                              lambda meta, parts, bad: got.append((meta, parts, bad.copy())), queue_depth=1)
    assert [m for m, _, _ in got] == [0, 1, 2] and stats.batches == 3 and stats.writer_busy_s > 0
    cap = FeatureCapture(tiny, LAYERS)
    for (meta, parts, bad), (_, ids, lens) in zip(got, batches):
        S = ids.shape[1]
        att = (torch.arange(S)[None, :] < torch.tensor(lens)[:, None]).long()
        ref = capture_features(tiny, cap, ids, att)[att.bool()]  # [T, L, H]: the selection the loop replaced
        assert not bad.any() and parts["features"].shape[0] == sum(lens)
        back = decode({k: from_storage(v) for k, v in parts.items()}, encoding, torch.float32)
        want = decode(encode(ref, encoding), encoding, torch.float32)
        if min(lens) < S:  # the same call: the same bytes
            assert all(np.array_equal(parts[k], v.numpy().view(parts[k].dtype)) for k, v in encode(ref, encoding).items())
        else:  # run without a mask (an all-ones mask is dropped by transformers): the same features
            torch.testing.assert_close(back, want, rtol=1e-2 if encoding == "int5" else 1e-5, atol=1e-2)
        assert ((back - ref).norm() / ref.norm()).item() < (0.06 if encoding == "int5" else 0.005)  # the target's


def test_an_unpadded_batch_without_a_mask_gives_the_same_features(tiny):
    ids = torch.randint(4, tiny.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    cap = FeatureCapture(tiny, LAYERS)
    torch.testing.assert_close(capture_features(tiny, cap, ids, None), capture_features(tiny, cap, ids, torch.ones_like(ids)))


def test_waits_for_a_slow_writer_are_counted(tiny, monkeypatch):
    """The writer holds its first batch until the loop is blocked putting into the full queue, then 0.3 s more:
    that wait is the loop's, whatever the machine's load (a plain slow writer lost the race to a slow forward on
    a busy machine, and the queue never filled)."""
    import queue
    import threading
    import types

    import stages.extract_loop as loop

    blocked = threading.Event()

    class Watched(queue.Queue):
        def put(self, item, block=True, timeout=None):
            if self.full():
                blocked.set()  # the loop is about to wait for the writer
            super().put(item, block, timeout)

    monkeypatch.setattr(loop, "queue", types.SimpleNamespace(Queue=Watched))
    batches = _batches(tiny.config.vocab_size) * 2
    held = []

    def slow(meta, parts, bad):
        if not held:
            assert blocked.wait(timeout=HANG_S), "the loop never filled the queue"
        held.append(1)
        time.sleep(0.3)

    stats = pipelined_extract(tiny, FeatureCapture(tiny, LAYERS), "fp8", torch.device("cpu"), iter(batches), slow,
                              queue_depth=1)
    assert stats.batches == 6 and len(held) == 6 and stats.writer_busy_s >= 6 * 0.3
    assert stats.queue_wait_s >= 0.3  # at least the writer's hold after the loop blocked
    assert stats.wall_s >= stats.writer_busy_s


def test_a_writer_error_stops_the_loop_and_is_raised(tiny):
    fed = []

    def feed():
        for b in _batches(tiny.config.vocab_size) * 3:
            fed.append(b[0])
            yield b

    def fail(meta, parts, bad):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        pipelined_extract(tiny, FeatureCapture(tiny, LAYERS), "bf16", torch.device("cpu"), feed(), fail, queue_depth=1)
    assert len(fed) < 9  # it stopped feeding after the error
