"""The global batch across a change of world size (issue 41 item 2, stages/train_batch.py): a resume recomputes
train.accumulate_grad_batches so that every optimizer step takes the checkpoint's samples; a world size that does
not divide the global batch takes the nearest one it divides, said in one line; train.keep_global_batch=false
keeps the old behaviour (the config's accumulation, the global batch growing with the ranks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from data.sampler import RankBatchSampler, remaining_steps
from helpers_cli import HANG_S, ROOT, TINY
from pipeline.config import load_config
from stages.train_batch import GlobalBatchError, nearest_accumulate, resume_accumulate, shift_batch_progress


def _state(world, accumulate, batch_size=4, **extra):
    return {"loader": {"epoch": 0, "batches_done": 8, "global_done": 8 * world, "world_size": world,
                       "accumulate": accumulate, "batch_size": batch_size, **extra}, "global_step": 8 // accumulate}


def _cfg(*sets):
    return load_config(TINY, ["train.batch_size=4", *sets])


def test_nearest_accumulate():
    assert nearest_accumulate(24, 8) == 3 and nearest_accumulate(24, 3) == 8  # 3 x 8 <-> 8 x 3
    assert nearest_accumulate(24, 5) == 5  # 25 is nearer than 20
    assert nearest_accumulate(24, 7) == 3  # 21 is nearer than 28
    assert nearest_accumulate(3, 2) == 2  # a tie (2 or 4) takes the larger
    assert nearest_accumulate(1, 2) == 1 and nearest_accumulate(2, 16) == 1  # never below one micro-batch


def test_resume_on_another_world_keeps_the_global_batch(capsys):
    cfg = _cfg("train.accumulate_grad_batches=8")
    assert resume_accumulate(cfg, _state(3, 8), 8, say=True) == 3 and cfg.train.accumulate_grad_batches == 3
    err = capsys.readouterr().err
    assert "resuming on 8 rank(s) (the checkpoint's 3): train.accumulate_grad_batches 3 (was 8)" in err
    assert "global batch stays 24 micro-batches of 4 sample(s)" in err and len(err.strip().splitlines()) == 1
    # the checkpoint's accumulation wins over the config's on its own world size (a second resume, back on 3)
    cfg = _cfg("train.accumulate_grad_batches=8")
    assert resume_accumulate(cfg, _state(8, 3), 3, say=True) == 8
    capsys.readouterr()
    assert resume_accumulate(_cfg(), _state(2, 4), 2, say=True) == 4  # the config says 1: the run's 4 kept
    assert "resuming with the checkpoint's train.accumulate_grad_batches 4 (the config says 1): its global batch " \
        "of 8 micro-batches of 4 sample(s) stays" in capsys.readouterr().err
    # a fresh run: the config's
    assert resume_accumulate(_cfg("train.accumulate_grad_batches=8"), None, 5, say=True) == 8


def test_a_world_that_does_not_divide_takes_the_nearest_in_one_line(capsys):
    cfg = _cfg("train.accumulate_grad_batches=8")
    assert resume_accumulate(cfg, _state(3, 8), 5, say=True) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(3 rank(s) x 8 = 24 micro-batches of 4 sample(s)) does not divide over 5 rank(s): " \
        "using the nearest it divides, 5 x 5 = 25 (train.accumulate_grad_batches 5)" in err[0]
    assert resume_accumulate(_cfg(), _state(3, 8), 5, say=False) == 5 and not capsys.readouterr().err


def test_an_expanding_run_warns_at_its_start_when_the_handover_will_change_the_global_batch():
    """dflash run (stages/run_expand.py `warn_indivisible`): 3 training GPUs x 4 does not divide over 8, said before
    anything trains, with the accumulation that keeps it; a dividing one, or keep_global_batch=false, says nothing."""
    from stages.run_expand import warn_indivisible

    said: list[str] = []
    warn_indivisible(_cfg("train.accumulate_grad_batches=4"), 3, 8, said.append)
    assert said == ["run: WARNING: the global batch (3 x 4 = 12 micro-batches) does not divide over the 8 ranks "
                    "training moves to: after the handover it becomes 8 x 2 = 16; set train.accumulate_grad_batches=8 "
                    "(3 x 8 = 8 x 3) to keep one global batch for the whole run, or pass --no-expand"]
    warn_indivisible(_cfg("train.accumulate_grad_batches=8"), 3, 8, said.append)
    warn_indivisible(_cfg("train.accumulate_grad_batches=4", "train.keep_global_batch=false"), 3, 8, said.append)
    assert len(said) == 1


@pytest.mark.parametrize("recipe", ["qwen3.5-27b", "qwen3.6-27b", "qwen3.8-27b-dflash2"])
def test_the_recipes_global_batch_survives_the_handover_to_the_whole_node(recipe):
    """The recipes train on GPUs 5-7 while 0-4 extract, then `dflash run` moves training onto all 8: their global
    batch divides over both, and over two nodes' 16 (docs/guides/multi-node.md)."""
    cfg = load_config(str(ROOT / "configs" / f"{recipe}.yaml"))
    total = 3 * cfg.train.accumulate_grad_batches
    assert "--gpus 5,6,7" in (ROOT / "configs" / f"{recipe}.yaml").read_text()
    assert total % 8 == 0 and (2 * total) % 16 == 0


