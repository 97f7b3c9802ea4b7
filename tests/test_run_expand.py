"""`dflash run` expands training when extraction ends (issue 41 items 1 and 3), on the CPU with gloo ranks: one
extraction process and one training rank become two training ranks. The samples of every optimizer step are an
unexpanded run's; the weights are those of a resume on two ranks by hand from the handover checkpoint; and a
kill -9 of `dflash run` before the handover checkpoint, after it, or while the new ranks start leaves no process
behind, and the same command then gives the uninterrupted run's result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
import torch

from helpers_cli import HANG_S, ROOT, must_pass, selected, start
from pipeline.ckpt_io import load_training_checkpoint

# Every expanding run hands over at step 2 (stages/run_expand.ENV_AT): a tiny run's steps take about a second in
# all, less than the extraction process takes to exit after its last commit, and a run whose store was complete
# before its first step would reach its last step, where a request is declined (no step is left for two ranks).
HANDOVER_AT = 2
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DFLASH_SAMPLE_LOG": "1", "DFLASH_TEST_HANDOVER_AT": str(HANDOVER_AT)}
SETS = ["data.max_samples=32", "extract.shards=1", "extract.token_budget=512", "train.epochs=2", "train.num_anchors=8",
        "train.num_workers=0", "train.batch_size=4", "train.accumulate_grad_batches=2", "train.follow_buffer=8",
        "train.val_every=1000", "train.lr=0.01"]


def _cmd(store: Path, run: Path, *extra: str) -> list[str]:
    sets = [w for s in [*SETS, f"train.run_dir={run}"] for w in ("--set", s)]
    return [sys.executable, "-m", "stages.cli", "run", "--store", str(store), *sets, *extra]


def _run(cmd, env=ENV) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def _steps(run: Path, ranks, keep=lambda x: True) -> dict[int, list[list[int]]]:
    """step -> that step's micro-batches (sample ids), rank 0's then rank 1's (DFLASH_SAMPLE_LOG)."""
    out = defaultdict(list)
    for r in ranks:
        for x in map(json.loads, (run / "logs" / f"samples-rank{r}.jsonl").read_text().splitlines()):
            if keep(x):
                out[x["step"]].append([i for i in x["ids"] if i >= 0])
    return dict(out)


def _trained_steps(run: Path) -> dict[int, list[list[int]]]:
    """_steps of both ranks as the run finally trained them: where a rank's log goes back (a rerun after a kill
    starts again at its last checkpoint's step), what the killed process logged from that step on is dropped."""
    out = defaultdict(list)
    for r in (0, 1):
        path, kept = run / "logs" / f"samples-rank{r}.jsonl", []
        for x in map(json.loads, path.read_text().splitlines() if path.exists() else []):
            if kept and (x["epoch"], x["batch"]) <= (kept[-1]["epoch"], kept[-1]["batch"]):
                kept = [k for k in kept if k["step"] < x["step"]]
            kept.append(x)
        for x in kept:
            out[x["step"]].append([i for i in x["ids"] if i >= 0])
    return dict(sorted(out.items()))


def _two_ranks_from(run: Path) -> int:
    """The first step the run trained on two ranks (its handover step; 0 when it trained on two from its start;
    its last step when rank 1 trained none: one rank trained both epochs before the handover's request came, and
    a request at the last step is declined)."""
    path = run / "logs" / "samples-rank1.jsonl"
    if not path.exists():
        return _weights(run)["global_step"]
    return min(json.loads(x)["step"] for x in path.read_text().splitlines())


def _weights(run: Path) -> dict:
    return load_training_checkpoint(run / "checkpoints" / "last.ckpt")


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def expanded(tmp_path_factory):
    """An uninterrupted `dflash run` that expands: (its store, its run dir, its stderr)."""
    tmp = tmp_path_factory.mktemp("expanded")
    r = _run(_cmd(tmp / "store.zarr", tmp / "run"))
    return tmp / "store.zarr", tmp / "run", r.stderr


