"""pipeline/lifecycle.py's `Supervisor`, the one supervisor of child processes (extract's and regenerate's
workers, `dflash run`'s two commands), on tiny Python children: the first failure stops the others and is
named with its exit code, a second Ctrl-C kills, signals forwarded to process groups, the named exit codes;
and the helpers its callers share (log tail, rates, shard placement)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.lifecycle import (ExitCode, Outcome, PlacementError, Supervisor, failure_reason, fmt_eta, fmt_rate,
                                place_shards, tail)

from helpers_cli import HANG_S  # noqa: E402

# a worker as extract's and regenerate's are: says it is ready, then works until told to stop; SIGTERM makes it
# finish "its batch" and exit 143 (StopFlag's contract)
WORKER = """
import signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
while not stop:
    time.sleep(0.05)
sys.exit(143)
"""
FAILS = """
import os, sys, time
print("ready", flush=True)
while not os.path.exists({go!r}):  # the test says go once the others are ready (their SIGTERM handlers in place)
    time.sleep(0.05)
print("the reason it failed", file=sys.stderr)
sys.exit(3)
"""
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker stuck in a long step
print("ready", flush=True)
time.sleep(600)
"""


def _spawn(sup: Supervisor, tmp_path: Path, name, code: str, ready: list | None = None, **kw):
    def on_line(line: str) -> None:
        if line.strip() == "ready" and ready is not None:
            ready.append(name)

    return sup.spawn(name, [sys.executable, "-c", code], log=tmp_path / f"{name}.log", on_line=on_line, **kw)


def _when(condition, then) -> threading.Thread:
    """Run `then()` on a thread once `condition()` holds (a hang guard only: no assertion depends on speed)."""
    def wait():
        deadline = time.time() + HANG_S
        while not condition() and time.time() < deadline:
            time.sleep(0.05)
        then()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def test_exit_codes_are_named():
    named = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.STOPPED, ExitCode.WORKER_STOPPED)
    assert named == (0, 1, 2, 130, 143)
    assert f"exit {ExitCode.STOPPED}" == "exit 130"  # messages print the number
    assert Outcome({0: 0, 1: 0}).exit_code == ExitCode.OK
    assert Outcome({0: 1, 1: 143}, failed=0).exit_code == ExitCode.FAILED
    assert Outcome({0: 143, 1: -9}, stops=2).exit_code == ExitCode.STOPPED
    assert Outcome({0: 0, 1: 130}, stops=0).exit_code == ExitCode.STOPPED  # not a failure once classified so


def test_first_failure_stops_the_others_and_is_reported_with_its_exit_code(tmp_path):
    sup = Supervisor(signals="terminate", quiet=(ExitCode.OK, ExitCode.WORKER_STOPPED))
    ready: list = []
    for i in range(2):
        _spawn(sup, tmp_path, i, WORKER, ready)
    go = tmp_path / "go"
    _spawn(sup, tmp_path, 2, FAILS.format(go=str(go)))
    ticks = []
    _when(lambda: len(ready) == 2, go.touch)  # the failure comes once both workers would stop on SIGTERM (143)
    end = sup.watch(tick=lambda: ticks.append(1))
    # 143: each worker was stopped when the failure came (a worker never ends by itself)
    assert end.failed == 2 and end.codes == {0: 143, 1: 143, 2: 3} and end.stops == 0, end
    assert end.exit_code == ExitCode.FAILED and ticks
    log = (tmp_path / "2.log").read_text()
    assert log.startswith("\n=== ") and sys.executable in log.splitlines()[1]  # the command heads its output
    assert failure_reason(end.codes[2], tmp_path / "2.log").endswith(" | the reason it failed")  # its log's tail
    assert failure_reason(-9, tmp_path / "2.log") == "killed by signal 9"
    assert failure_reason(1, tmp_path / "2.log", "ValueError: bad row") == "ValueError: bad row"


def test_a_worker_that_stopped_unasked_does_not_stop_the_others_but_fails_the_run(tmp_path):
    """143 while running (someone SIGTERMed one worker) is quiet: the others go on; at the end it was not a stop
    this process asked for, so the run failed, naming it."""
    sup = Supervisor(signals="terminate", quiet=(ExitCode.OK, ExitCode.WORKER_STOPPED))
    _spawn(sup, tmp_path, 0, "import sys; sys.exit(143)")
    _spawn(sup, tmp_path, 1, "import time; time.sleep(1.5)")
    end = sup.watch()
    assert end.codes == {0: 143, 1: 0} and end.failed == 0 and end.exit_code == ExitCode.FAILED


def test_ctrl_c_stops_every_worker_and_a_second_one_kills(tmp_path):
    sup = Supervisor(signals="terminate", quiet=(ExitCode.OK, ExitCode.WORKER_STOPPED))
    ready: list = []
    stops: list = []
    sup.on_stop = lambda n, signum: stops.append((n, signum))
    _spawn(sup, tmp_path, "polite", WORKER, ready)
    _spawn(sup, tmp_path, "stuck", STUBBORN, ready)

    def press_twice():
        signal.raise_signal(signal.SIGINT)  # the first: SIGTERM to both; "polite" commits and leaves
        deadline = time.time() + HANG_S
        while sup.children["polite"].proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        signal.raise_signal(signal.SIGINT)  # the second: SIGKILL to what is left

    old = signal.getsignal(signal.SIGINT)
    watching: list = []  # its first tick: the supervisor's handlers are in place
    presser = _when(lambda: len(ready) == 2 and watching, press_twice)
    end = sup.watch(tick=lambda: watching.append(1))
    presser.join()
    assert signal.getsignal(signal.SIGINT) is old  # put back after watching
    assert end.codes == {"polite": 143, "stuck": -signal.SIGKILL} and end.failed is None and end.stops == 2, end
    assert end.exit_code == ExitCode.STOPPED and stops == [(1, signal.SIGINT), (2, signal.SIGINT)]