def test_keep_global_batch_false_is_the_old_behaviour(capsys):
    cfg = _cfg("train.accumulate_grad_batches=8", "train.keep_global_batch=false")
    assert resume_accumulate(cfg, _state(3, 8), 8, say=True) == 8 and not capsys.readouterr().err


def test_a_resume_with_another_micro_batch_is_refused():
    with pytest.raises(GlobalBatchError, match=r"trained with train.batch_size 2, the config says 4.*"
                                               r"--set train.batch_size=2"):
        resume_accumulate(_cfg(), _state(1, 2, batch_size=2), 2, say=False)


def test_the_sampler_counts_done_steps_in_the_new_windows():
    """1 rank x 2 micro-batches -> 2 ranks x 1: the same data position, the same steps left; the state records
    world, accumulation, micro-batch and samples done."""
    lengths = [20 + (i * 13) % 90 for i in range(101)]  # 26 global batches of 4
    old = RankBatchSampler(lengths, 4, seed=5, accumulate=2)
    first = list(old)[:6]
    old.consumed = 6  # 3 optimizer steps
    state = old.state_dict()
    assert {k: state[k] for k in ("world_size", "accumulate", "batch_size", "global_done")} == \
        {"world_size": 1, "accumulate": 2, "batch_size": 4, "global_done": 6}
    assert state["samples_done"] == sum(len(b) for b in first) == 24
    new = [RankBatchSampler(lengths, 4, rank=r, world_size=2, seed=5, accumulate=1) for r in range(2)]
    for s in new:
        s.load_state_dict(state)
    assert new[0].k0 == new[0].consumed == 3 and new[0].p0 == 6
    ref = RankBatchSampler(lengths, 4, seed=5, accumulate=2)
    ref.load_state_dict(state)
    assert remaining_steps(new[0], 1, 1) == remaining_steps(ref, 1, 2) == 10
    rounds = [b for pair in zip(*(list(s) for s in new)) for b in pair]
    assert [b for b in rounds if not b[0][2]] == list(ref)  # the same global batches, in order


def test_samples_done_counts_packed_rows_samples():
    """With packing a global batch is rows of several samples: samples_done counts the samples, not the rows."""
    lengths = [40 + (i * 29) % 200 for i in range(120)]
    s = RankBatchSampler(lengths, 2, seed=4, pack_tokens=512, accumulate=1)
    batches = list(s)[:3]
    s.consumed = 3
    assert s.state_dict()["samples_done"] == sum(len(b) for b in batches) > 3 * 2


def test_shift_batch_progress_moves_every_counter():
    ckpt = {"loops": {"fit_loop": {"epoch_loop.batch_progress": {
        "total": {"ready": 20, "completed": 19, "started": 20, "processed": 20},
        "current": {"ready": 8, "completed": 7, "started": 8, "processed": 8}, "is_last_batch": False}}}}
    shift_batch_progress(ckpt, -4)
    p = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert p["current"] == {"ready": 4, "completed": 3, "started": 4, "processed": 4} and p["total"]["ready"] == 16


def test_the_callback_realigns_lightnings_counter_with_the_sampler():
    """3 steps done on 2 ranks x 1 (batches_done 3), resumed on 1 rank x 2: the sampler's k0 becomes 6, and the
    checkpoint's loop counters follow before Lightning restores them (else its windows would straddle steps)."""
    from stages.train_batch import realign_callback

    saved = {"epoch": 0, "batches_done": 3, "global_done": 6, "world_size": 2, "batch_size": 4}  # no accumulate:
    resume_state = {"loader": saved, "accumulate": 1}  # an older checkpoint; its config said 1
    cfg = _cfg("train.accumulate_grad_batches=5")
    assert resume_accumulate(cfg, resume_state, 1, say=False) == 2
    sampler = RankBatchSampler([30] * 40, 4, seed=1, accumulate=2)
    sampler.load_state_dict(saved)
    assert (sampler.k0, sampler.p0) == (6, 6)
    ckpt = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [dict(saved, accumulate=None)]},
                                   "epoch_loop.batch_progress": {"total": {"ready": 3, "completed": 3},
                                                                 "current": {"ready": 3, "completed": 3}}}}}
    del ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["accumulate"]
    realign_callback(sampler, resume_state).on_load_checkpoint(None, None, ckpt)
    loop = ckpt["loops"]["fit_loop"]
    assert loop["epoch_loop.batch_progress"]["current"] == {"ready": 6, "completed": 6}
    assert loop["state_dict"]["combined_loader"][0]["accumulate"] == 1  # a second load realigns alike