@pytest.mark.slow
def test_run_expands_to_the_extraction_devices_and_trains_an_unexpanded_runs_steps(expanded, tmp_path):
    store, run, err = expanded
    starts = [x for x in (run / "logs" / "run-train.log").read_text().splitlines() if x.startswith("=== ")]
    assert len(starts) == 2 and "--devices 1 --follow" in starts[0] and starts[1].endswith("--devices 2 --resume")
    assert "moving to 2 CPU process(es) when extraction finishes" in err
    assert "run: extraction finished; training checkpoints at its next optimizer step" in err
    (line,) = [json.loads(x) for x in (run / "logs" / "handover.jsonl").read_text().splitlines()]
    step = line["step"]
    assert line["reason"] == "extraction finished" and (line["from"], line["to"]) == ("1 CPU process(es)", "2 CPU process(es)")
    for k in ("wait_for_step_s", "checkpoint_s", "stop_s", "relaunch_to_first_step_s", "total_s"):
        assert line[k] is not None and line[k] >= 0, (k, line)
    assert f"run: expanded training from 1 CPU process(es) to 2 CPU process(es) at step {step}" in err
    assert "run: done: store" in err
    train_log = (run / "logs" / "run-train.log").read_text()
    assert f"train: handing over at step {step} (extraction finished)" in train_log
    assert "train: stopping after the handover to more GPUs" in train_log and "Traceback" not in train_log
    # the unexpanded schedule: one rank following the finished store (its commit-order stream epoch depends only
    # on the store and the seed), accumulating 2 micro-batches per step
    ref = tmp_path / "ref"
    r = subprocess.run([sys.executable, "-m", "stages.cli", "train", "--store", str(store), "--devices", "1", "--follow",
                        "--no-export", *[w for s in [*SETS, f"train.run_dir={ref}"] for w in ("--set", s)]],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-4000:]
    expected = _steps(ref, [0])
    assert len(expected) == _weights(run)["global_step"] and all(len(b) == 2 for b in expected.values())
    before = _steps(run, [0], keep=lambda x: x["step"] < step)
    assert step == HANDOVER_AT < len(expected) and sorted(before) == list(range(step))
    after = {s: b for s, b in _steps(run, [0, 1]).items() if s >= step}
    assert {**before, **after} == expected


@pytest.mark.slow
def test_a_run_asked_to_hand_over_at_its_last_step_finishes_on_its_own_devices(tmp_path):
    """The request met the training at its last step (DFLASH_TEST_HANDOVER_AT=4 of 4): the training finishes and
    exports where it is, no second training starts, `dflash run` exits 0 and records no handover."""
    store, run = tmp_path / "store.zarr", tmp_path / "run"
    r = _run(_cmd(store, run, "--set", "train.epochs=1"), env={**ENV, "DFLASH_TEST_HANDOVER_AT": "4"})
    assert "run: extraction finished; training checkpoints at its next optimizer step" in r.stderr
    assert "run: the training was at its last step when asked, so it finished on 1 CPU process(es) (no handover)" \
        in r.stderr and "run: done: store" in r.stderr and "expanded training" not in r.stderr
    train_log = (run / "logs" / "run-train.log").read_text()
    assert [x for x in train_log.splitlines() if x.startswith("=== ")][0].endswith("--devices 1 --follow")
    assert len([x for x in train_log.splitlines() if x.startswith("=== ")]) == 1, train_log[-3000:]
    assert "train: asked to hand over at step 4, the run's last: finishing here" in train_log
    assert "handing over" not in train_log and "Traceback" not in train_log
    assert not (run / "logs" / "handover.jsonl").exists() and not (run / "logs" / "handover-stopped.json").exists()
    assert _weights(run)["global_step"] == 4 and (run / "export" / "config.json").is_file()


