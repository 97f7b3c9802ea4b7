"""The first hour of a new user (issue 43 item 3): RUN/config.yaml alone resumes the run (`--store` recorded), and a
train.max_steps that train.epochs caps is said once, in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import HANG_S, ROOT, TINY, dflash  # noqa: E402


def _step(run: Path) -> int:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]


def _capped(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "train.max_steps" in ln]


@pytest.mark.slow  # a tiny training run killed after its first checkpoint, then resumed (subprocesses)
def test_run_config_yaml_resumes_the_run_from_anywhere_and_a_capped_max_steps_is_said_once(tiny_store, tmp_path):
    run, log = tmp_path / "run", tmp_path / "first.log"
    args = ["train", "--config", TINY, "--store", tiny_store, "--no-export", "--set", f"train.run_dir={run}",
            "--set", "train.epochs=1", "--set", "train.max_steps=100000", "--set", "train.num_workers=0",
            "--set", "train.checkpoint_every=3", "--set", "train.val_every=1000"]
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, stderr=err,
                             stdout=subprocess.DEVNULL, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        deadline = time.time() + HANG_S  # a hang guard only
        while p.poll() is None and time.time() < deadline and not (run / "checkpoints" / "last.ckpt").exists():
            time.sleep(0.1)
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL and 3 <= _step(run) < 14, "the run ended before its kill"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["store"]["path"] == str(Path(tiny_store).resolve()) and saved["train"]["run_dir"] == str(run)
    elsewhere = tmp_path / "elsewhere"  # another directory: nothing relative to where the run started is needed
    elsewhere.mkdir()
    r = dflash("train", "--config", str(run / "config.yaml"), "--resume", "--no-export", cwd=elsewhere)
    assert r.stderr.splitlines()[0] == (f"train: config {run / 'config.yaml'}; target {saved['target']['path']}; "
                                        f"store {saved['store']['path']}; run dir {run}")
    epoch = _step(run)  # the resumed run went on to the end of its one epoch
    said = (f"train: train.max_steps=100000 is more than train.epochs=1 give on this store ({epoch} steps): the run "
            f"stops after {epoch}; raise train.epochs to train longer")
    assert epoch == 14 and _capped(log.read_text()) == [said] and _capped(r.stderr) == [said]
    assert list(elsewhere.iterdir()) == []
