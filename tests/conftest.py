"""Shared pytest setup: GPU tests run only where CUDA exists; everything else runs on 2 CPU cores. Session
fixtures built once for the whole run: the tiny store (`tiny_store`, copied by tests that change it through
`tiny_store_copy`), the small one-shard store (`small_store`), the tiny hybrid target (`hybrid`) and the quality
run (`quality_run`: a store of 800 samples and the drafter trained on it). The CLI runner is tests/helpers_cli.py."""

import os
import resource

# One OpenMP thread a process, unless the caller set OMP_NUM_THREADS: the suite's models are tiny, so a second thread
# gains nothing, and its processes run side by side (three workers, commands started ahead), where threads that
# outnumber the cores spin against each other: two 2-thread tiny trainings side by side on 2 cores took 3x the CPU
# time of one alone (docs/benchmarks-log.md, "Test suite: one OpenMP thread a process"). Every command a test starts
# inherits it (pipeline.preflight.cpu_threads); in this process a serial run keeps two threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers_share import Machine, build_once, shared_root, under_xdist  # noqa: E402

_CPU_AT_START = pytest.StashKey[float]()

torch.set_num_threads(1 if under_xdist() else max(1, min(2, os.cpu_count() or 1)))


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
    ~2 MB, built once per test run."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from scripts.make_tiny_hybrid import build_tiny_hybrid

    return build_once(tmp_path_factory, "hybrid", lambda d: build_tiny_hybrid(d / "qwen3_5-tiny")) / "qwen3_5-tiny"


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> str:
    """The tiny target's store, extracted once per test run by the CLI (2 shards, 240 samples, bf16; the options
    are helpers_cli.TINY_STORE_OPTS). Shared: read it, never write it; a test that changes a store, or runs a
    command that may write into one, takes `tiny_store_copy`."""
    from helpers_cli import TINY, TINY_STORE_OPTS, dflash

    def build(d):
        r = dflash("extract", "--config", TINY, "--shards", "2", "--store", str(d / "store.zarr"), *TINY_STORE_OPTS)
        assert "finished shard(s) [0, 1]" in r.stderr and "complete" in r.stderr, r.stderr[-3000:]

    return str(build_once(tmp_path_factory, "tiny-store", build) / "store.zarr")


@pytest.fixture(scope="session")
def small_store(tmp_path_factory) -> str:
    """A one-shard store of the first 48 tiny-chat samples (bf16), extracted once per test run by the CLI, for the
    tests whose short runs need no more (before, each of their files extracted the same store itself). Shared:
    read it, never write it (training and eval only read a store)."""
    from helpers_cli import TINY, dflash

    def build(d):
        r = dflash("extract", "--config", TINY, "--shards", "1", "--store", str(d / "store.zarr"), "--set",
                   "data.max_samples=48")
        assert "complete" in r.stderr, r.stderr[-3000:]

    return str(build_once(tmp_path_factory, "small-store", build) / "store.zarr")


@pytest.fixture(scope="session")
def quality_run(tmp_path_factory):
    """(store, run): 800 tiny-chat samples extracted into one shard and the drafter trained on them for 3 epochs
    (batch 4), built once per test run for test_eval's quality test, test_sampling_eval (eval at temperature 0.7)
    and test_best_ckpt (its --init-from donor); each trained a drafter of its own before. Shared: read it, never
    change it (training and eval only read a store; eval writes its report to --out and replaces the export's
    dflash_tau.json record, which none of its readers looks at)."""
    from helpers_cli import TINY, dflash

    def build(d):
        store, run = str(d / "store.zarr"), d / "run"
        dflash("extract", "--config", TINY, "--shards", "1", "--store", store, "--set", "data.max_samples=800")
        train = ["train.batch_size=4", "train.epochs=3", "train.num_workers=0", "train.val_every=1000",
                 "train.checkpoint_every=1000"]
        dflash("train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}",
               *[x for item in train for x in ("--set", item)])

    d = build_once(tmp_path_factory, "quality", build)
    return str(d / "store.zarr"), d / "run"


@pytest.fixture
def tiny_store_copy(tiny_store, tmp_path) -> str:
    """A private copy of the shared tiny store, for a test that changes it."""
    import shutil

    dst = tmp_path / "store-copy.zarr"
    shutil.copytree(tiny_store, dst)
    return str(dst)


