"""Shared pytest setup: GPU tests run only where CUDA exists; everything else runs on 2 CPU cores. Session
fixtures built once for the whole run: the tiny store (`tiny_store`, copied by tests that change it through
`tiny_store_copy`), the small one-shard store (`small_store`), the tiny hybrid target (`hybrid`) and the quality
run (`quality_run`: a store of 800 samples and the drafter trained on it, built in the background on what the suite
leaves idle of the 2 cores; its tests run last). The CLI runner is tests/helpers_cli.py."""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def one_thread():
    """Toy-sized matmuls: thread hand-offs cost more than they save (10 ms per tiny linear on a loaded 2-core
    machine with 2 threads), as the online eval does for tiny targets."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    """A tiny replica of the real target's class (Qwen3_5ForConditionalGeneration: vision tower, 8 layers of
    3 x linear + 1 full attention twice, sharded checkpoint with mtp tensors; scripts/make_tiny_hybrid.py),
    ~2 MB, built once per test session."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from scripts.make_tiny_hybrid import build_tiny_hybrid

    return build_tiny_hybrid(tmp_path_factory.mktemp("hybrid") / "qwen3_5-tiny")


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> str:
    """The tiny target's store, extracted once per session by the CLI (2 shards, 240 samples, bf16; the options
    are helpers_cli.TINY_STORE_OPTS). Shared: read it, never write it; a test that changes a store, or runs a
    command that may write into one, takes `tiny_store_copy`."""
    from helpers_cli import TINY, TINY_STORE_OPTS, dflash

    store = str(tmp_path_factory.mktemp("tiny-store") / "store.zarr")
    r = dflash("extract", "--config", TINY, "--shards", "2", "--store", store, *TINY_STORE_OPTS)
    assert "finished shard(s) [0, 1]" in r.stderr and "complete" in r.stderr, r.stderr[-3000:]
    return store


@pytest.fixture(scope="session")
def small_store(tmp_path_factory) -> str:
    """A one-shard store of the first 48 tiny-chat samples (bf16), extracted once per session by the CLI, for the
    tests whose short runs need no more (before, each of their files extracted the same store itself). Shared:
    read it, never write it (training and eval only read a store)."""
    from helpers_cli import TINY, dflash

    store = str(tmp_path_factory.mktemp("small-store") / "store.zarr")
    r = dflash("extract", "--config", TINY, "--shards", "1", "--store", store, "--set", "data.max_samples=48")
    assert "complete" in r.stderr, r.stderr[-3000:]
    return store


QUALITY_TRAIN = ["train.batch_size=4", "train.epochs=3", "train.num_workers=0", "train.val_every=1000",
                 "train.checkpoint_every=1000"]


def _quality_commands(store: str, run) -> list[list[str]]:
    """quality_run's two CLI commands: 800 tiny-chat samples into one shard, then 3 epochs of batch 4 on them."""
    import sys

    from helpers_cli import TINY

    cli = [sys.executable, "-m", "stages.cli"]
    return [[*cli, "extract", "--config", TINY, "--shards", "1", "--store", store, "--set", "data.max_samples=800"],
            [*cli, "train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}",
             *[x for item in QUALITY_TRAIN for x in ("--set", item)]]]


