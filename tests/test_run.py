"""`dflash run` (issue 17): both stages from one command on the tiny target, on the CPU: one progress view,
one Ctrl-C stops both cleanly, and the same command continues both to the end with every training sample
used once per epoch across the stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import store as st
from pipeline.store_reader import StoreReader
from stages.run import RunError, parse_gpus

from helpers_cli import FEW_ANCHORS, HANG_S  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LONG = HANG_S  # a hang guard only (tests/helpers_cli.py): no assertion depends on speed


def test_gpu_lists():
    assert parse_gpus("0-4") == [0, 1, 2, 3, 4] and parse_gpus("5-7,9") == [5, 6, 7, 9] and parse_gpus("") == []
    with pytest.raises(RunError, match="twice"):
        parse_gpus("0-2,2")
    with pytest.raises(RunError, match="expected GPU indices"):
        parse_gpus("a-b")


def _lines(run: Path) -> list[dict]:
    p = run / "logs" / "samples-rank0.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.mark.slow
def test_run_stops_both_stages_on_one_ctrl_c_and_the_same_command_continues_both(tmp_path):
    store, run = tmp_path / "store.zarr", tmp_path / "run"
    cmd = [sys.executable, "-m", "stages.cli", "run", "--store", str(store), "--set", f"train.run_dir={run}",
           "--set", "data.max_samples=240", "--set", "extract.token_budget=512", "--set", "train.epochs=2", *FEW_ANCHORS,
           "--set", "train.num_workers=1", "--set", "train.batch_size=8", "--set", "train.checkpoint_every=3", "--set", "train.log_every=1",
           "--set", "train.follow_buffer=16", "--no-expand"]  # the split kept (expansion: tests/test_run_expand.py)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DFLASH_SAMPLE_LOG": "1", "DFLASH_TEST_EXTRACT_DELAY": "2"}
    # started as a script's background job is (SIGINT ignored, and inherited): the Ctrl-C `dflash run` passes on
    # must still stop its children. Before, the training child inherited the ignore and waited forever for the
    # stopped extraction; a terminal's job (SIGINT default) is the easier case of the same path
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + LONG
    while not ((run / "checkpoints" / "last.ckpt").exists() and _lines(run)):  # both stages under way
        assert time.time() < deadline and p.poll() is None, p.stderr.read()[-3000:] if p.poll() is not None else "timeout"
        time.sleep(0.3)
    p.send_signal(signal.SIGINT)  # one Ctrl-C (the children have their own process groups: only we reach them)
    first = p.communicate(timeout=LONG)[1]
    assert p.returncode == 130, first[-3000:]
    assert "run: stopping both stages" in first and "continue with the same command" in first
    assert any(x.startswith("extract: ") and " | train: " in x for x in first.splitlines()), first  # one view
    assert "train: stopped" in first.splitlines()[-2], first  # the view's last line, after the stop
    left = subprocess.run(["pgrep", "-f", str(store)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"
    stopped = len(_lines(run))
    ckpt = __import__("torch").load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    env.pop("DFLASH_TEST_EXTRACT_DELAY")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LONG)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(resuming)" in r.stderr and "run: done: store" in r.stderr
    train_log = (run / "logs" / "run-train.log").read_text()
    starts = [x for x in train_log.splitlines() if x.startswith("=== ")]
    assert len(starts) == 2 and "--resume" not in starts[0] and "--resume" in starts[1] and "Traceback" not in train_log
    assert all((st.shard_progress(str(store), i) or st.Progress()).done for i in range(2))
    lines = [b for b in _lines(run)[:stopped] if b["step"] < ckpt] + _lines(run)[stopped:]
    train_ids = sorted(x.sample_id for x in StoreReader(str(store)).samples if x.split == 0)
    for epoch in (0, 1):
        assert sorted(i for b in lines if b["epoch"] == epoch for i in b["ids"] if i >= 0) == train_ids
    assert json.loads((run / "summary.json").read_text())["val"]["val/tau"] > 1.0


def test_progress_view_and_status_show_how_far_training_is_behind(tmp_path):
    """The one-line view of `dflash run` and `dflash status RUN` for a following run, from the files the two
    stages write (STORE/logs/extract-status.json, RUN/progress.json)."""
    import io

    from stages.run import status_line
    from stages.status import show_status

    store, run = tmp_path / "s.zarr", tmp_path / "run"
    (store / "logs").mkdir(parents=True)
    run.mkdir()
    (store / "logs" / "extract-status.json").write_text(json.dumps(
        {"state": "running", "line": "extract: 120/240 samples, 7000/14000 tokens, 1.0K tok/s, ETA 0m07s  [0] 50% [1] 50%",
         "time": time.time(), "pid": os.getpid()}))
    (run / "progress.json").write_text(json.dumps(
        {"state": "running", "step": 5, "total_steps": 40, "steps_per_s": 2.0, "tokens_per_s": 900.0, "eta_s": 17.5,
         "time": time.time(), "metrics": {},
         "data": {"epoch": 0, "global_batches_done": 5, "global_batches": 14, "batch_size": 16, "stream_epoch": True,
                  "readable_samples": 100, "planned_samples": 216, "store_final": False}}))
    line = status_line(str(store), run)
    assert line == ("extract: 120/240 samples, 7000/14000 tokens, 1.0K tok/s, ETA 0m07s | train: step 5/40 2.00 "
                    "steps/s ETA 0.3 min | training is 20 samples behind extraction"), line
    out = io.StringIO()
    assert show_status(str(run), out=out) == 0
    assert "following the store: first epoch in commit order, 20 committed samples not trained yet, extraction " \
           "still writing" in out.getvalue()


def test_every_train_and_extract_option_is_forwarded_by_dflash_run_or_named_as_not():
    """Adding a `dflash train` option fails here until stages/run.py says whether `dflash run` passes it on to its
    training (TRAIN_FORWARDED, with the flag it is written as) or why not (TRAIN_NOT_FORWARDED); the same for
    `dflash extract`. The flags are the click options' own."""
    from stages.cli import main
    from stages.run import EXTRACT_FORWARDED, EXTRACT_NOT_FORWARDED, TRAIN_FORWARDED, TRAIN_NOT_FORWARDED

    for name, forwarded, not_forwarded in (("train", TRAIN_FORWARDED, TRAIN_NOT_FORWARDED),
                                           ("extract", EXTRACT_FORWARDED, EXTRACT_NOT_FORWARDED)):
        params = {p.name: p for p in main.commands[name].params}
        assert not set(forwarded) & set(not_forwarded), name
        assert set(forwarded) | set(not_forwarded) == set(params), (
            f"`dflash {name}` options neither forwarded by `dflash run` nor listed as not: "
            f"{sorted(set(params) - set(forwarded) - set(not_forwarded))}; stale entries: "
            f"{sorted(set(forwarded) | set(not_forwarded) - set(params))}")
        for key, flag in forwarded.items():
            assert flag == params[key].opts[0], (name, key, flag, params[key].opts)
        assert all(why.strip() for why in not_forwarded.values())


