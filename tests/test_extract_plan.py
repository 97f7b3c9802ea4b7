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
    cpu, note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B, cuda=False)  # no GPU here: the built-in H200 rates
    assert cpu == pytest.approx(seconds) and note.startswith("from no GPU here, so the built-in H200 rates: 11,398")


def test_time_estimate_follows_extract_fast_forward():
    """The fast forward's measured rate by default; transformers' with extract.fast_forward off (each named)."""
    from stages.plan import RATE_27B_H200_REFERENCE

    fast, note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B, cuda=True)
    ref, ref_note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B, cuda=True, fast_forward=False)
    assert ref == pytest.approx(9_000_000 / (RATE_27B_H200_REFERENCE * 5)) and ref > fast
    assert "fast forward" in note and "11,398" in note
    assert "extract.fast_forward off" in ref_note and "8,977" in ref_note
    fp8, fp8_note = estimate_time(9_000_000, 5, WEIGHT_BYTES_27B, cuda=True, fp8_block=True)  # target_precision
    assert fp8 == pytest.approx(9_000_000 / (15370 * 5)) and "15,370" in fp8_note and "block FP8" in fp8_note


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


def test_schedules_match_a_hand_computation():
    """Issue 41 item 4, the design brief's node: extraction 7 h on 5 GPUs (35 GPU-h), training 22 h on 8 (176 GPU-h),
    6 epochs, 3 GPUs training beside extraction. Split: max(176/3, 7 + 176 x 5/6 / 3) = 58.67 h. Expansion: by
    7 h the 3 GPUs trained 21 GPU-h (under the first epoch's 29.33), the other 155 on 8: 7 + 19.375 = 26.375 h.
    One after the other on 8: 35/8 + 22 = 26.375 h. A fast trainer is held to the store: 1 h of training work
    on 3 GPUs still ends after the 7 h of extraction, its first epoch (1/6 h) trained by then."""
    from stages.plan import schedules

    h = schedules(35 * 3600, 176 * 3600, 6, 5, 3)
    assert {k: v / 3600 for k, v in h.items()} == pytest.approx({"split": 176 / 3, "expand": 26.375,
                                                                 "sequential": 26.375})
    fast = schedules(35 * 3600, 3 * 3600, 6, 5, 3)
    assert fast["split"] / 3600 == pytest.approx(7 + 2.5 / 3)  # 7 h + the other 5 epochs (2.5 GPU-h) on 3
    assert fast["expand"] / 3600 == pytest.approx(7 + 2.5 / 8)
    whole = schedules(35 * 3600, 176 * 3600, 6, 8, 0)  # extraction takes the node: no split
    assert whole["split"] == float("inf") and whole["expand"] == whole["sequential"] == pytest.approx(211 / 8 * 3600)


def test_run_plan_uses_the_training_gpus_of_the_command(tmp_path):
    """`dflash run --plan --extract-gpus 0-4 --train-gpus 5-7`: training time on 3 GPUs (not the 5 extraction
    GPUs), the three schedules on 8, from the built-in H200 rates on this GPU-less machine; nothing written."""
    store, run = tmp_path / "never" / "store.zarr", tmp_path / "never" / "run"
    sets = [*SAMPLES, "--set", "drafter.hidden_size=5120", "--set", f"train.run_dir={run}"]
    from click.testing import CliRunner

    from stages.cli import main

    r = CliRunner().invoke(main, ["run", "--config", TINY, "--store", str(store), "--plan", "--extract-gpus", "0-4",
                                  "--train-gpus", "5-7", *sets])
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "never").exists()
    cfg = load_config(TINY, sets[1::2])
    p = make_plan(cfg, str(store), 5, train_gpus=3)
    assert p.train_gpus == 3 and "no GPU here, so the built-in H200 rates" in p.rate_note
    train_gpu_s = estimate_training(cfg, _train_lengths(cfg), 1)[0]
    assert p.train_seconds == pytest.approx(train_gpu_s / 3)
    assert p.schedules["split"] == pytest.approx(max(train_gpu_s / 3, p.seconds + train_gpu_s * 5 / 6 / 3))
    assert p.schedules["sequential"] == pytest.approx((p.seconds * 5 + train_gpu_s) / 8)
    assert f"plan: training time on 3 GPU(s): about {p.train_seconds:.1f} s" in r.stdout, r.stdout
    assert "plan: schedules on 8 GPU(s)" in r.stdout
    assert f"split, extraction on 5 and training on 3 (following the store): about {p.schedules['split']:.1f} s" \
        in r.stdout
    assert f"training on all 8 once extraction ends (`dflash run`'s default): about {p.schedules['expand']:.1f} s" \
        in r.stdout
    assert f"extraction then training on all 8: about {p.schedules['sequential']:.1f} s" in r.stdout
    assert "without --plan to run" in r.stdout


def _train_lengths(cfg):
    from data.ingest import ingest
    from pipeline.target import load_tokenizer

    samples, _ = ingest(cfg.data, load_tokenizer(cfg.target.path))
    return [len(s.input_ids) for s in samples if s.split == "train"]


def test_extract_plan_trains_on_the_rest_of_the_node(capsys):
    """`dflash extract --plan` on 5 shards of a GPU-less machine: the rest of an assumed 8 x H200 node trains."""
    from stages.plan import run_plan

    cfg = load_config(TINY, [*SAMPLES[1::2], "drafter.hidden_size=5120"])
    assert run_plan(cfg, store="/nonexistent/never.zarr", shards=5) == 0
    out = capsys.readouterr().out
    assert "plan: training time on 3 GPU(s) (the rest of the node: 8 x H200 assumed: no GPU here)" in out, out
    assert "plan: schedules on 8 GPU(s)" in out and "without --plan to extract" in out


def test_every_encoding_has_its_size_factors_in_the_encoding_module():
    """Issue 44: the plan's size table is the encoding module's; every encoding has a measured factor per size."""
    from pipeline.encoding import COMPRESSION, ENCODINGS, compression_factor

    for enc in ENCODINGS:
        for hidden in (128, 5120):
            f = compression_factor(enc, hidden)
            assert f is not None and 0.5 < f <= 1.0, (enc, hidden)
    assert sorted(COMPRESSION["tiny"]) == sorted(COMPRESSION["large"]) == sorted(ENCODINGS)


def test_plan_survives_a_new_encoding_without_a_measured_factor(monkeypatch, capsys):
    """Issue 44: adding an encoding made --plan fail with a KeyError; an encoding registered without factors
    (a fake int3) is sized raw, and the plan says so."""
    from pipeline import encoding
    from stages.plan import run_plan

    monkeypatch.setattr(encoding, "INT_BITS", {**encoding.INT_BITS, "int3": 3})
    monkeypatch.setattr(encoding, "ENCODINGS", (*encoding.ENCODINGS, "int3"))
    cfg = load_config(TINY, SAMPLES[1::2])
    cfg.store.encoding = "int3"
    assert run_plan(cfg, store="/nonexistent/never.zarr", shards=2) == 0
    out = capsys.readouterr().out
    raw = encoding.raw_bytes_per_token("int3", 3, 128)
    assert f"(int3): about" in out and f"features {raw:,} B/token raw x 1.000 compression (measured on nothing: no " \
        "factor measured for int3 yet" in out, out
