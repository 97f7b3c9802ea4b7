"""Issue 28's GPU parts, smoke-run on CPU at tiny size through the same code: bench/train_e2e.py's command line
(one builder for the CUDA and the CPU path), its useful-FLOP count of a mixed-length store, its length mixes,
and bench/device_run.sh's `packmfu` and `packtau` parts end to end."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.train_e2e import mix_lengths, train_command, visible_pairs  # noqa: E402
from helpers_cli import Started, selected, start  # noqa: E402
from pipeline.masks import dense_mask, sample_anchors  # noqa: E402


def test_train_command_keeps_every_set_on_cuda_and_on_cpu():
    kw = dict(config="c.yaml", store=Path("/s"), gpus="0,1",
              sets=["train.packing=true", "data.max_length=8192", "train.max_steps=5"])
    gpu, cpu = train_command(**kw, cuda=True), train_command(**kw, cuda=False)
    sets = lambda cmd: [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]  # noqa: E731
    assert sets(gpu) == sets(cpu) and "train.packing=true" in sets(gpu) and "train.max_steps=5" in sets(gpu)
    assert gpu[gpu.index("--gpus") + 1] == "0,1" and "--devices" not in gpu
    assert cpu[cpu.index("--devices") + 1] == "2" and "--gpus" not in cpu


@pytest.mark.parametrize("window", [None, 5, 40])
def test_visible_pairs_equal_the_dense_mask(window):
    g = torch.Generator().manual_seed(window or 0)
    m = torch.rand(300, generator=g) > 0.2
    a = sample_anchors(m, 24, g)
    types = ["sliding_attention"] if window else ["full_attention"]
    got = visible_pairs(a, 8, types, window)[types[0]]
    assert got == int(dense_mask(a[None], 8, 300, window=window).sum())


def test_length_mixes():
    chat, long = mix_lengths("chat", 400, 0), mix_lengths("long", 400, 0)
    assert 950 < statistics.mean(chat) < 1100 and max(chat) <= 3072
    assert 4300 < statistics.mean(long) < 4700 and max(long) == 8192 and min(long) >= 128
    assert mix_lengths("chat", 400, 0) == chat and mix_lengths("fixed", 3, 77) == [77] * 3


def _start_part(part: str, tmp_path: Path) -> Started:
    """`python -m bench.parts run --tiny PART` in the background, OUT=tmp_path/out (helpers_cli.start)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": ""}
    return start([sys.executable, "-m", "bench.parts", "run", "--tiny", part], env)


def _part(part: str, tmp_path: Path, run: Started | None = None) -> subprocess.CompletedProcess:
    """The part's tiny run (`run`, started ahead, else started now) once it has ended."""
    r = (run or _start_part(part, tmp_path)).result(timeout=1800)
    assert "unknown part" not in r.stdout, r.stdout
    return r


SLOW_PARTS = {"test_packmfu_part_at_tiny_size": "packmfu", "test_packtau_part_one_seed_at_tiny_size": "packtau"}


@pytest.fixture(scope="module")
def slow_parts(request, tmp_path_factory) -> dict:
    """part -> (its OUT's parent, its tiny run): the parts of this module's slow tests that this session runs,
    started together at the first one's setup (each is mostly one process at a time, which leaves a core idle);
    each test waits for its own."""
    runs = {}
    for item in selected(request, *SLOW_PARTS):
        d = tmp_path_factory.mktemp(SLOW_PARTS[item.originalname])
        runs[SLOW_PARTS[item.originalname]] = (d, _start_part(SLOW_PARTS[item.originalname], d))
    yield runs
    for _, run in runs.values():  # (a test that did not run: not left running)
        run.proc.kill()
        run.result()


def _slow_part(part: str, slow_parts: dict, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """(the part's tiny run, its OUT): the one slow_parts started ahead, else one started now in tmp_path."""
    d, run = slow_parts.get(part, (tmp_path, None))
    return _part(part, d, run), d / "out"


@pytest.mark.slow  # two tiny `dflash train` runs of a mixed-length store: ~1-3 min
def test_packmfu_part_at_tiny_size(slow_parts, tmp_path):
    r, out = _slow_part("packmfu", slow_parts, tmp_path)  # bench/parts.py's tiny size: chat mix, 10 samples, 6 steps
    res = json.loads((out / "packmfu_chat.json").read_text())
    runs = {k: v for k, v in res.items() if isinstance(v, dict)}
    assert len(runs) == 2, r.stdout[-2000:]
    plain, packed = (runs[k] for k in sorted(runs, key=lambda k: "packing" in k))
    for run in (plain, packed):
        assert run["rc"] == 0 and run["steps"] == 6, "\n".join(run["log"][-20:])
        assert run["useful"]["samples_s"] > 0 and run["useful"]["useful_flops_s"] > 0
    assert any("docs/row" in line for line in packed["log"]) and not any("docs/row" in line for line in plain["log"])
    assert 900 < statistics.mean(res["lengths"]) < 1200
    assert "MFU" in r.stdout and "samples/s" in r.stdout


@pytest.mark.slow  # a 120-sample tiny store, then one packed and one plain drafter, 2 steps each, evaluated: minutes
def test_packtau_part_one_seed_at_tiny_size(slow_parts, tmp_path):
    # bench/parts.py's tiny size: seed 0, 120 samples, 2 steps, 2 online prompts
    r, out = _slow_part("packtau", slow_parts, tmp_path)
    rows = [json.loads(x) for x in (out / "packtau_results.jsonl").read_text().splitlines()]
    assert sorted(x["run"] for x in rows) == ["packed", "plain"], r.stdout[-2000:]
    assert all(x["seed"] == 0 and x["lossless"] and x["online_tau"] >= 1.0 for x in rows)
    assert "packed" in (out / "packtau.log").read_text()


def test_packtests_part_runs_the_gpu_tests_of_packing(tmp_path):
    """The part the GPU host runs: here (no CUDA) its two tests are collected and skipped, not mistyped away."""
    r = _part("packtests", tmp_path)
    assert r.returncode == 0 and r.stdout.count("test_packed_flex_on_gpu_matches_sdpa") == 2, r.stdout[-2000:]
