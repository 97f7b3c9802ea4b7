"""Files a user hands dflash (issue 27): a checkpoint never runs code (pipeline/ckpt_io.py) in `dflash export`,
`dflash eval`, `dflash train --resume` (our pre-read and Lightning's own load) and the best-checkpoint scan;
real checkpoints keep loading."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY, dflash
from pipeline.ckpt_io import UnreadableCheckpoint, UnsafeCheckpoint, load_training_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


class _RunsCode:
    """Pickles as a call of exec: loading the file with weights_only=False writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def plant(path: Path, marker: Path, like: dict | None = None) -> Path:
    """A checkpoint-looking file (the real one's keys when `like` is given) whose unpickling runs code."""
    body = dict(like or {"global_step": 3, "dflash": {"step": 3, "val": {"val/tau": 9.0, "step": 3}}})
    body["payload"] = _RunsCode(marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(body, path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny store (1 shard, 48 samples) and a 3-step run of it with a validation at step 2 (best-step2.ckpt)."""
    d = tmp_path_factory.mktemp("untrusted")
    store = str(d / "store.zarr")
    dflash("extract", "--config", TINY, "--shards", "1", "--store", store, "--set", "data.max_samples=48")
    run = d / "run"
    dflash("train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set", "train.num_workers=0",
           "--set", "train.batch_size=8", "--set", "train.max_steps=3", "--set", "train.checkpoint_every=2",
           "--set", "train.val_every=2")
    return store, run


def _one_error_line(r) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith("error: "), r.stderr[-3000:]
    return lines[-1]


def _error(r) -> str:
    """The CLI's error message (train's store refusal spans lines: one per difference)."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "error: " in r.stderr, r.stderr[-3000:]
    return r.stderr[r.stderr.rindex("error: "):]


def test_loader_refuses_a_pickle_that_runs_code_and_reads_real_checkpoints(trained, tmp_path):
    _, run = trained
    marker = tmp_path / "marker"
    evil = plant(tmp_path / "x.ckpt", marker)
    with pytest.raises(UnsafeCheckpoint, match=r"x\.ckpt: refused to load: it asks for exec,"):
        load_training_checkpoint(evil)
    with pytest.raises(UnsafeCheckpoint):
        load_training_checkpoint(evil, mmap=True)
    assert not marker.exists()
    for name in ("last.ckpt", "step2.ckpt", "best-step2.ckpt"):  # what dflash train writes loads, weights included
        ckpt = load_training_checkpoint(run / "checkpoints" / name, mmap=True)
        assert ckpt["dflash"]["arch"] and any(k.startswith("drafter.") for k in ckpt["state_dict"])
    full = load_training_checkpoint(run / "checkpoints" / "last.ckpt")
    assert full["global_step"] == 3 and full["optimizer_states"][0]["state"]
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes((run / "checkpoints" / "last.ckpt").read_bytes()[:5000])
    with pytest.raises(UnreadableCheckpoint, match="torn.ckpt: not a readable training checkpoint"):
        load_training_checkpoint(torn)


def test_lightning_resume_load_goes_through_the_safe_loader(tmp_path):
    """Trainer.fit(ckpt_path=...) loads with the strategy's CheckpointIO: ours refuses whatever weights_only
    Lightning passes."""
    from stages.train import _streaming_checkpoint_io

    marker = tmp_path / "marker"
    evil = plant(tmp_path / "last.ckpt", marker)
    io = _streaming_checkpoint_io()
    for wo in (None, False, True):
        with pytest.raises(UnsafeCheckpoint):
            io.load_checkpoint(evil, weights_only=wo)
    assert not marker.exists()
    good = tmp_path / "good.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, good)
    assert torch.equal(io.load_checkpoint(good)["state_dict"]["w"], torch.ones(2))


def test_export_eval_and_resume_refuse_a_planted_checkpoint(trained, tmp_path):
    store, run = trained
    marker = tmp_path / "marker"
    real = load_training_checkpoint(run / "checkpoints" / "last.ckpt")
    evil = plant(tmp_path / "X.ckpt", marker, like=real)
    out = tmp_path / "out"
    line = _one_error_line(dflash("export", str(evil), str(out), check=False))
    assert "X.ckpt: refused to load" in line and "asks for exec," in line
    assert not out.exists()
    line = _one_error_line(dflash("eval", str(evil), "--store", store, "--out", str(tmp_path / "ev"), check=False))
    assert "X.ckpt: refused to load" in line
    # a last.ckpt planted in a run directory, for --resume
    victim = tmp_path / "victim"
    (victim / "checkpoints").mkdir(parents=True)
    plant(victim / "checkpoints" / "last.ckpt", marker, like=real)
    r = dflash("train", "--config", TINY, "--store", store, "--set", f"train.run_dir={victim}", "--set",
               "train.num_workers=0", "--set", "train.batch_size=8", "--resume", "--no-export", check=False)
    line = _one_error_line(r)
    assert "last.ckpt: refused to load" in line
    # a best-step file planted beside real checkpoints: the export of the run skips it and takes a real one
    planted_run = tmp_path / "planted"
    os.system(f"cp -r {run} {planted_run}")
    plant(planted_run / "checkpoints" / "best-step3.ckpt", marker, like=real)
    r = dflash("export", str(planted_run), str(tmp_path / "out2"))
    assert "best-step2.ckpt" in r.stdout, r.stdout
    assert not marker.exists()


def test_eval_refuses_a_store_of_another_target_as_train_does(trained, tmp_path):
    store, run = trained
    other = str(tmp_path / "other.zarr")  # the same tiny weights, extracted as another target
    dflash("extract", "--config", TINY, "--shards", "1", "--store", other, "--set", "data.max_samples=16",
           "--set", "target.name=other-target")
    r = dflash("train", "--config", TINY, "--store", other, "--set", f"train.run_dir={tmp_path / 't'}", check=False)
    train_says = _error(r)
    assert train_says.startswith("error: the store does not match this config")
    want = "target: store was extracted from 'other-target', config says 'dflash-tiny-target'"
    assert want in train_says
    for drafter in (run / "export", run / "checkpoints" / "last.ckpt"):  # the run's config / the embedded one
        r = dflash("eval", str(drafter), "--store", other, "--out", str(tmp_path / "ev"), check=False)
        assert _error(r) == train_says, r.stderr[-2000:]
    assert not (tmp_path / "ev").exists()  # refused before anything is written
    alone = tmp_path / "alone"  # an export outside its run: what it recorded of its target is compared
    os.system(f"cp -r {run / 'export'} {alone}")
    r = dflash("eval", str(alone), "--store", other, "--out", str(tmp_path / "ev"), check=False)
    assert _error(r).startswith(f"error: the store does not match the drafter {alone}")
    assert "store was extracted from 'other-target', the drafter was trained for 'dflash-tiny-target'" in r.stderr
    r = dflash("eval", str(alone), "--store", store, "--max-samples", "2", "--out", str(tmp_path / "ev"))
    assert "eval: offline tau" in r.stderr
