"""Files a user hands dflash (issue 27): a checkpoint never runs code (pipeline/ckpt_io.py) in `dflash export`,
`dflash eval`, `dflash train --resume` (our pre-read and Lightning's own load) and the best-checkpoint scan;
real checkpoints keep loading."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY, dflash
from helpers_cli import dflash_all, dflash_each, must_pass, start  # side by side / refusals in one subprocess
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
def trained(small_store, tmp_path_factory):
    """The session's small store (1 shard, 48 samples; tests/conftest.py) and a 3-step run of it with a validation
    at step 2 (best-step2.ckpt)."""
    store = small_store
    run = tmp_path_factory.mktemp("untrusted") / "run"
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


@pytest.mark.slow  # the `trained` fixture (a tiny training run, ~14 s) is the slow tests' here; CI runs it
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
    """Trainer.fit(ckpt_path=...) loads with the strategy's CheckpointIO (dflash train's: stages/train_ckpt_io.py's
    AsyncCheckpointIO): ours refuses whatever weights_only Lightning passes."""
    from stages.train_ckpt_io import AsyncCheckpointIO

    marker = tmp_path / "marker"
    evil = plant(tmp_path / "last.ckpt", marker)
    io = AsyncCheckpointIO(log=lambda s: None)
    for wo in (None, False, True):
        with pytest.raises(UnsafeCheckpoint):
            io.load_checkpoint(evil, weights_only=wo)
    assert not marker.exists()
    good = tmp_path / "good.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, good)
    io.wait()
    assert torch.equal(io.load_checkpoint(good)["state_dict"]["w"], torch.ones(2))


@pytest.mark.slow  # dflash subprocesses over a trained run: 10-14 s each (the fast subset's 3-minute budget)
def test_export_eval_and_resume_refuse_a_planted_checkpoint(trained, tmp_path):
    store, run = trained
    marker = tmp_path / "marker"
    real = load_training_checkpoint(run / "checkpoints" / "last.ckpt")
    evil = plant(tmp_path / "X.ckpt", marker, like=real)
    out = tmp_path / "out"
    # a last.ckpt planted in a run directory, for --resume
    victim = tmp_path / "victim"
    (victim / "checkpoints").mkdir(parents=True)
    plant(victim / "checkpoints" / "last.ckpt", marker, like=real)
    # export, eval and train --resume: three commands, one subprocess (dflash_each)
    export, ev, resume = dflash_each(
        ["export", str(evil), str(out)], ["eval", str(evil), "--store", store, "--out", str(tmp_path / "ev")],
        ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={victim}", "--set",
         "train.num_workers=0", "--set", "train.batch_size=8", "--resume", "--no-export"])
    line = _one_error_line(export)
    assert "X.ckpt: refused to load" in line and "asks for exec," in line
    assert not out.exists()
    line = _one_error_line(ev)
    assert "X.ckpt: refused to load" in line
    line = _one_error_line(resume)
    assert "last.ckpt: refused to load" in line
    # a best-step file planted beside real checkpoints: the export of the run skips it and takes a real one
    planted_run = tmp_path / "planted"
    os.system(f"cp -r {run} {planted_run}")
    plant(planted_run / "checkpoints" / "best-step3.ckpt", marker, like=real)
    r = dflash("export", str(planted_run), str(tmp_path / "out2"))
    assert "best-step2.ckpt" in r.stdout, r.stdout
    assert not marker.exists()


@pytest.mark.slow  # dflash subprocesses over a trained run: 10-14 s each (the fast subset's 3-minute budget)
def test_eval_refuses_a_store_of_another_target_as_train_does(trained, tmp_path):
    store, run = trained
    alone = tmp_path / "alone"  # an export outside its run: what it recorded of its target is compared
    os.system(f"cp -r {run / 'export'} {alone}")
    # that export evaluated on its own target's store (checked last), beside the extraction of the other store
    own = start([sys.executable, "-m", "stages.cli", "eval", str(alone), "--store", store, "--max-samples", "2",
                 "--out", str(tmp_path / "ev-own")])
    other = str(tmp_path / "other.zarr")  # the same tiny weights, extracted as another target
    dflash("extract", "--config", TINY, "--shards", "1", "--store", other, "--set", "data.max_samples=16",
           "--set", "target.name=other-target")
    # train and three evals refuse the store: four commands, one subprocess (dflash_each)
    r, *evals, r_alone = dflash_each(
        ["train", "--config", TINY, "--store", other, "--set", f"train.run_dir={tmp_path / 't'}"],
        *[["eval", str(drafter), "--store", other, "--out", str(tmp_path / "ev")]
          for drafter in (run / "export", run / "checkpoints" / "last.ckpt")],  # the run's config / the embedded one
        ["eval", str(alone), "--store", other, "--out", str(tmp_path / "ev")])
    train_says = _error(r)
    assert train_says.startswith("error: the store does not match this config")
    want = "target: store was extracted from 'other-target', config says 'dflash-tiny-target'"
    assert want in train_says
    for r in evals:
        assert _error(r) == train_says, r.stderr[-2000:]
    assert not (tmp_path / "ev").exists()  # refused before anything is written (by any of the three evals)
    r = r_alone
    assert _error(r).startswith(f"error: the store does not match the drafter {alone}")
    assert "store was extracted from 'other-target', the drafter was trained for 'dflash-tiny-target'" in r.stderr
    r = must_pass(own.result())
    assert "eval: offline tau" in r.stderr


def _listed(d: Path) -> dict[str, str]:
    return {name: digest for digest, _, name in (x.partition("  ") for x in (d / "checksums.sha256").read_text().splitlines())}


@pytest.mark.slow  # dflash subprocesses over a trained run: 10-14 s each (the fast subset's 3-minute budget)
def test_export_replaces_an_earlier_export_whole_and_refuses_a_foreign_directory(trained, tmp_path):
    import hashlib

    _, run = trained
    ckpt = str(run / "checkpoints" / "last.ckpt")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    out = tmp_path / "out"
    # the refused export and a first export into a new directory, side by side
    refused, first = dflash_all(["export", ckpt, foreign], ["export", ckpt, out], check=False)
    line = _one_error_line(refused)
    assert f"{foreign} is not empty and does not hold a DFlash export" in line
    assert [f.name for f in foreign.iterdir()] == ["notes.txt"] and (foreign / "notes.txt").read_text() == "keep me"
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "modeling_dflash2.py").write_text("# another export's modeling file\n")  # stale, from an earlier export
    (out / "config.json").write_text((out / "config.json").read_text().replace('"qwen3"', '"stale"'))
    dflash("export", ckpt, str(out), "--sglang")
    names = sorted(f.name for f in out.iterdir())
    assert "modeling_dflash2.py" not in names and '"stale"' not in (out / "config.json").read_text()
    assert "auto_map" not in (out / "config.json").read_text()  # the second export's, whole
    listed = _listed(out)
    assert sorted(listed) == [n for n in names if n != "checksums.sha256"]
    for name, digest in listed.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temporary directory left


def _flip(f: Path, at: int) -> None:
    b = bytearray(f.read_bytes())
    b[at] ^= 0x01
    f.write_bytes(bytes(b))


@pytest.mark.slow  # dflash subprocesses over a trained run: 10-14 s each (the fast subset's 3-minute budget)
def test_damaged_weights_are_refused_by_eval_and_init_from_before_anything_is_written(trained, tmp_path):
    from pipeline.export import ExportError, load_exported, verify_checksums

    store, run = trained
    flipped = tmp_path / "flipped"
    os.system(f"cp -r {run / 'export'} {flipped}")
    weights = flipped / "model.safetensors"
    _flip(weights, weights.stat().st_size - 100)  # a weight's byte: the file still parses
    with pytest.raises(ExportError, match="model.safetensors is damaged"):
        load_exported(flipped)
    # a truncated weights file in an export without checksums (an older or a published one)
    torn = tmp_path / "torn"
    os.system(f"cp -r {run / 'export'} {torn}")
    (torn / "checksums.sha256").unlink()
    assert verify_checksums(torn) is False  # nothing to verify: still accepted as before
    (torn / "model.safetensors").write_bytes((torn / "model.safetensors").read_bytes()[:50_000])

    def init_from(export: Path, run_dir: Path) -> list:
        return ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run_dir}", "--set",
                "train.num_workers=0", "--set", "train.batch_size=8", "--set", "train.max_steps=1",
                "--no-export", "--init-from", str(export)]

    # an intact export still starts a run (checked last), beside the refusals below
    intact = start([sys.executable, "-m", "stages.cli", *init_from(run / "export", tmp_path / "r3")])
    # eval and --init-from refuse the damaged weights: three commands, one subprocess (dflash_each)
    r, r1, r2 = dflash_each(["eval", str(flipped), "--store", store, "--out", str(tmp_path / "ev")],
                            init_from(flipped, tmp_path / "r1"), init_from(torn, tmp_path / "r2"))
    assert "model.safetensors is damaged: its sha256 differs" in _one_error_line(r)
    assert not (tmp_path / "ev").exists()
    line = _one_error_line(r1)
    assert line.startswith("error: --init-from: ") and "model.safetensors is damaged" in line
    assert not (tmp_path / "r1").exists()
    line = _one_error_line(r2)
    assert "model.safetensors is not a readable safetensors file" in line and "truncated or damaged" in line
    assert not (tmp_path / "r2").exists()
    must_pass(intact.result())  # an intact export still starts a run
    assert (tmp_path / "r3" / "checkpoints" / "last.ckpt").exists()