def test_the_childrens_command_lines_parse_back_to_what_dflash_run_meant():
    """`child_argv`'s words, read by the children's own click parsers, give exactly the values it was handed;
    a resumed training child is `resume_argv` of the fresh one, as a stopped run's resume hint is."""
    from stages.cli import main
    from stages.run import EXTRACT_FORWARDED, TRAIN_FORWARDED, child_argv
    from stages.train import resume_argv, resume_command

    values = dict(config_path="c.yaml", overrides=["train.lr=1e-4", "data.max_samples=8"], store="/s/store.zarr",
                  devices=2, follow=True)
    argv = child_argv("train", TRAIN_FORWARDED, **values, gpus=None)
    assert argv[:4] == [sys.executable, "-m", "stages.cli", "train"]
    ctx = main.commands["train"].make_context("train", argv[4:])
    assert {k: v for k, v in ctx.params.items() if v not in (None, False, ())} == {**values, "overrides": tuple(values["overrides"])}
    resumed = resume_argv(argv)
    assert resumed == argv + ["--resume"] and main.commands["train"].make_context("train", resumed[4:]).params["resume"]
    assert resume_command("dflash train --config c.yaml --init-from old/export --follow") == \
        "dflash train --config c.yaml --follow --resume"
    x = child_argv("extract", EXTRACT_FORWARDED, config_path="c.yaml", overrides=[], store="/s", shards=3, gpus="0,1,2")
    assert main.commands["extract"].make_context("extract", x[4:]).params == {
        "config_path": "c.yaml", "overrides": (), "store": "/s", "shards": 3, "gpus": "0,1,2", "shard_index": None,
        "plan": False}
    with pytest.raises(KeyError):  # an option the builder does not forward is never dropped silently
        child_argv("train", TRAIN_FORWARDED, init_from="old/export")


def test_every_train_option_reaches_run_train_under_its_own_name():
    """The CLI's `train` passes each option to run_train as a keyword of the same name (gpus parsed, --no-export
    as export=): a new flag is its click option and run_train's parameter."""
    import inspect

    from stages.cli import main
    from stages.train import run_train

    params = inspect.signature(run_train).parameters
    options = {p.name for p in main.commands["train"].params} - {"config_path", "overrides", "no_export"}
    assert options <= set(params) and "export" in params, sorted(options - set(params))
