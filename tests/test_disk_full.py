"""A disk that fills during `dflash train` (issue 27): one line naming the disk and the resume command, exit 2,
checkpoints already written intact (pipeline/preflight.py: DiskFull; stages/train.py: the checkpoint writer
and run_train; pipeline/lifecycle.py: the log tee that must not swallow the message)."""

from __future__ import annotations

import errno
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers_cli import HANG_S, ROOT, TINY, dflash
from pipeline.preflight import DiskFull, disk_full_error


def _enospc(filename=None) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", filename)


def test_checkpoint_writer_raises_enospc_naming_the_file_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    from stages.train_ckpt_io import AsyncCheckpointIO  # dflash train's CheckpointIO: writes behind training

    io_ = AsyncCheckpointIO(log=lambda s: None)
    path = tmp_path / "checkpoints" / "step4.ckpt"
    io_.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, path)
    io_.wait()

    def full(obj, f, *a, **k):
        f.write(b"PK partial")  # some bytes made it, then the disk was full
        raise _enospc()

    monkeypatch.setattr(torch, "save", full)
    io_.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, path)  # the write fails behind training ...
    with pytest.raises(OSError) as e:
        io_.wait()  # ... and its error reaches the next save or wait (the end of fit)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    monkeypatch.undo()
    assert io_.load_checkpoint(path)["global_step"] == 2  # the earlier checkpoint, whole
    assert sorted(f.name for f in path.parent.iterdir()) == ["step4.ckpt"]  # no temporary file left


def test_run_train_turns_a_full_disk_anywhere_in_lightnings_chain_into_one_line(tmp_path, monkeypatch):
    import stages.train as train
    from pipeline.config import load_config

    cfg = load_config(TINY, [f"train.run_dir={tmp_path / 'run'}"])
    target = tmp_path / "run" / "checkpoints" / "step4.ckpt"

    def fails(*a, **k):  # as Lightning re-raises: the ENOSPC is the context of a later error
        try:
            raise _enospc(str(target))
        except OSError:
            raise RuntimeError("teardown failed too")

    monkeypatch.setattr(train, "_train", fails)
    cmd = f"dflash train --config {TINY} --init-from old/export"
    with pytest.raises(DiskFull) as e:
        train.run_train(cfg, command=cmd)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"the disk holding {target} is full (No space left on device; / has")
    assert msg.endswith(f"Free space on /, then resume with: dflash train --config {TINY} --resume")
    monkeypatch.setattr(train, "_train", lambda *a, **k: (_ for _ in ()).throw(ValueError("another bug")))
    with pytest.raises(ValueError, match="another bug"):  # any other error keeps its traceback
        train.run_train(cfg, command=cmd)
    assert disk_full_error(RuntimeError("x")) is None


def test_the_log_tee_passes_the_message_on_when_its_file_is_on_a_full_disk():
    from pipeline.lifecycle import Tee

    out = io.StringIO()
    tee = Tee(out, Path("/dev/full"))  # every write to /dev/full fails with ENOSPC
    tee.write("error: the disk holding x is full\n")
    tee.flush()
    tee.write("and after\n")
    assert out.getvalue() == "error: the disk holding x is full\nand after\n"


# the CLI with torch.save failing on its second checkpoint (step 4) as a full disk would
_FILL_AT_SECOND_SAVE = """
import errno, sys, torch
real, n = torch.save, [0]
def save(obj, f, *a, **k):
    n[0] += 1
    if n[0] == 2:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(obj, f, *a, **k)
torch.save = save
from stages.cli import main
sys.argv = ["dflash", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_train_on_a_filling_disk_ends_with_one_line_and_resumes(small_store, tmp_path):
    store = small_store  # the session's 48-sample store (tests/conftest.py): training only reads it
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set",
            "train.num_workers=0", "--set", "train.batch_size=8", "--set", "train.max_steps=6", "--set",
            "train.checkpoint_every=2", "--set", "train.val_every=1000", "--no-export"]
    r = subprocess.run([sys.executable, "-c", _FILL_AT_SECOND_SAVE, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=HANG_S, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the disk holding {run / 'checkpoints'}") and "is full" in last, last
    assert last.endswith("--no-export --resume"), last
    assert [f.name for f in (run / "checkpoints").iterdir() if f.name.startswith(".")] == []
    dflash(*args, "--resume")  # the step-2 checkpoint was intact: the run finishes from it
    from pipeline.ckpt_io import load_training_checkpoint

    assert load_training_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 6
