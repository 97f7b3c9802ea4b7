"""Training on a stopped, unfinished extraction (issue 43 item 3): train.follow_timeout_s gives up in one line naming
the committed samples and the two ways forward, --committed-only trains on what is committed, and Ctrl-C while
waiting prints how to start again instead of click's "Aborted!"; a stop names the step its resume continues from. The unfinished store is the session's tiny store
with shard 1's commit record set back to half its samples and not done, as a stopped extraction leaves it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import HANG_S, ROOT, TINY, dflash  # noqa: E402
from data.follow import GrowingStore  # noqa: E402
from pipeline import store as st  # noqa: E402
from pipeline.store_reader import StoreReader

WAIT = ["--set", "train.follow_buffer=100000"]  # the first step's window is the whole store: it waits for shard 1


@pytest.fixture
def stopped_store(tiny_store, tmp_path) -> str:
    import zarr

    store = str(tmp_path / "stopped.zarr")
    shutil.copytree(tiny_store, store)
    g = zarr.open_group(store, mode="a")["shards/00001"]
    half = g.attrs["progress"]["committed_samples"] // 2  # stopped halfway: the stream is held up at shard 1's row 60
    unfinished = {**g.attrs["progress"], "done": False, "committed_batches": 2, "committed_samples": half,
                  "committed_tokens": int(g["sample_start"][half])}
    g.update_attributes({"progress": unfinished, st.PROGRESS_SHA: st.digest(unfinished)})
    return store


def _committed(store: str) -> int:
    return sum(s.progress.committed_samples for s in st.read_all_progress(store))


def _args(store: str, run: Path, *more: str) -> list[str]:
    return ["train", "--config", TINY, "--store", store, "--no-export", "--set", f"train.run_dir={run}",
            "--set", "train.num_workers=0", *more]


@pytest.mark.slow  # two `dflash train` runs end to end (the timeout, then the refusal)
def test_follow_timeout_gives_up_in_one_line_with_the_committed_count(stopped_store, tmp_path):
    r = dflash(*_args(stopped_store, tmp_path / "run", *WAIT, "--set", "train.follow_timeout_s=0.5"), check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert err == [f"error: no new sample was committed to {stopped_store} for 0.5 s (train.follow_timeout_s) while "
                   f"training waited for {GrowingStore(stopped_store, report=False).planned} training samples in commit order: {_committed(stopped_store)} "
                   "samples are committed; resume the extraction (rerun the same `dflash extract`) and rerun this "
                   "training (with --resume once it has a checkpoint), or train on the committed samples alone: the "
                   "same `dflash train` with --committed-only"], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    bad = dflash(*_args(stopped_store, tmp_path / "r2", "--set", "train.follow_timeout_s=0"), check=False)
    assert bad.returncode == 2 and "train.follow_timeout_s must be positive (seconds), or null" in bad.stderr


@pytest.mark.slow  # one training step on the CPU (~15 s)
def test_committed_only_trains_on_what_is_committed(stopped_store, tmp_path):
    run = tmp_path / "run"
    r = dflash(*_args(stopped_store, run, *WAIT, "--committed-only", "--set", "train.max_steps=1"))
    n = len(StoreReader(stopped_store, require_complete=False).samples)
    assert (f"train: --committed-only: training on the {n} samples committed to {stopped_store} (shard(s) [1] not "
            "finished), as on a finished store") in r.stderr
    assert "waiting for extraction" not in r.stderr and (run / "checkpoints" / "last.ckpt").exists()
    both = dflash(*_args(stopped_store, tmp_path / "r2", "--committed-only", "--follow"), check=False)
    assert both.returncode == 2 and "--committed-only trains on the samples committed now" in both.stderr


@pytest.mark.slow  # waits for the first "waiting for extraction" line (5 s) before its Ctrl-C
def test_ctrl_c_while_waiting_says_how_to_start_again(stopped_store, tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "stages.cli", *_args(stopped_store, run, *WAIT)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, deadline = [], time.time() + HANG_S  # a hang guard only
    while time.time() < deadline:
        line = p.stderr.readline()
        assert line, f"train ended before it waited: {''.join(lines)[-3000:]}"
        lines.append(line)
        if line.startswith("train: waiting for extraction"):
            break
    os.killpg(p.pid, signal.SIGINT)
    rest = p.stderr.read()
    assert p.wait(timeout=HANG_S) == 130, rest[-3000:]
    assert "Aborted!" not in rest and "Traceback" not in rest
    assert (f"train: stopped while waiting for the store at {stopped_store} before the first step; no step was "
            "trained, so nothing to resume; start again with: dflash train ") in rest, rest[-3000:]


def test_a_stop_says_from_which_step_the_resume_continues(tmp_path, capsys):
    """A stopped run's last line names the last checkpoint's step: the steps after it are trained again."""
    from types import SimpleNamespace

    import torch

    from stages.train_stop import end_stopped_run

    ckpts, hint = tmp_path / "checkpoints", "dflash train --config c.yaml --resume"
    trainer = SimpleNamespace(global_step=7, strategy=SimpleNamespace())
    ckpts.mkdir()
    assert end_stopped_run(KeyboardInterrupt(), trainer, launcher=False, ckpt_dir=ckpts, hint=hint) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "train: stopped at step 7; no checkpoint was written before the stop, so nothing to resume; start again "
        "with: dflash train --config c.yaml")
    torch.save({"global_step": 4}, ckpts / "step4.ckpt")
    (ckpts / "last.ckpt").symlink_to("step4.ckpt")
    end_stopped_run(KeyboardInterrupt(), trainer, launcher=False, ckpt_dir=ckpts, hint=hint)
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"train: stopped at step 7; the resume continues from step 4, the last checkpoint's (steps 5-7 are trained "
        f"again); checkpoints in {ckpts} are kept; resume with: {hint}")