# the CLI, SIGKILLed at the start of the batch after step 4, once step4.ckpt is written in full
_KILL_AFTER_STEP_4 = """
import os, signal, sys
from stages.train_task import DrafterTask
def on_train_batch_start(self, batch, batch_idx):
    if self.global_step == 4:
        from stages.train_ckpt_io import wait_for_checkpoints
        wait_for_checkpoints(self.trainer)
        os.kill(os.getpid(), signal.SIGKILL)
DrafterTask.on_train_batch_start = on_train_batch_start
from stages.cli import main
sys.argv = ["dflash", *sys.argv[1:]]
main()
"""
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DFLASH_SAMPLE_LOG": "1"}


def _args(store, run, *extra):
    return ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set",
            "train.num_workers=0", "--set", "train.batch_size=4", "--set", "train.accumulate_grad_batches=2", "--set",
            "train.max_steps=8", "--set", "train.checkpoint_every=2", "--set", "train.val_every=1000", "--set",
            "train.lr=0.01", "--no-export", *extra]


def _cli(args, script=None):
    head = ["-c", script] if script else ["-m", "stages.cli"]
    return subprocess.run([sys.executable, *head, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=HANG_S)


def _steps(run, ranks, keep=lambda x: True) -> dict[int, list[list[int]]]:
    """step -> the batches of that step, rank 0's then rank 1's (DFLASH_SAMPLE_LOG)."""
    import json

    out = defaultdict(list)
    for r in ranks:
        path = run / "logs" / f"samples-rank{r}.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        for x in lines:
            if keep(x):
                out[x["step"]].append([i for i in x["ids"] if i >= 0])
    return dict(out)


@pytest.mark.slow
def test_one_rank_accumulating_two_resumed_on_two_ranks_trains_the_same_steps(tiny_store, tmp_path):
    from pipeline.ckpt_io import load_training_checkpoint

    ref, run = tmp_path / "ref", tmp_path / "run"
    r = _cli(_args(tiny_store, ref, "--devices", "1"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli(_args(tiny_store, run, "--devices", "1"), script=_KILL_AFTER_STEP_4)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    before = _steps(run, [0], keep=lambda x: x["step"] < 4)
    (run / "logs" / "samples-rank0.jsonl").unlink()  # what the resumed ranks train is logged afresh
    old = tmp_path / "old"  # the same checkpoint, resumed the old way (the global batch grows with the ranks)
    shutil.copytree(run, old, symlinks=True)
    r = _cli(_args(tiny_store, run, "--devices", "2", "--resume"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming on 2 rank(s) (the checkpoint's 1): train.accumulate_grad_batches 1 (was 2)" in r.stderr
    assert "the learning-rate schedule now ends" not in r.stderr  # the same steps left: no replan
    expected = _steps(ref, [0])
    assert sorted(expected) == list(range(8)) and all(len(b) == 2 for b in expected.values())
    after = _steps(run, [0, 1])
    # every optimizer step took the same samples: rank 0's and rank 1's batch are the reference's two micro-batches
    assert {**before, **after} == expected
    a, b = load_training_checkpoint(ref / "checkpoints" / "last.ckpt"), load_training_checkpoint(
        run / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 8
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert b["lr_schedulers"][0]["_last_lr"] == pytest.approx(a["lr_schedulers"][0]["_last_lr"])
    loader = b["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (loader["world_size"], loader["accumulate"], loader["batch_size"]) == (2, 1, 4)
    assert loader["global_done"] == 16 and loader["samples_done"] == 64
    r = _cli(_args(tiny_store, old, "--devices", "2", "--resume", "--set", "train.keep_global_batch=false"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming on" not in r.stderr and "does not divide" not in r.stderr
    grown = _steps(old, [0, 1])
    assert sorted(grown) == [4, 5, 6, 7] and all(len(b) == 4 for b in grown.values())  # 2 ranks x 2 micro-batches
    flat = lambda batches: sorted(i for b in batches for i in b)  # noqa: E731
    assert flat(grown[4]) == flat(expected[4] + expected[5]) and flat(grown[5]) == flat(expected[6] + expected[7])
