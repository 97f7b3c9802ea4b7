"""Long-run operations on CPU: SIGTERM to `dflash extract` stops every process and the rerun resumes; kill -9 of
the parent makes its workers exit instead of running on as orphans; `dflash status` reads a run's state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zarr

from pipeline import store as st
from pipeline.store_reader import StoreReader

from helpers_cli import FEW_ANCHORS, HANG_S, Lazy, selected  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
OPTS = ["--set", "data.max_samples=150", "--set", "extract.token_budget=512"]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _as_foreground_job() -> None:
    """Run the child as a terminal's foreground job would: a shell starting a background job (CI runners,
    `cmd &`) sets SIGINT to ignored, and ignored signals are inherited; a terminal job gets the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(store, **popen):
    return subprocess.Popen([sys.executable, "-m", "stages.cli", "extract", "--config", TINY, "--shards", "2",
                             "--store", store, *OPTS], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _start_training(store, run, *extra, **popen):
    """`dflash train` on 2 CPU ranks for a long schedule (the test stops it); 8 anchor blocks a sample
    (helpers_cli.FEW_ANCHORS): the tests prove signals and processes, not learning."""
    return subprocess.Popen([sys.executable, "-m", "stages.cli", "train", "--config", TINY, "--store", store,
                             "--devices", "2", "--set", f"train.run_dir={run}", "--set", "train.epochs=50",
                             *FEW_ANCHORS, *extra, "--no-export"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            **popen)


def _press_ctrl_c(p, presses: int, gap: float, timeout: float) -> tuple[int, str]:
    """Ctrl-C from a terminal: SIGINT to the whole foreground group, `presses` times; -> (exit code, stderr)."""
    for i in range(presses):
        if i:
            time.sleep(gap)
        os.killpg(p.pid, signal.SIGINT)
    rc = p.wait(timeout=timeout)
    return rc, p.stderr.read()


def _wait_until(condition, timeout=HANG_S):  # a hang guard only: no assertion depends on speed
    deadline = time.time() + timeout
    while time.time() < deadline and not condition():
        time.sleep(0.5)


def _run_processes(run, timeout=0.0) -> list[str]:
    """PIDs of processes of this run still alive, after waiting up to `timeout` s for them to go."""
    def alive():
        return subprocess.run(["pgrep", "-f", f"train.run_dir={run}"], capture_output=True, text=True).stdout.split()
    _wait_until(lambda: not alive(), timeout)
    return alive()


def _wait_commits(store, n=2, timeout=HANG_S):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            root = zarr.open_group(store, mode="r")
            if all(dict(root[st.shard_name(i)].attrs).get("progress", {}).get("committed_batches", 0) >= n
                   for i in range(2)):
                return
        except Exception:  # noqa: BLE001 - not created yet
            pass
        time.sleep(0.1)
    raise AssertionError("extraction made no progress")


def _workers(store):
    out = subprocess.run(["pgrep", "-f", f"extract_worker.*{store}"], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _gone(store, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline and _workers(store):
        time.sleep(0.1)
    return not _workers(store)


def _finish_and_verify(store):
    r = subprocess.run([sys.executable, "-m", "stages.cli", "extract", "--config", TINY, "--shards", "2", "--store",
                        store, *OPTS], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    reader = StoreReader(store)
    assert len(reader.samples) == 150 and len({s.sample_id for s in reader.samples}) == 150


def _sigterm_extraction(tmp_path: Path) -> None:
    """The next test, whole: its assertions are raised where it takes the result."""
    store = str(tmp_path / "s.zarr")
    p = _start(store)
    _wait_commits(store)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=HANG_S)  # a hang guard: that it stopped before the end is what `status` says below
    err = p.stderr.read()
    assert rc == 130
    assert "resume with the same command" in err
    assert _gone(store, HANG_S)  # its workers went with it (each commits its batch first)
    s = subprocess.run([sys.executable, "-m", "stages.cli", "status", store], cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert s.returncode == 0 and "stopped" in s.stdout and "shard 0" in s.stdout
    _finish_and_verify(store)


@pytest.mark.slow
def test_sigterm_stops_everything_and_rerun_resumes(ops_runs):
    """SIGTERM to `dflash extract`: 130, the resume hint, no worker left, `status` says stopped, and the rerun
    completes a valid store. (Run ahead beside the other signal tests: ops_runs; _sigterm_extraction holds its
    steps and assertions.)"""
    ops_runs[("test_sigterm_stops_everything_and_rerun_resumes", None)].result()


def _kill9_extraction(tmp_path: Path) -> None:
    """The next test, whole: its assertions are raised where it takes the result."""
    store = str(tmp_path / "s.zarr")
    p = _start(store)
    _wait_commits(store)
    assert _workers(store)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert _gone(store, HANG_S), "workers kept running after their parent was killed"  # (a hang guard)
    s = subprocess.run([sys.executable, "-m", "stages.cli", "status", store], cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert "process gone" in s.stdout or "stopped" in s.stdout
    _finish_and_verify(store)


@pytest.mark.slow
def test_parent_kill9_leaves_no_orphans(ops_runs):
    """kill -9 of `dflash extract`: its workers exit instead of running on, `status` says so, and the rerun
    completes a valid store. (Run ahead: ops_runs; _kill9_extraction holds its steps and assertions.)"""
    ops_runs[("test_parent_kill9_leaves_no_orphans", None)].result()


@pytest.mark.slow
def test_training_sigterm_stops_all_ranks_with_resume_hint(tiny_store, tmp_path):
    store = tiny_store  # the session's store (tests/conftest.py): training only reads it
    run = tmp_path / "run"
    p = _start_training(store, run, "--set", "train.log_every=2", "--set", "train.checkpoint_every=4",
                        stderr=subprocess.PIPE, text=True)
    _wait_until(lambda: list((run / "checkpoints").glob("step*.ckpt")))
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=HANG_S)
    err = p.stderr.read()
    print(err)  # whole, in a failure report
    assert rc == 130 and "--resume" in err and "stopped at step" in err
    left = _run_processes(run, timeout=HANG_S)  # returns once none is left: a hang guard, not a speed bound
    assert not left, f"processes left behind: {left}"
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert (run / "logs" / "rank0.log").exists() and (run / "logs" / "rank1.log").exists()


@pytest.mark.slow
def test_training_parent_kill9_leaves_no_orphans(tiny_store, tmp_path):
    store = tiny_store  # the session's store (tests/conftest.py): training only reads it
    run = tmp_path / "run"
    p = _start_training(store, run, stderr=subprocess.DEVNULL)
    _wait_until((run / "progress.json").exists)
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = _run_processes(run, timeout=HANG_S)  # returns once none is left: a hang guard
    assert not left, f"ranks kept running after the launcher was killed: {left}"
    assert (store and (Path(store) / "logs" / "extract.log").exists())


def test_second_ctrl_c_forces_while_lightning_shuts_down(tmp_path):
    """Lightning ignores SIGINT during its graceful shutdown; our callback restores a handler that exits 130 at
    once. Run the real hook order (Lightning sets SIG_IGN, then calls on_exception) in a process that then
    hangs as a stuck teardown would, and press Ctrl-C."""
    code = """
import signal, sys, time
from stages.train_stop import ForceOnSecondCtrlC
signal.signal(signal.SIGINT, signal.SIG_IGN)          # what Lightning does on the first KeyboardInterrupt
ForceOnSecondCtrlC().on_exception(None, None, KeyboardInterrupt())
print("tearing down", flush=True)
time.sleep(60)                                          # a teardown waiting on a rank
"""
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_as_foreground_job)
    assert p.stdout.readline().strip() == "tearing down"
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=HANG_S)
    err = p.stderr.read()
    # forced: an unforced exit waits out the teardown and returns 0, never 130 (no clock: a busy machine is slow)
    assert rc == 130
    assert "press Ctrl-C again to force" in err and "forced stop" in err


@pytest.mark.slow  # a launcher and its rank, two processes (and a 1.5 s wait)
def test_second_ctrl_c_in_a_rank_waits_for_its_launcher(tmp_path):
    """A rank Lightning started must not leave before its launcher on a second Ctrl-C: Lightning's process
    observer in the launcher SIGKILLs every process when a rank exits non-zero, so the job ended with -9
    instead of 130 (a CI failure of the 2-press test above). The rank stays while the launcher lives and
    exits at once when it is gone."""
    rank = """
import os, signal, sys, time
os.environ["LOCAL_RANK"] = "1"
from stages.train_stop import ForceOnSecondCtrlC
cb = ForceOnSecondCtrlC()                               # created at start-up: remembers the launcher
signal.signal(signal.SIGINT, signal.SIG_IGN)          # what Lightning does on the first KeyboardInterrupt
cb.on_exception(None, None, KeyboardInterrupt())
print(os.getpid(), flush=True)
time.sleep(60)                                          # a teardown waiting on a collective
"""
    launcher = f"""
import subprocess, sys, time
r = subprocess.Popen([sys.executable, "-c", {rank!r}], stdout=subprocess.PIPE, text=True)
print(r.stdout.readline().strip(), flush=True)
time.sleep(60)                                          # the launcher, still shutting down
"""
    p = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid = int(p.stdout.readline())
    os.kill(pid, signal.SIGINT)  # the second Ctrl-C reaches the rank
    time.sleep(1.5)
    assert _running(pid), "the rank left first"
    p.kill()  # the launcher goes (forced exit, or the end of its graceful stop)
    p.wait()
    _wait_until(lambda: not _running(pid), timeout=45)  # at once, i.e. well before its 60 s teardown ends
    assert not _running(pid), _proc_status(pid)


def test_an_error_after_a_stop_request_is_the_stop(monkeypatch):
    """After Ctrl-C a rank can leave `fit` with another error than Lightning's SystemExit: a collective the other
    rank left ("Connection closed by peer"), a loader worker the same Ctrl-C killed. That is the stop (exit 130
    with the resume hint), not a failure: CI saw `dflash train` exit 1 there. Without a stop request the same
    error is a failure."""
    from types import SimpleNamespace

    from stages.train_stop import StopRequest, stopped_by_user

    monkeypatch.setattr(StopRequest, "reason", None)
    running, interrupted = SimpleNamespace(interrupted=False), SimpleNamespace(interrupted=True)
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert not stopped_by_user(gloo, running)
    assert not stopped_by_user(SystemExit(1), running)
    assert stopped_by_user(SystemExit(1), interrupted)  # Lightning's own graceful stop
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        StopRequest.install()
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C still interrupts, as Python's own handler does
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert StopRequest.reason == "Ctrl-C"
        assert stopped_by_user(gloo, running) and stopped_by_user(SystemExit(1), running)
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture(scope="module")
def ops_runs(request, tmp_path_factory):
    """(test name, its parameter or None) -> a future of that test's processes (AHEAD: the function, called with
    its own directory, the session's store when it trains, and its parameter). The selected tests of AHEAD start
    at the first one's setup, two at a time, each in its own thread: a case is mostly its processes' start-up
    (imports, one core at a time) and waits, which leaves a core to the other. Each test takes its own result
    (an assertion that failed in its thread is raised there)."""
    pool, items = ThreadPoolExecutor(max_workers=2), selected(request, *AHEAD)
    # the session's store (tests/conftest.py; training only reads it), when a selected test trains
    store = request.getfixturevalue("tiny_store") if any(AHEAD[i.originalname][1] for i in items) else None

    def make(key):
        name, param = key
        fn, trains = AHEAD[name]
        tmp = tmp_path_factory.mktemp(f"{fn.__name__}-{param}")
        args = [*([store or request.getfixturevalue("tiny_store")] if trains else []),
                *([] if param is None else [param])]
        return pool.submit(fn, tmp, *args)
    runs = Lazy(make)
    for item in items:
        params = list(item.callspec.params.values()) if hasattr(item, "callspec") else [None]
        runs[(item.originalname, params[0])]
    yield runs
    pool.shutdown(wait=True)


def _ctrl_c_training(tmp_path: Path, store: str, presses: int) -> tuple:
    """The next test's processes: a 2-rank training (its own session, SIGINT at its default) given Ctrl-C
    `presses` times, once its first checkpoint is in (one press) or once it steps (two); -> (exit code, stderr,
    the run's processes still alive once none is left or the hang guard ends)."""
    run = tmp_path / "run"
    p = _start_training(store, run, "--set", "train.checkpoint_every=20", stderr=subprocess.PIPE, text=True,
                        start_new_session=True, preexec_fn=_as_foreground_job)
    # one press promises a resume point: wait for the first checkpoint (before it, the stop says there is nothing
    # to resume, tests/test_follow_stop.py); CI's Ctrl-C once landed at step 10, before the first checkpoint
    _wait_until((run / "checkpoints" / "last.ckpt").exists if presses == 1 else (run / "progress.json").exists)
    rc, err = _press_ctrl_c(p, presses, gap=0.3, timeout=HANG_S)
    return rc, err, _run_processes(run, timeout=HANG_S)  # returns once none is left: a hang guard, not a speed bound


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_training_ctrl_c_to_the_group_stops_cleanly(tiny_store, ops_runs, presses):
    """Ctrl-C from a terminal (SIGINT to the launcher, its ranks and their loader workers): once -> graceful stop
    with the resume hint; twice -> immediate exit. Either way 130 and nothing left running. (Run ahead:
    ops_runs.)"""
    rc, err, left = ops_runs[("test_training_ctrl_c_to_the_group_stops_cleanly", presses)].result()
    print(err)  # whole, in the failure report (an assertion message is cut in the middle)
    assert rc == 130, f"exit {rc}"
    if presses == 1:
        assert "resume with" in err and "--resume" in err
    assert not left, f"processes left behind: {left}"


def _ctrl_c_extraction(tmp_path: Path, presses: int) -> None:
    """The next test, whole: its assertions are raised where it takes the result."""
    store = str(tmp_path / "s.zarr")
    p = _start(store, start_new_session=True, preexec_fn=_as_foreground_job)
    _wait_commits(store)
    rc, err = _press_ctrl_c(p, presses, gap=0.05, timeout=HANG_S)
    assert rc == 130, err
    assert "resume with the same command" in err
    assert _gone(store, HANG_S)  # (a hang guard: each worker commits its batch first, slow on a busy machine)
    _finish_and_verify(store)


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_extract_ctrl_c_to_the_group(ops_runs, presses):
    """Ctrl-C from a terminal reaches the parent and its workers: once -> workers stop after their commit; twice
    -> the parent kills them. Either way 130, no worker left, and the rerun completes a valid store. (Run ahead:
    ops_runs; _ctrl_c_extraction holds the test's steps and assertions.)"""
    ops_runs[("test_extract_ctrl_c_to_the_group", presses)].result()


def _running(pid) -> bool:
    """Alive and not a zombie (an exited process whose parent has not reaped it yet)."""
    status = _proc_status(pid)
    return status != "gone" and "State=Z" not in status


def _proc_status(pid) -> str:
    try:
        st = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        return " ".join(f"{k}={st[k].strip()}" for k in ("Name", "State", "PPid", "Threads") if k in st)
    except OSError:
        return "gone"


def _ppid(pid) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_training_kill9_leaves_no_loader_workers(tiny_store, tmp_path, devices):
    """SIGKILL (the OOM killer) of a one-process `dflash train`: its DataLoader workers must not run on: a
    worker that outlives the reader of its result pipe can block for good at exit (it holds both
    ends of the pipe, so the write never fails)."""
    store = tiny_store  # the session's store (tests/conftest.py): training only reads it
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "stages.cli", "train", "--config", TINY, "--store", store,
                          "--set", f"train.run_dir={run}", "--set", "train.epochs=50", "--set", "train.num_workers=2",
                          "--devices", str(devices), "--no-export"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    _wait_until((run / "progress.json").exists)

    def children(pid):  # all descendants
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        return [d for c in out for d in (int(c), *children(int(c)))]

    def running(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are gone
        except OSError:
            return False

    def cmdline(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            return ""

    def processes():  # -> (all descendants, the loader workers among them)
        kids = children(p.pid)
        servers = {k for k in kids if "forkserver" in cmdline(k) and "forkserver" not in cmdline(_ppid(k))}
        return kids, [k for k in kids if "spawn_main" in cmdline(k) or _ppid(k) in servers]  # data/loader_workers

    # every rank's loader is up: polled (a hang guard only), not a fixed sleep a busy machine could outrun
    _wait_until(lambda: p.poll() is not None or len(processes()[1]) >= 2 * devices)
    kids, workers = processes()
    assert len(workers) >= 2 * devices, kids  # each rank's loader workers (besides servers and resource trackers)
    p.send_signal(signal.SIGKILL)
    p.wait()
    _wait_until(lambda: not any(running(k) for k in kids))  # a just-spawned worker may still import
    left = [k for k in kids if running(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    assert not left, f"processes kept running after the training process was killed: {left}: " + "; ".join(
        f"{k} {_proc_status(k)} {cmdline(k)[:100]}" for k in left)


# the tests whose processes run ahead, two at a time (ops_runs): test name -> (the function of its processes,
# whether it trains on the session's store); a parametrized test's cases each their own
AHEAD = {"test_sigterm_stops_everything_and_rerun_resumes": (_sigterm_extraction, False),
         "test_parent_kill9_leaves_no_orphans": (_kill9_extraction, False),
         "test_training_ctrl_c_to_the_group_stops_cleanly": (_ctrl_c_training, True),
         "test_extract_ctrl_c_to_the_group": (_ctrl_c_extraction, False)}
