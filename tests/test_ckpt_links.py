"""Checkpoint names that survive every kill (issue 40 item 3): `last.ckpt` names an existing checkpoint before
the step file it replaces is removed, no `last-vN` names are made, `--resume` repairs a dangling, missing or
versioned link from the checkpoints present (one line), stale `.NAME.tmpPID` files of dead writers go at the
start, and a FIFO planted as last.ckpt is refused without being read (item 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers_cli import ROOT, TINY
from pipeline.ckpt_io import (SpecialFile, load_training_checkpoint, relink, remove_stale_temps, repair_last_link,
                              require_regular)

REFUSE_S = 120  # a refusal comes in seconds; a FIFO read would block forever (a hang guard, not a speed rule)


def _files(d: Path) -> dict[str, str]:
    """name -> 'file' or '-> target' for everything in d."""
    return {f.name: f"-> {os.readlink(f)}" if f.is_symlink() else "file" for f in sorted(d.iterdir())}


def _save(d: Path, step: int) -> Path:
    f = d / f"step{step}.ckpt"
    torch.save({"global_step": step}, f)
    return f


def test_a_dangling_link_and_a_versioned_one_are_repaired_in_one_line(tmp_path):
    # what a kill left under the old names: last.ckpt on the removed step 2, last-v1.ckpt on step 4
    _save(tmp_path, 4)
    os.symlink("step2.ckpt", tmp_path / "last.ckpt")
    os.symlink("step4.ckpt", tmp_path / "last-v1.ckpt")
    lines = []
    line = repair_last_link(tmp_path, lines.append)
    assert lines == [line] and "\n" not in line
    assert "last.ckpt named step2.ckpt, which is missing; it now names step4.ckpt" in line
    assert "removed the versioned link(s) last-v1.ckpt" in line
    assert _files(tmp_path) == {"last.ckpt": "-> step4.ckpt", "step4.ckpt": "file"}
    assert load_training_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4


def test_a_missing_link_names_the_newest_step_and_a_good_one_is_kept(tmp_path):
    for s in (2, 10, 4):
        _save(tmp_path, s)
    line = repair_last_link(tmp_path, lambda s: None)
    assert "last.ckpt was missing; it now names step10.ckpt" in line
    relink(str(tmp_path / "step4.ckpt"), str(tmp_path / "last.ckpt"))  # a good link stays, even to an older step
    assert repair_last_link(tmp_path, lambda s: None) is None
    assert os.readlink(tmp_path / "last.ckpt") == "step4.ckpt"
    assert not [f for f in tmp_path.iterdir() if ".tmp" in f.name]


def test_stale_temporaries_of_dead_writers_are_removed_and_a_live_writers_kept(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(p.stdout)
    (tmp_path / f".step6.ckpt.tmp{dead}").write_bytes(b"torn")
    (tmp_path / f".last.ckpt.tmp{dead}").symlink_to("step6.ckpt")
    (tmp_path / f".step8.ckpt.tmp{os.getpid()}").write_bytes(b"being written")
    _save(tmp_path, 4)
    assert remove_stale_temps(tmp_path) == [f".last.ckpt.tmp{dead}", f".step6.ckpt.tmp{dead}"]
    assert _files(tmp_path) == {f".step8.ckpt.tmp{os.getpid()}": "file", "step4.ckpt": "file"}


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "last.ckpt"
    os.mkfifo(fifo)
    with pytest.raises(SpecialFile, match=r"last.ckpt: is a FIFO, not a regular file, so it was not read"):
        load_training_checkpoint(fifo)  # without the check this blocks in open() for ever
    with pytest.raises(SpecialFile, match="is a directory"):
        require_regular(tmp_path, "training checkpoint")
    with pytest.raises(SpecialFile, match="FIFO"):
        repair_last_link(tmp_path)


def test_resume_with_a_fifo_as_last_ckpt_is_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.mkfifo(run / "checkpoints" / "last.ckpt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "stages.cli", "train", "--config", TINY, "--store",
                        str(tmp_path / "none.zarr"), "--set", f"train.run_dir={run}", "--resume"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=REFUSE_S)  # a regression fails here, never hangs
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "last.ckpt: is a FIFO, not a regular file, so it was not read" in last and "remove it" in last


class _Strategy:
    def __init__(self, io):
        self.checkpoint_io = io

    def barrier(self, *_):
        pass

    def reduce_boolean_decision(self, decision, all=True):  # noqa: A002 - Lightning's signature
        return decision

    def remove_checkpoint(self, path):
        self.checkpoint_io.remove_checkpoint(path)


class _Trainer:
    """What ModelCheckpoint's save path reads of a Trainer: rank 0 of one, resumed from last.ckpt."""
    is_global_zero, loggers = True, []

    def __init__(self, io, ckpt_path):
        self.strategy, self.ckpt_path, self.global_step = _Strategy(io), ckpt_path, 0

    def save_checkpoint(self, path, weights_only=False):
        self.strategy.checkpoint_io.save_checkpoint({"global_step": self.global_step}, path)


def test_a_resume_from_the_first_checkpoint_links_last_before_removing_the_old_step(tmp_path, monkeypatch):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from stages.train_ckpt_io import AsyncCheckpointIO, LinkAfterWrite

    last = tmp_path / "last.ckpt"
    relink(str(_save(tmp_path, 2)), str(last))
    seen = []  # (removed file, what last.ckpt named at that moment, whether that exists)
    real = TorchCheckpointIO.remove_checkpoint

    def remove(self, path):
        seen.append((Path(path).name, os.readlink(last), os.path.exists(last)))
        real(self, path)

    monkeypatch.setattr(TorchCheckpointIO, "remove_checkpoint", remove)
    io = AsyncCheckpointIO(log=lambda s: None)
    io._copy.device_types = ("cuda",)  # CPU tensors are cloned, no pinning
    cb = LinkAfterWrite(dirpath=tmp_path, every_n_train_steps=2, save_last="link", save_top_k=1,
                        filename="step{step}", auto_insert_metric_name=False)
    # the first checkpoint's callback state: it was saved before Lightning set last_model_path
    cb.load_state_dict({**cb.state_dict(), "best_model_path": str(tmp_path / "step2.ckpt"), "last_model_path": ""})
    trainer = _Trainer(io, str(last))
    for step in (4, 6):
        trainer.global_step = step
        metrics = {"step": torch.tensor(step), "epoch": torch.tensor(0)}
        cb._save_topk_checkpoint(trainer, metrics)
        cb._save_last_checkpoint(trainer, metrics)
        io.wait()
    assert seen == [("step2.ckpt", "step4.ckpt", True), ("step4.ckpt", "step6.ckpt", True)]
    assert _files(tmp_path) == {"last.ckpt": "-> step6.ckpt", "step6.ckpt": "file"}  # no last-v1.ckpt
