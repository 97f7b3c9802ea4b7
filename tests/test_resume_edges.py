"""Resume edges (issue 27 item 5): a run killed after a step's checkpoint and before that step's validation
validates on resume (stages/progress.py: ValidateSkippedOnResume): its metrics row and its best-checkpoint
candidacy come back, and the run ends as the uninterrupted one did. Killed twice, once at its first checkpoint
and once between a resumed save and the removal of the file it replaces (issue 40), the run resumes
bit-identical, and a resume repairs the dangling and versioned links the old code left there."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys

import pytest
import torch

from helpers_cli import FEW_ANCHORS, HANG_S, ROOT, TINY, dflash
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
    with open(run / "logs" / "metrics.csv") as f:  # less the clock's columns, which no two runs share
        return [{k: v for k, v in r.items() if k not in ("train/wall_s", "train/tokens_per_s")}
                for r in csv.DictReader(f)]


def _args(store, run):
    """The run both kill tests interrupt: 6 steps of 8 samples on the session's 48-sample store (tests/conftest.py:
    small_store; training only reads it), a checkpoint and a validation every 2 steps; 8 anchor blocks a sample
    (helpers_cli.FEW_ANCHORS): they prove bookkeeping, not learning."""
    return ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set",
            "train.num_workers=0", "--set", "train.batch_size=8", "--set", "train.max_steps=6", "--set",
            "train.checkpoint_every=2", "--set", "train.val_every=2", "--set", "train.log_every=1",
            "--set", "train.lr=0.02", "--no-export", *FEW_ANCHORS]


@pytest.fixture(scope="module")
def ref(small_store, tmp_path_factory):
    """The uninterrupted run of `_args`, built once for both kill tests (they only read it)."""
    run = tmp_path_factory.mktemp("resume-edges-ref") / "ref"
    dflash(*_args(small_store, run))
    return run


@pytest.mark.slow
def test_a_validation_the_kill_skipped_runs_on_resume(small_store, ref, tmp_path):
    def args(run):
        return _args(small_store, run)

    run = tmp_path / "run"
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
                               "train.max_steps=4", "--no-expand"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S)

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


# the CLI, SIGKILLed (issue 40) at validation start of step 2 once step2.ckpt is whole (DFLASH_TEST_KILL=val2), or
# right after the resumed run removed step2.ckpt, the file its new step4.ckpt replaced (rm-step2): the window
# between the new save and the old one's removal, where last.ckpt once named the removed file
_KILL_BETWEEN_SAVE_AND_REMOVAL = """
import os, signal, sys
from pathlib import Path
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from stages.train_task import DrafterTask
from stages.train_ckpt_io import wait_for_checkpoints
where = os.environ["DFLASH_TEST_KILL"]
start, remove = DrafterTask.on_validation_start, TorchCheckpointIO.remove_checkpoint
def on_validation_start(self):
    if where == "val2" and self.global_step == 2:
        wait_for_checkpoints(self.trainer)
        os.kill(os.getpid(), signal.SIGKILL)
    return start(self)
def remove_checkpoint(self, path):
    remove(self, path)
    if where == "rm-step2" and Path(path).name == "step2.ckpt":
        os.kill(os.getpid(), signal.SIGKILL)
DrafterTask.on_validation_start, TorchCheckpointIO.remove_checkpoint = on_validation_start, remove_checkpoint
from stages.cli import main
sys.argv = ["dflash", *sys.argv[1:]]
main()
"""


def _names(d):
    return {f.name: os.readlink(f) if f.is_symlink() else "file" for f in d.iterdir()}


@pytest.mark.slow
def test_killed_twice_between_a_save_and_the_old_ones_removal_resumes_bit_identical(small_store, ref, tmp_path):
    from pipeline.ckpt_io import relink

    def args(run):
        return _args(small_store, run)

    def killed(run, where, *extra):
        p = subprocess.run([sys.executable, "-c", _KILL_BETWEEN_SAVE_AND_REMOVAL, *args(run), *extra], cwd=ROOT,
                           env={**ENV, "DFLASH_TEST_KILL": where}, capture_output=True, text=True, timeout=HANG_S)
        assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    killed(run, "val2")  # the first kill: the resume is from the first checkpoint
    assert os.readlink(ckpts / "last.ckpt") == "step2.ckpt"
    killed(run, "rm-step2", "--resume")  # the second: step4.ckpt written and linked, step2.ckpt just removed
    assert {k: v for k, v in _names(ckpts).items() if not k.startswith("best-")} == {
        "last.ckpt": "step4.ckpt", "step4.ckpt": "file"}  # last.ckpt names the new file: no last-v1.ckpt
    # what the same kills left before issue 40: last.ckpt on the removed step 2, last-v1.ckpt on step 4
    relink(str(ckpts / "step2.ckpt"), str(ckpts / "last.ckpt"))
    os.symlink("step4.ckpt", ckpts / "last-v1.ckpt")
    r = dflash(*args(run), "--resume")
    assert ("--resume repaired" in r.stderr and "last.ckpt named step2.ckpt, which is missing; it now names "
            "step4.ckpt" in r.stderr and "removed the versioned link(s) last-v1.ckpt" in r.stderr), r.stderr[-3000:]
    assert _names(ckpts) == _names(ref / "checkpoints")  # last.ckpt -> step6.ckpt, one best: no versioned names
    assert _rows(run) == _rows(ref)
    a = load_training_checkpoint(ref / "checkpoints" / "last.ckpt")
    b = load_training_checkpoint(ckpts / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 6
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
