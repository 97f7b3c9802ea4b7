"""Exact resume of `dflash train` (issue 23, item 2): killed with SIGKILL at a random step after a checkpoint and
resumed, a CPU run ends with weights and optimizer state bit-identical to an uninterrupted run, every rank
consumed the same samples in the same order, and logs/metrics.csv holds the same rows; also with packing on. On another number of
ranks the rest of the interrupted epoch is dealt over the new ranks: every sample once per epoch, the step
count continues, and the LR schedule is stretched to end at the new last step.

Sample ids come from DFLASH_SAMPLE_LOG=1 (RUN/logs/samples-rankN.jsonl: one line per trained batch)."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers_cli import FEW_ANCHORS, HANG_S, must_pass, start

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DFLASH_SAMPLE_LOG": "1"}


@pytest.fixture
def store(tiny_store):
    """The session's shared tiny store (tests/conftest.py); training only reads it."""
    return tiny_store


def _args(store, run, *extra):
    return ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set", "train.num_workers=1",
            "--set", "train.epochs=2", "--set", "train.checkpoint_every=3", "--set", "train.log_every=1",
            "--set", "train.val_every=5", "--no-export", *FEW_ANCHORS, *extra]


def _run(args, check=True):
    r = subprocess.run([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=HANG_S)
    assert not check or r.returncode == 0, r.stderr[-3000:]
    return r


def _last_step(run: Path) -> int:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]


def _kill_after_checkpoint(args, run: Path, at_least: int, seed: int, total=None) -> int:
    """Start a run, SIGKILL it a random moment after a checkpoint at step >= at_least; return that checkpoint's step.

    With `total` (a function giving the uninterrupted run's last step, asked only after a kill: that run may still
    be going beside this one), a kill that came only after the final checkpoint, or after the run had ended (its
    last steps ran within the random wait: CI, 2026-12-06, with at_least 12 of 14 steps), is tried again from
    scratch, at the first checkpoint and without the wait: what the test proves never depends on the machine's
    speed."""
    for attempt in range(3):
        p = subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        deadline = time.time() + HANG_S  # only a hang guard: correctness never depends on speed
        while time.time() < deadline and p.poll() is None:
            if [f for f in (run / "checkpoints").glob("step*.ckpt") if int(f.stem[4:]) >= at_least]:
                break
            time.sleep(0.1)
        time.sleep(random.Random(seed).uniform(0.0, 1.5) if attempt == 0 else 0.0)  # a random step after it
        p.send_signal(signal.SIGKILL)
        p.wait()
        if p.returncode != 0:  # (0: it finished within the wait, as a killed-after-the-end run: once more below)
            assert p.returncode == -signal.SIGKILL, f"the run failed before it was killed (exit {p.returncode})"
            time.sleep(1.0)  # ranks and loader workers go with their launcher
            step = _last_step(run)
            if total is None or step < total():
                return step
        shutil.rmtree(run)  # killed after the last checkpoint, or not killed at all: nothing to resume, so once more
        at_least = min(at_least, 6)
    pytest.fail(f"three runs reached their last step ({total()}) before the kill (seed {seed})")


def _samples(run: Path, rank: int) -> list[dict]:
    """(step, epoch, batch, ids) of each batch the rank trained (the line's wall-clock time left out)."""
    path = run / "logs" / f"samples-rank{rank}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [{k: v for k, v in x.items() if k != "t"} for x in lines]


def _effective(run: Path, rank: int, killed_lines: int, ckpt_step: int) -> list[dict]:
    """What a rank really trained: the killed run's batches before the checkpoint, then the resumed run's."""
    lines = _samples(run, rank)
    return [x for x in lines[:killed_lines] if x["step"] < ckpt_step] + lines[killed_lines:]


def _rows(run: Path) -> list[dict]:
    with open(run / "logs" / "metrics.csv") as f:  # less the clock's columns, which no two runs share
        return [{k: v for k, v in r.items() if k not in ("train/wall_s", "train/tokens_per_s")}
                for r in csv.DictReader(f)]