def idle_priority(pid: int) -> bool:
    """Give the process's session the kernel's lowest CPU share (its autogroup's nice 19, Linux with
    sched_autogroup: nice alone only ranks processes inside one session, and the suite's commands each start their
    own); False where the kernel has no autogroup."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("19")
        return True
    except OSError:
        return False


class _QualityBuild:
    """quality_run built in the background: one shell in a session of its own runs the two commands at the lowest
    CPU share (`idle_priority`; `nice -n 19` too), so it takes what the serial suite leaves idle of the 2 cores (a
    test's one process, a test polling) and next to nothing of what the suite uses; its log is d/build.log."""

    def __init__(self, d):
        import shlex
        import subprocess

        self.store, self.run, self.log = str(d / "store.zarr"), d / "run", d / "build.log"
        script = " && ".join(shlex.join(c) for c in _quality_commands(self.store, self.run))
        with self.log.open("w") as f:
            self.p = subprocess.Popen(["nice", "-n", "19", "sh", "-c", script], stdout=f, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT,
                                      env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        idle_priority(self.p.pid)

    def result(self) -> tuple:
        code = self.p.wait(timeout=1800)
        assert code == 0, f"the quality run's build exited {code}\n{self.log.read_text()[-4000:]}"
        return self.store, self.run

    def kill(self) -> None:
        import signal

        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


def _needs_quality_run(item) -> bool:
    return "quality_run" in getattr(item, "fixturenames", ())


@pytest.fixture(scope="session", autouse=True)
def _quality_run_ahead(request, tmp_path_factory):
    """When the session runs a test that needs quality_run (all slow, none in the fast subset), its build starts
    with the session's first test, at the lowest CPU share (_QualityBuild), and those tests run last
    (pytest_collection_modifyitems): they find it built. None under pytest-xdist or when no test needs it."""
    if hasattr(request.config, "workerinput") or not any(_needs_quality_run(i) for i in request.session.items):
        yield None
        return
    build = _QualityBuild(tmp_path_factory.mktemp("quality"))
    yield build
    build.kill()  # a session that ended first (stopped, or its users failed earlier): not left running


@pytest.fixture(scope="session")
def quality_run(_quality_run_ahead, tmp_path_factory):
    """(store, run): 800 tiny-chat samples extracted into one shard and the drafter trained on them for 3 epochs
    (batch 4), built once per session (in the background: _quality_run_ahead) for test_eval's quality test,
    test_sampling_eval (eval at temperature 0.7) and test_best_ckpt (its --init-from donor); each trained a drafter
    of its own before. Shared: read it, never change it (training and eval only read a store; eval writes its
    report to --out and replaces the export's dflash_tau.json record, which none of its readers looks at)."""
    if _quality_run_ahead is not None:
        return _quality_run_ahead.result()
    from helpers_cli import must_pass, start

    d = tmp_path_factory.mktemp("quality")
    store, run = str(d / "store.zarr"), d / "run"
    for argv in _quality_commands(store, run):
        must_pass(start(argv).result())
    return store, run


@pytest.fixture
def tiny_store_copy(tiny_store, tmp_path) -> str:
    """A private copy of the shared tiny store, for a test that changes it."""
    import shutil

    dst = tmp_path / "store-copy.zarr"
    shutil.copytree(tiny_store, dst)
    return str(dst)


def pytest_collection_modifyitems(config, items):
    """The tests that need quality_run go last, in their order (its build runs in the background meanwhile:
    _quality_run_ahead); without CUDA the GPU tests are skipped."""
    items[:] = [i for i in items if not _needs_quality_run(i)] + [i for i in items if _needs_quality_run(i)]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """The suite's time per test file, slowest first (issue 44: a test's slowness is visible in review; the CI
    run's table goes into docs/benchmarks.md). Setup, call and teardown all count, session fixtures included in
    the file that first needed them."""
    per_file: dict[str, float] = {}
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) in ("setup", "call", "teardown") and hasattr(rep, "duration"):
                name = rep.nodeid.split("::", 1)[0]
                per_file[name] = per_file.get(name, 0.0) + rep.duration
                per_test[rep.nodeid] = per_test.get(rep.nodeid, 0.0) + rep.duration
    if len(per_file) < 2:
        return
    rows = sorted(per_file.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("-", f"time per test file ({sum(per_file.values()) / 60:.1f} min in all)")
    for name, secs in rows[:40]:
        terminalreporter.write_line(f"{secs:8.1f} s  {name}")
    terminalreporter.write_sep("-", "the 25 slowest tests (setup, call and teardown)")
    for name, secs in sorted(per_test.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{secs:8.1f} s  {name}")