# Each file's time in a two-worker run (seconds, the slowest; printed at the end of every run: docs/benchmarks-log.md,
# "Test suite: one OpenMP thread a process"). Under pytest-xdist the files run slowest first, so the last file to
# finish is a short one (longest processing time first: the run then ends within about the shortest file's time of
# the other workers).
FILE_SECONDS = {
    "test_bench_parts.py": 572, "test_ops.py": 220, "test_run_expand.py": 183, "test_follow.py": 169,
    "test_best_ckpt.py": 150, "test_resume.py": 115, "test_train.py": 95, "test_extract.py": 89,
    "test_pack_bench.py": 81, "test_regenerate.py": 74, "test_resume_edges.py": 71, "test_multinode.py": 70,
    "test_recode.py": 58, "test_hybrid.py": 58, "test_run.py": 57, "test_untrusted_files.py": 56,
    "test_quiet_log.py": 54, "test_multinode_extract.py": 50, "test_store_concurrency.py": 44,
    "test_arch_sizes.py": 40, "test_regen_client.py": 38, "test_compile_count.py": 34, "test_dflash2_export.py": 31,
    "test_resume_global_batch.py": 30,
}


def pytest_configure(config):
    """Under pytest-xdist (`-n 3`, as CI runs the suite) every file runs on one worker (`--dist loadfile`: the
    module fixtures that start a file's slow commands ahead, helpers_cli.selected, need its tests together), in
    the order collected (FILE_SECONDS), not xdist's reordering by test count."""
    if getattr(config.option, "numprocesses", None) and config.option.dist in ("load", "loadfile"):
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


@pytest.fixture(scope="session")
def machine(tmp_path_factory):
    """The cores, shared by every test of every pytest-xdist worker, or held alone by one (helpers_share.Machine)."""
    m = Machine(shared_root(tmp_path_factory))
    yield m
    m.close()


@pytest.fixture(autouse=True)
def _share_the_machine(request):
    """Under pytest-xdist each test holds the machine shared, so a test that needs it alone can wait for it."""
    if not under_xdist():
        yield
        return
    with request.getfixturevalue("machine").shared():
        yield


def pytest_collection_modifyitems(config, items):
    if under_xdist():  # slowest files first (FILE_SECONDS), each file's tests in their own order
        rank = {}
        for i, item in enumerate(items):
            rank.setdefault(item.path.name, (-FILE_SECONDS.get(item.path.name, 0), i))
        items.sort(key=lambda item: rank[item.path.name])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _cpu_seconds() -> float:
    """This process's CPU time (user + system) and that of every child process it has reaped, the children's own
    reaped children included (a test's commands and their ranks, workers and servers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    item.stash[_CPU_AT_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's CPU seconds ride on its teardown report (pytest-xdist sends it to the controller): unlike its
    wall time, they do not grow when the other workers load the machine. A command a module fixture started
    ahead counts in the test that reaps it, always one of its file's; a process nobody reaps (a DDP rank its
    Lightning launcher leaves, a command killed and never waited for) does not count."""
    outcome = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        outcome.get_result().user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_AT_START]))


def pytest_terminal_summary(terminalreporter):
    """The suite's time per test file, slowest first (issue 44: a test's slowness is visible in review; the CI
    run's table goes into docs/benchmarks.md). Setup, call and teardown all count, session fixtures included in
    the file that first needed them. The CPU column (user + system, the test's commands included) is what a
    file costs the machine whatever ran beside it."""
    per_file: dict[str, float] = {}
    cpu_file: dict[str, float] = {}
    per_test: dict[str, float] = {}
    cpu_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) in ("setup", "call", "teardown") and hasattr(rep, "duration"):
                name = rep.nodeid.split("::", 1)[0]
                per_file[name] = per_file.get(name, 0.0) + rep.duration
                per_test[rep.nodeid] = per_test.get(rep.nodeid, 0.0) + rep.duration
                cpu = dict(getattr(rep, "user_properties", ()) or ()).get("cpu_s")
                if cpu is not None:
                    cpu_file[name] = cpu_file.get(name, 0.0) + cpu
                    cpu_test[rep.nodeid] = cpu
    if len(per_file) < 2:
        return
    rows = sorted(per_file.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("-", f"time per test file ({sum(per_file.values()) / 60:.1f} min in all, "
                                    f"{sum(cpu_file.values()) / 60:.1f} CPU min)")
    for name, secs in rows[:40]:
        terminalreporter.write_line(f"{secs:8.1f} s  {cpu_file.get(name, 0.0):8.1f} CPU s  {name}")
    terminalreporter.write_sep("-", "the 25 slowest tests (setup, call and teardown)")
    for name, secs in sorted(per_test.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{secs:8.1f} s  {cpu_test.get(name, 0.0):8.1f} CPU s  {name}")