@pytest.mark.slow
@pytest.mark.parametrize("devices,accumulate,packing", [(2, 1, False), (1, 2, False), (2, 2, True)])
def test_killed_and_resumed_run_is_bit_identical(store, tmp_path, devices, accumulate, packing):
    extra = ("--devices", str(devices), "--set", f"train.accumulate_grad_batches={accumulate}")
    if packing:  # train.packing: rows of several samples, planned by the sampler (data/packing.py)
        extra += ("--set", "train.packing=true", "--set", "train.batch_size=1")  # ~4 samples per 256-token row
    ref, run = tmp_path / "ref", tmp_path / "run"
    # the uninterrupted run goes beside the one that is killed (their start-ups overlap on the 2 cores); the kill
    # helper wants its last step only after the kill, and the test its files only after the resume
    reference = start([sys.executable, "-m", "stages.cli", *_args(store, ref, *extra)], ENV)

    def total() -> int:
        must_pass(reference.result())
        return _last_step(ref)
    seed = random.randrange(1 << 30)
    ckpt = _kill_after_checkpoint(_args(store, run, *extra), run, random.Random(seed).choice([6, 9, 12]), seed, total)
    killed = {r: len(_samples(run, r)) for r in range(devices)}
    before = [x for x in _rows(run) if int(x["step"]) < ckpt - 1]
    assert before, "metrics.csv held no rows before the checkpoint"
    _run(_args(store, run, *extra, "--resume"))
    total()  # the uninterrupted run has ended, with exit 0
    a = torch.load(ref / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert a["global_step"] == b["global_step"] > ckpt, (a["global_step"], ckpt, seed)
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), f"{k} differs (killed after step {ckpt}, seed {seed})"
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert all(_samples(ref, r) for r in range(devices))
    for r in range(devices):  # the same samples, in the same order, at the same steps, on every rank
        assert _effective(run, r, killed[r], ckpt) == _samples(ref, r), f"rank {r} (killed after step {ckpt}, seed {seed})"
    # metrics.csv: the rows from before the kill kept, none twice: the same rows as the uninterrupted run's
    assert _rows(run) == _rows(ref) and _rows(run)[: len(before)] == before


@pytest.mark.slow
def test_resume_on_more_ranks_deals_the_rest_of_the_epoch(store, tmp_path):
    """1 rank -> 2 ranks (growing the job once extraction has finished): the step count and optimizer state
    continue, each sample of the interrupted epoch is trained once across both runs, and the stretched LR
    schedule ends at zero exactly at the new last step."""
    from pipeline import store as st
    from pipeline.store_reader import StoreReader

    run = tmp_path / "run"
    ckpt = _kill_after_checkpoint(_args(store, run, "--devices", "1"), run, 6, 0)
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    loader = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    killed = len(_samples(run, 0))
    r = _run(_args(store, run, "--devices", "2", "--resume"))
    assert "the learning-rate schedule now ends after" in r.stderr
    reader = StoreReader(store)
    train_ids = sorted(x.sample_id for x in reader.samples if x.split == st.SPLITS["train"])
    lines = [x for x in _samples(run, 0)[:killed] if x["step"] < ckpt] + _samples(run, 0)[killed:] + _samples(run, 1)
    for epoch in (0, 1):
        ids = sorted(i for x in lines if x["epoch"] == epoch for i in x["ids"] if i >= 0)
        assert ids == train_ids, f"epoch {epoch}: {len(ids)} ids for {len(train_ids)} samples"
    resumed = _samples(run, 0)[killed:]
    assert resumed[0]["step"] == ckpt and resumed[0]["epoch"] == loader["epoch"]
    K = math.ceil(len(train_ids) / 16)  # global batches per epoch (batch 16)
    expected = ckpt + math.ceil((K - loader["global_done"]) / 2) + (1 - loader["epoch"]) * math.ceil(K / 2)
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == expected
    assert final["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(0.0, abs=1e-9)
    assert len(final["optimizer_states"][0]["state"]) == len(state["optimizer_states"][0]["state"])