def _kill_at(phase: str, store: Path, run: Path) -> None:
    """`dflash run` until DFLASH_TEST_HANDOVER_HOLD=phase holds, then kill -9 of it: every process it started is
    gone (the children die with their parent: nothing is left holding a device)."""
    p = subprocess.Popen(_cmd(store, run), cwd=ROOT, env={**ENV, "DFLASH_TEST_HANDOVER_HOLD": phase},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker, deadline = run / "logs" / f"handover-hold-{phase}", time.time() + HANG_S
    while not marker.exists():
        assert p.poll() is None and time.time() < deadline, p.stderr.read()[-4000:] if p.poll() is not None else phase
        time.sleep(0.2)
    children = psutil.Process(p.pid).children(recursive=True)
    assert phase == "relaunch" or children, "the training holds: it is a child of the run"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    p.stderr.close()
    _, alive = psutil.wait_procs(children, timeout=120)
    assert not alive, f"left behind after kill -9 of dflash run: {[c.pid for c in alive]}"


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["checkpoint", "relaunch", "start"])
def test_kill_9_during_the_handover_then_the_same_command_gives_the_uninterrupted_result(expanded, tmp_path, phase):
    """checkpoint: killed before the handover checkpoint (the rerun trains on both ranks from its start, following
    the finished store as the first run did); relaunch: after it, before the new ranks; start: while they start.
    The rerun trains the uninterrupted run's samples in every step, and its weights where both handed over at the
    same step; a run by hand on the same ranks (two from the start, or a resume on two from the handover
    checkpoint) trains the same weights."""
    store, run = tmp_path / "store.zarr", tmp_path / "run"
    _kill_at(phase, store, run)
    stopped = run / "logs" / "handover-stopped.json"
    assert stopped.exists() == (phase != "checkpoint")
    by_hand = tmp_path / "by_hand"
    if phase != "checkpoint":  # the handover checkpoint, to resume on two ranks by hand below
        shutil.copytree(run, by_hand)
    # the run by hand reads only the finished store (and its own copy of the handover checkpoint): it goes beside
    # the rerun whenever the rerun's two-rank start can be told now (the rerun resumes at the handover step; killed
    # before that checkpoint, it trains on two ranks from step 0); the test still decides on the rerun's own logs
    expected_from = 0 if phase == "checkpoint" else json.loads(stopped.read_text())["step"]
    assert expected_from == (0 if phase == "checkpoint" else HANDOVER_AT)
    hand = _by_hand(phase, store, by_hand) if _needs_by_hand(phase, expected_from, expanded[1]) else None
    r = _run(_cmd(store, run))
    assert "(already complete)" in r.stderr and "extraction skipped" in r.stderr and "training on 2 CPU" in r.stderr
    # the uninterrupted run's samples in every optimizer step, on both sides of the handover
    assert _trained_steps(run) == _trained_steps(expanded[1])
    # and its weights, where the ranks trained the same steps: the step of the handover depends on when
    # extraction ended, and one rank accumulating two micro-batches sums the gradient in another order than two
    # ranks do (AdamW makes that 1e-4 by the end). Otherwise the run by hand on the same ranks is the yardstick
    if _needs_by_hand(phase, _two_ranks_from(run), expanded[1]):
        if phase == "checkpoint":  # two ranks from the start, the global batch kept (as the rerun said)
            assert _two_ranks_from(run) == 0
        must_pass((hand or _by_hand(phase, store, by_hand)).result())
        _assert_same_weights(_weights(run), _weights(by_hand))
    elif hand:  # started for a handover step the rerun did not take: waited for, not compared
        hand.result()
    if _two_ranks_from(run) == _two_ranks_from(expanded[1]):
        _assert_same_weights(_weights(expanded[1]), _weights(run))


def _needs_by_hand(phase: str, two_ranks_from: int, expanded_run: Path) -> bool:
    """Whether the kill test compares the rerun with a run by hand on the same ranks: after the handover
    checkpoint, or where the rerun went to two ranks at another step than the uninterrupted run."""
    return phase == "relaunch" or two_ranks_from != _two_ranks_from(expanded_run)


def _by_hand(phase: str, store: Path, by_hand: Path):
    """The kill test's run by hand in the background (helpers_cli.start): two ranks from the start on the finished
    store, the global batch kept (killed before the handover checkpoint), else a resume on two ranks from the
    handover checkpoint copied to `by_hand`."""
    sets = [*SETS, f"train.run_dir={by_hand}", *(["train.accumulate_grad_batches=1"] if phase == "checkpoint" else [])]
    cmd = [sys.executable, "-m", "stages.cli", "train", "--store", str(store), "--devices", "2", "--no-export",
           *(["--follow"] if phase == "checkpoint" else ["--resume"]), *[w for s in sets for w in ("--set", s)]]
    return start(cmd, ENV)


def test_the_handover_figures_come_from_the_protocol_files(tmp_path, monkeypatch):
    """What RUN/logs/handover.jsonl and the view's line say, from the times the two sides wrote; the devices the
    expanded training gets; a plain `dflash train` installs no handover callback."""
    from stages.run_expand import FIRST_STEP, LOG, REQUEST, STOPPED, Handover, clear, union_devices, write_json
    from stages.train_handover import handover_callback

    assert union_devices([0, 1, 2, 3, 4], [5, 6, 7], None, 5) == ([0, 1, 2, 3, 4, 5, 6, 7], 0)
    assert union_devices([], [], None, 1) == ([], 2) and union_devices([], [], 3, 2) == ([], 5)
    h = Handover(tmp_path)
    h.request()
    assert json.loads((tmp_path / REQUEST).read_text())["reason"] == "extraction finished"
    t0 = h.requested_at
    write_json(tmp_path / STOPPED, {"step": 7, "step_at": t0 + 2.0, "checkpoint_at": t0 + 3.5})
    h.exited_at = t0 + 4.0
    h.relaunched("GPUs 5,6,7", "GPUs 0,1,2,3,4,5,6,7")
    h.relaunched_at = t0 + 4.5
    assert h.poll() is None  # no first step yet
    write_json(tmp_path / FIRST_STEP, {"time": t0 + 24.5, "step": 8})
    line = h.poll()
    (rec,) = [json.loads(x) for x in (tmp_path / LOG).read_text().splitlines()]
    assert {k: rec[k] for k in ("step", "wait_for_step_s", "checkpoint_s", "stop_s", "relaunch_to_first_step_s",
                                "total_s")} == {"step": 7, "wait_for_step_s": 2.0, "checkpoint_s": 1.5, "stop_s": 0.5,
                                                "relaunch_to_first_step_s": 20.0, "total_s": 24.5}
    assert line.startswith("run: expanded training from GPUs 5,6,7 to GPUs 0,1,2,3,4,5,6,7 at step 7 (extraction "
                           "finished): handover 24.5 s (wait for the step 2.0 s, checkpoint 1.5 s, stop 0.5 s, "
                           "relaunch to the first step 20.0 s)"), line
    assert h.poll() is None  # recorded once
    clear(tmp_path)
    assert not any((tmp_path / n).exists() for n in (REQUEST, STOPPED, FIRST_STEP)) and (tmp_path / LOG).exists()
    monkeypatch.delenv("DFLASH_HANDOVER_DIR", raising=False)
    monkeypatch.delenv("DFLASH_HANDOVER_FIRST", raising=False)
    assert handover_callback(tmp_path) is None
    monkeypatch.setenv("DFLASH_HANDOVER_DIR", str(tmp_path))
    cb = handover_callback(tmp_path)
    assert cb.expanding and cb.first_step is None and cb.logs == tmp_path / "logs"