def test_forwarding_passes_each_ctrl_c_to_each_childs_process_group(tmp_path):
    """`dflash run`'s mode: children in process groups of their own get every Ctrl-C as SIGINT (their own rules
    then stop, and on the second press force, them), with SIGINT at its default even where the parent ignores
    it; a child ending other than 0 or 130 after the stop failed."""
    child = """
import signal, sys, time
presses = []
signal.signal(signal.SIGINT, lambda *_: presses.append(1))
print("ready", flush=True)
said = False
while len(presses) < 2:
    if presses and not said:  # the test presses again only then: two presses before the handler ran count as one
        print("pressed once", flush=True)
        said = True
    time.sleep(0.05)
sys.exit(130 if sys.argv[1] == "clean" else 1)
"""
    sup = Supervisor(signals="forward", quiet=(ExitCode.OK,), stop_codes=(ExitCode.STOPPED,))
    for name in ("clean", "messy"):
        sup.spawn(name, [sys.executable, "-c", child, name], log=tmp_path / f"{name}.log", own_group=True)
    default = [sys.executable, "-c",  # Python installs its handler only over a SIGINT that is not ignored
               "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's background job inherits it
    try:
        sup.spawn("probe", default, log=tmp_path / "probe.log", own_group=True)
    finally:
        signal.signal(signal.SIGINT, old)

    def said(line: str) -> bool:  # the children's output goes to their logs (no on_line), under a header that
        #                            quotes their code: a line of its own, not a substring, is what they said
        return all(line in (tmp_path / f"{n}.log").read_text().splitlines() for n in ("clean", "messy"))

    def press_twice():
        signal.raise_signal(signal.SIGINT)
        deadline = time.time() + HANG_S  # a hang guard: the second press comes once each child counted the first
        while time.time() < deadline and not said("pressed once"):
            time.sleep(0.05)
        signal.raise_signal(signal.SIGINT)

    watching: list = []
    presser = _when(lambda: watching and said("ready"), press_twice)
    end = sup.watch(tick=lambda: watching.append(1))
    presser.join()
    assert (tmp_path / "probe.log").read_text().splitlines()[-1] == "True"
    assert end.codes == {"clean": 130, "messy": 1, "probe": 0} and end.stops == 2, end
    assert end.failed == "messy" and end.exit_code == ExitCode.FAILED


def test_on_failure_replaces_stopping_the_others(tmp_path):
    """`dflash run`: a failed training lets the extraction go on; on_failure runs once, for the first failure."""
    seen = []
    sup = Supervisor(signals="forward", quiet=(ExitCode.OK,), stop_codes=(ExitCode.STOPPED,),
                     on_failure=lambda name, rc: seen.append((name, rc)))
    sup.spawn("train", [sys.executable, "-c", "import sys; sys.exit(1)"], log=tmp_path / "t.log", own_group=True)
    sup.spawn("extract", [sys.executable, "-c", "import time; time.sleep(1.5)"], log=tmp_path / "x.log", own_group=True)
    end = sup.watch()
    assert seen == [("train", 1)] and end.codes == {"train": 1, "extract": 0} and end.failed == "train"


def test_stop_all_after_an_error_in_the_parent_leaves_no_child(tmp_path):
    sup = Supervisor(grace=0.5)
    ready: list = []
    procs = [_spawn(sup, tmp_path, i, code, ready) for i, code in enumerate((WORKER, STUBBORN))]
    _when(lambda: len(ready) == 2, lambda: None).join()  # both have their signal handlers
    sup.stop_all()
    assert [p.poll() for p in procs] == [143, -signal.SIGKILL]
    sup.stop_all()  # idempotent: what a caller's `finally` runs


def test_helpers_the_supervisors_share(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("one\n\ntwo\nthree\n\n")
    assert tail(log, 2) == "two | three" and tail(log) == "one | two | three"
    assert tail(tmp_path / "none.log") == "(no log)"
    assert fmt_rate(950) == "950" and fmt_rate(12345) == "12.3K"
    assert fmt_eta(None) == "?" and fmt_eta(75) == "1m15s" and fmt_eta(7300) == "2h01m"


def test_shard_placement_takes_a_parsed_shard_set():
    """`dflash extract --shard-index 4-7` on a GPU machine: the parent hands the parsed set to the placement
    (before, it was parsed a second time as the text "[4, 5, 6, 7]" and refused)."""
    assert place_shards(None, 8, 4, [4, 5, 6, 7]) == {4: 0, 5: 1, 6: 2, 7: 3}
    assert place_shards([2], 8, 4, [5]) == {5: 2}
    assert place_shards(None, 2, 0) == {}
    with pytest.raises(PlacementError, match="needs 5 GPUs"):
        place_shards([0, 1], 5, 8)

    class OwnError(Exception):
        pass

    with pytest.raises(OwnError, match="this process sees no CUDA GPU"):  # each stage raises its own error
        place_shards([0], 2, 0, error=OwnError)
