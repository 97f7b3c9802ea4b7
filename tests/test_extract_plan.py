"""`dflash extract --plan` (stages/plan.py): counts after ingest, store size, free disk and time, printed before
any GPU work; nothing is written (no store directory); the size estimate is within 10% of a real extraction of
the tiny target (another sample count and shard count than the one its factors were measured on)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from helpers_cli import TINY, dflash
from pipeline.config import load_config
from stages.plan import RATE_27B_H200, WEIGHT_BYTES_27B, estimate_time, estimate_training, make_plan, row_ms

SAMPLES = ["--set", "data.max_samples=100"]


def _files_bytes(d: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def test_plan_prints_counts_size_disk_time_and_writes_nothing(tmp_path):
    store = tmp_path / "never" / "store.zarr"
    r = dflash("extract", "--config", TINY, "--store", str(store), "--plan", "--shards", "3", *SAMPLES)
    assert r.returncode == 0
    assert not (tmp_path / "never").exists()  # no store, no logs, no locks
    from data.ingest import ingest
    from pipeline.target import load_tokenizer

    cfg = load_config(TINY, SAMPLES[1::2])
    samples, _ = ingest(cfg.data, load_tokenizer(cfg.target.path))
    n_val = sum(s.split == "validation" for s in samples)
    t_val = sum(len(s.input_ids) for s in samples if s.split == "validation")
    t_train = sum(len(s.input_ids) for s in samples) - t_val
    assert (f"plan: {len(samples) - n_val:,} train samples ({t_train:,} tokens), {n_val:,} validation samples "
            f"({t_val:,} tokens)") in r.stdout, r.stdout
    assert re.search(r"plan: store .* \(bf16\): about [0-9.]+ MB = features 768 B/token raw x 0\.773", r.stdout), r.stdout
    assert re.search(r"plan: free disk at .*: [0-9.,]+ GB \(enough\)", r.stdout), r.stdout
    assert "plan: time" in r.stdout and "nothing was written" in r.stdout
    assert "plan: training time: no measured training rate for this drafter shape" in r.stdout  # the tiny drafter


def test_training_estimate_follows_tokens_when_packing():
    """Issue 28 item 5: unpacked, a short sample costs its measured (per-sample) step time; packed, rows of the
    plan are timed by their tokens, so a chat mix of 384-token samples trains ~1.75 times faster (8 x 52.6 ms vs 239.5 ms a row)."""
    big = "configs/qwen3.6-27b.yaml"
    lengths = [384] * 1024  # 8 to a 3,072-token row: 128 full rows
    plain, note = estimate_training(load_config(big, []), lengths, 2)
    assert plain == pytest.approx(6 * 1024 * row_ms(384) / 1000 / 2) and "train.packing off" in note
    packed, note = estimate_training(load_config(big, ["train.packing=true"]), lengths, 2)
    assert packed == pytest.approx(6 * 128 * 239.5 / 1000 / 2) and "8.00 samples per 3,072-token row, 100.0% full" in note
    assert 1.7 < plain / packed < 1.8
    assert row_ms(1024) == pytest.approx(94.6) and 94.6 < row_ms(2000) < 239.5 and row_ms(8192) > row_ms(3072)
    assert estimate_training(load_config(None, []), lengths, 1)[0] is None  # the tiny drafter: no measured rate


def test_time_estimate_uses_the_measured_27b_rate_and_says_when_it_scales():
    seconds, note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B, cuda=True)
    assert seconds == pytest.approx(9_000_000 / (RATE_27B_H200 * 5)) and "Qwen3.5/3.6-27B" in note
    small, note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B / 1000, cuda=True)
    assert small == pytest.approx(seconds / 1000) and "lower bound" in note and "x1,000" in note
    assert estimate_time(1000, 1, None, cuda=False)[0] is None  # no GPU: no invented figure


def test_time_estimate_follows_extract_fast_forward():
    """The fast forward's measured rate by default; transformers' with extract.fast_forward off (each named)."""
    from stages.plan import RATE_27B_H200_REFERENCE

    fast, note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B, cuda=True)
    ref, ref_note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B, cuda=True, fast_forward=False)
    assert ref == pytest.approx(9_000_000 / (RATE_27B_H200_REFERENCE * 5)) and ref > fast
    assert "fast forward" in note and "11,398" in note
    assert "extract.fast_forward off" in ref_note and "8,977" in ref_note


@pytest.mark.slow
def test_size_estimate_is_within_ten_percent_of_a_real_tiny_extraction(tmp_path):
    store = tmp_path / "store.zarr"
    dflash("extract", "--config", TINY, "--shards", "1", "--store", str(store), *SAMPLES)
    dflash("recode", str(store), str(tmp_path / "int5.zarr"), "--encoding", "int5", "--device", "cpu")
    for path, enc in ((store, "bf16"), (tmp_path / "int5.zarr", "int5")):
        cfg = load_config(TINY, [*SAMPLES[1::2], f"store.encoding={enc}"])
        plan = make_plan(cfg, str(tmp_path / "planned.zarr"), 1)
        real = _files_bytes(path)
        assert abs(plan.store_bytes / real - 1) < 0.10, (enc, plan.store_bytes, real)