def test_a_request_at_the_runs_last_step_is_declined_and_the_training_finishes_there(tmp_path, monkeypatch, capsys):
    """A store complete before the training's last step asks for the handover there: relaunching on more ranks
    would only write the final checkpoint and export, so the training finishes where it is (one line says so,
    once); one step earlier, or with max_steps' cap not yet met, it hands over. No request: nothing to decline."""
    from types import SimpleNamespace

    from stages.run_expand import REQUEST, write_json
    from stages.train_handover import HandoverCallback

    monkeypatch.delenv("DFLASH_TEST_HANDOVER_AT", raising=False)
    cb = HandoverCallback(tmp_path, expanding=True, first_step=None)
    trainer = SimpleNamespace(global_step=8, world_size=1, is_global_zero=True)
    left = {"n": 0}
    task = SimpleNamespace(remaining_steps=lambda: left["n"])
    assert not cb._asked(trainer, task) and capsys.readouterr().err == ""  # not asked
    write_json(tmp_path / REQUEST, {"requested_at": time.time(), "reason": "extraction finished"})
    assert not cb._asked(trainer, task) and not cb._asked(trainer, task)
    assert capsys.readouterr().err == ("train: asked to hand over at step 8, the run's last: finishing here (final "
                                       "checkpoint and export) instead of restarting on more GPUs\n")
    for n in (1, None):  # steps left, or no data plan to tell (no sampler): hand over
        left["n"] = n
        assert cb._asked(trainer, task)


HANDOVER_TEST = "test_handover_bench_part_prints_the_three_figures_at_its_tiny_size"


def _start_handover_part(out: Path):
    """`python -m bench.parts run --tiny handover` in the background, OUT=out (helpers_cli.start)."""
    return start([sys.executable, "-m", "bench.parts", "run", "--tiny", "handover"],
                 {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""})


@pytest.fixture(scope="module", autouse=True)
def handover_part(request, tmp_path_factory):
    """(OUT, the handover part's tiny run) started at this module's first test when the session runs the part's
    test, so it goes beside the expanded run and the kill tests (none of them reads what it writes); else None,
    and the test starts its own."""
    if not selected(request, HANDOVER_TEST):
        yield None
        return
    out = tmp_path_factory.mktemp("handover-part")
    run = _start_handover_part(out)
    yield out, run
    run.proc.kill()  # (its test did not run: not left running)
    run.result()


@pytest.mark.slow
def test_handover_bench_part_prints_the_three_figures_at_its_tiny_size(handover_part, tmp_path):
    """bench/parts.py's `handover` (the GPU figures of issue 41) at its CPU smoke size."""
    out, run = handover_part or (tmp_path, _start_handover_part(tmp_path))
    r = run.result()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    rec = json.loads((out / "handover.json").read_text())
    assert rec["device"] == "cpu" and rec["step"] >= 1
    for k in ("checkpoint_s", "stop_s", "relaunch_to_first_step_s"):
        assert rec[k] is not None and rec[k] >= 0, (k, rec)
    assert "handover: checkpoint " in r.stdout and "relaunch to the first step" in r.stdout, r.stdout[-3000:]


def test_no_expand_reaches_run_node_and_expansion_is_the_default(monkeypatch):
    from click.testing import CliRunner

    import stages.run
    from stages.cli import main

    seen = []
    monkeypatch.setattr(stages.run, "run_node", lambda cfg, **kw: seen.append(kw["expand"]) or 0)
    for extra in ([], ["--no-expand"]):
        r = CliRunner().invoke(main, ["run", "--extract-gpus", "", "--train-gpus", "", *extra])
        assert r.exit_code == 0, r.output
    assert seen == [True, False]
