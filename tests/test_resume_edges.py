"""Resume edges (issue 27 item 5): a run killed after a step's checkpoint and before that step's validation
validates on resume (stages/progress.py: ValidateSkippedOnResume): its metrics row and its best-checkpoint
candidacy come back, and the run ends as the uninterrupted one did."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys

import pytest
import torch

from helpers_cli import HANG_S, ROOT, TINY, dflash
from pipeline.ckpt_io import load_training_checkpoint

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}

# the CLI, SIGKILLed when the validation of step 4 starts, once its checkpoint (step4.ckpt, written in the
# background: stages/train_ckpt_io.py) is in place and last.ckpt names it
_KILL_AT_VALIDATION_OF_STEP_4 = """
import os, signal, sys
from stages.train_task import DrafterTask
start = DrafterTask.on_validation_start
def on_validation_start(self):
    if self.global_step == 4:
        from stages.train_ckpt_io import wait_for_checkpoints
        wait_for_checkpoints(self.trainer)  # checkpoints are written behind training: step4.ckpt is now whole
        os.kill(os.getpid(), signal.SIGKILL)
    return start(self)
DrafterTask.on_validation_start = on_validation_start
from stages.cli import main
sys.argv = ["dflash", *sys.argv[1:]]
main()
"""


def _rows(run):
    with open(run / "logs" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_validation_the_kill_skipped_runs_on_resume(tmp_path):
    store = str(tmp_path / "store.zarr")
    dflash("extract", "--config", TINY, "--shards", "1", "--store", store, "--set", "data.max_samples=48")

    def args(run):
        return ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set",
                "train.num_workers=0", "--set", "train.batch_size=8", "--set", "train.max_steps=6", "--set",
                "train.checkpoint_every=2", "--set", "train.val_every=2", "--set", "train.log_every=1",
                "--set", "train.lr=0.02", "--no-export"]

    ref, run = tmp_path / "ref", tmp_path / "run"
    dflash(*args(ref))
    p = subprocess.run([sys.executable, "-c", _KILL_AT_VALIDATION_OF_STEP_4, *args(run)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert load_training_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 4
    ref_val = [r for r in _rows(ref) if r["val/tau"]]
    assert len(ref_val) == 3  # steps 2, 4 and 6
    assert len([r for r in _rows(run) if r["val/tau"]]) == 1  # the kill left step 4's unrun
    dflash(*args(run), "--resume")
    assert _rows(run) == _rows(ref)  # step 4's validation row is back, in its place, nothing twice
    best = sorted(f.name for f in (ref / "checkpoints").glob("best-step*.ckpt"))
    assert sorted(f.name for f in (run / "checkpoints").glob("best-step*.ckpt")) == best
    a = load_training_checkpoint(ref / "checkpoints" / "last.ckpt")
    b = load_training_checkpoint(run / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 6
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k
    assert a["dflash"]["val"] == b["dflash"]["val"]


@pytest.mark.slow
def test_dflash_run_rerun_after_extraction_finished_gives_the_uninterrupted_result(tmp_path):
    """`dflash run` stopped after extraction finished and before training's first checkpoint: the rerun finds the
    store complete, yet trains the stream epoch the uninterrupted run trained (it began following)."""
    store = tmp_path / "store.zarr"

    def run(run_dir):
        return subprocess.run([sys.executable, "-m", "stages.cli", "run", "--store", str(store), "--set",
                               f"train.run_dir={run_dir}", "--set", "data.max_samples=64", "--set",
                               "extract.token_budget=512", "--set", "train.epochs=1", "--set", "train.num_workers=0",
                               "--set", "train.batch_size=8", "--set", "train.follow_buffer=8", "--set",
                               "train.max_steps=4"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S)

    r = run(tmp_path / "ref")  # uninterrupted: training started while the store was being written
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ref" / "logs" / "train-follows").exists()
    # the interrupted run: its training had started following (the marker) and was stopped before any
    # checkpoint; extraction had finished. The rerun:
    again = tmp_path / "again"
    (again / "logs").mkdir(parents=True)
    (again / "logs" / "train-follows").write_text((tmp_path / "ref" / "logs" / "train-follows").read_text())
    r = run(again)
    assert r.returncode == 0 and "(already complete)" in r.stderr, r.stderr[-3000:]
    assert "--follow" in (again / "command.txt").read_text()
    a = load_training_checkpoint(tmp_path / "ref" / "checkpoints" / "last.ckpt")
    b = load_training_checkpoint(again / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 4
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k
    # a new run on the finished store (no marker) trains a shuffled first epoch, as before
    fresh = tmp_path / "fresh"
    r = run(fresh)
    assert r.returncode == 0 and "--follow" not in (fresh / "command.txt").read_text()
