"""bench/device_run.sh's parts cannot rot (issue 31 item 5): every part is built by one function in bench/parts.py,
shared by the GPU run and its CPU smoke run; each part runs here at its tiny size (slow), and the fast tests check
the registry, the command lines and the runner."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.parts import PARTS, Ctx, Step  # noqa: E402
from bench.parts_run import run_steps, wait_detached  # noqa: E402
from helpers_cli import one_worker_per_file  # noqa: E402

# parts that need an earlier part's results in the same OUT (as bench/device_run.sh's usage lines run them)
AFTER = {"ddpopts": "e2emfu", "tau-collect": "tau-start"}
# parts whose tiny run has a test of its own that runs the same `bench.parts run --tiny PART` and checks its figures:
# the generic run below leaves them out (the suite ran each of them twice)
DEDICATED = {"fastfwd": "test_fast_forward.py", "long": "test_long_samples.py", "longdiag": "test_long_samples.py",
             "packmfu": "test_pack_bench.py", "packtau": "test_pack_bench.py", "packtests": "test_pack_bench.py",
             "handover": "test_run_expand.py", "extract35": "test_hybrid.py", "load35": "test_hybrid.py",
             "regen": "test_regenerate.py"}
# parts whose tiny run is, command line for command line, part of another part's tiny run (gpualone: gputests'
# second step on its own, a collection of the whole suite; tau: the study tau-start runs, the same command under
# `nice -n 19`, detached from a copy of the tree, its rows collected by tau-collect): the generic run leaves them
# out, a fast test checks it
SAME_AS = {"gpualone": "gputests", "tau": "tau-start"}


def _items(name: str, out: Path, tiny: bool) -> list:
    """Everything a part's run does, its side-by-side groups flattened: Steps and plain functions."""
    return [x for s in PARTS[name](Ctx(out, tiny)) for x in (s if isinstance(s, list) else [s])]


def steps_of(name: str, out: Path, tiny: bool) -> list[Step]:
    return [s for s in _items(name, out, tiny) if isinstance(s, Step)]


def _collects_only(name: str) -> bool:
    """Whether a part's tiny run is nothing but `pytest ... --collect-only` commands run where they stand (the
    parts that run GPU tests: on a machine without CUDA their tiny size collects what the GPU host runs)."""
    steps = _items(name, ROOT / "out", True)
    return bool(steps) and all(isinstance(s, Step) and s.argv[1:3] == ["-m", "pytest"] and "--collect-only" in s.argv
                               and not s.env and s.cwd == ROOT and not s.detach and not s.copy for s in steps)


# the parts the generic run below leaves to test_the_gpu_test_parts_collect_their_tests_at_the_tiny_size, which
# runs all their collections in one process (a process each cost ~4 s of CPU, imports mostly: 12 s for the suite's)
COLLECT_PARTS = sorted(p for p in PARTS if p not in AFTER.values() and p not in DEDICATED and p not in SAME_AS
                       and _collects_only(p))


def test_every_part_named_by_device_run_sh_is_in_the_registry():
    """A part added to the shell script's case (or its usage lines) instead of bench/parts.py has no smoke run."""
    text = (ROOT / "bench/device_run.sh").read_text()
    case = text[text.index("case $part in"):text.index("esac")]
    labels = set(re.findall(r"^\s+([A-Za-z0-9_-]+)\)", case, re.M))
    assert labels == {"smoke"}, f"port these parts to bench/parts.py: {sorted(labels - {'smoke'})}"
    named = {p for line in re.findall(r"device_run\.sh ([^(\n]+)", text) for p in line.split() if not p.startswith("(")}
    named -= {"smoke"}
    assert named and named <= set(PARTS), sorted(named - set(PARTS))


@pytest.mark.parametrize("tiny", [False, True])
def test_each_part_builds_commands_of_real_scripts_and_options(tiny, tmp_path):
    """Every bench script exists and declares every option its command passes; at the tiny size nothing is written
    outside OUT (the GPU size writes scratch under /tmp, results under OUT)."""
    for name in PARTS:
        steps = steps_of(name, tmp_path, tiny)
        assert steps or name == "tau-collect", name
        for s in steps:
            scripts = [a for a in s.argv if a.startswith("bench/") and a.endswith(".py")]
            for script in scripts:
                src = (ROOT / script).read_text()
                for mod in re.findall(r"^from (?:bench\.)?(\w+) import", src, re.M):  # options a helper declares
                    src += (ROOT / "bench" / f"{mod}.py").read_text() if (ROOT / "bench" / f"{mod}.py").exists() else ""
                for opt in (a.split("=")[0] for a in s.argv if a.startswith("--")):
                    assert f'"{opt}"' in src or opt in ("--collect-only",), f"{name}: {script} has no option {opt}"
            if tiny:
                for a in s.argv:
                    if a.startswith("/") and not a.startswith(sys.executable):
                        assert a.startswith(str(tmp_path)) or a.startswith(str(ROOT)), f"{name} writes {a} outside OUT"
                assert "--collect-only" in s.argv or "-m" not in s.argv or "pytest" not in s.argv


def test_tiny_and_gpu_sizes_are_the_same_command_but_for_sizes(tmp_path):
    """The tiny size changes sizes and the device, never the script or the options under test."""
    for name in ("e2emfu", "ddpopts", "trainbench", "extract35", "tinyrate"):
        gpu, tiny = steps_of(name, tmp_path, False), steps_of(name, tmp_path, True)
        assert [s.argv[1:3] for s in gpu] == [s.argv[1:3] for s in tiny], name
        assert any(g.argv != t.argv for g, t in zip(gpu, tiny)), name
    argv = steps_of("ddpopts", tmp_path, False)[0].argv
    assert "0,1@train.ddp_gradient_as_bucket_view=true@train.ddp_bucket_cap_mb=100" in argv and "--reuse" in argv


@pytest.mark.parametrize("cuda", [True, False])
def test_train_e2e_passes_every_set_on_cuda_and_cpu(cuda):
    """bench/train_e2e.py once dropped every --set when CUDA was present (`a if c else b + sets`)."""
    from bench.train_e2e import train_command

    sets = ["target.name=bench", "train.max_steps=3", "train.ddp_bucket_cap_mb=100"]
    cmd = train_command("cfg.yaml", Path("/s.zarr"), "0,1", sets, cuda)
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"] == sets
    assert cmd[cmd.index("--gpus" if cuda else "--devices") + 1] == ("0,1" if cuda else "2")
    assert cmd[:5] == [sys.executable, "-m", "stages.cli", "train", "--config"]


def test_runner_fails_a_part_on_a_failed_step_a_limit_or_a_summary_error(tmp_path, capsys):
    py = sys.executable
    ok = Step([py, "-c", "print('one'); print('two')"], "ok.log", show=1)
    assert run_steps([ok], tmp_path) == 0
    assert (tmp_path / "ok.log").read_text() == "one\ntwo\n" and capsys.readouterr().out.strip() == "two"
    assert run_steps([Step([py, "-c", "import sys; sys.exit(3)"], "bad.log")], tmp_path) == 1
    assert "FAILED (exit 3)" in capsys.readouterr().out
    slow = Step([py, "-c", "import time; time.sleep(60)"], "slow.log", timeout=1)
    assert run_steps([slow], tmp_path) == 1 and "stopped at its limit of 1 s" in capsys.readouterr().out

    def broken():
        raise ValueError("no rows")
    assert run_steps([broken], tmp_path) == 1 and "ValueError: no rows" in capsys.readouterr().err


def test_runner_copies_results_runs_groups_side_by_side_and_collects_a_detached_step(tmp_path):
    py = sys.executable
    src = tmp_path / "src.jsonl"
    writer = Step([py, "-c", f"open({str(src)!r}, 'w').write('row\\n')"], "w.log", copy=[(src, tmp_path / "dst.jsonl")])
    pair = [Step([py, "-c", f"open({str(tmp_path / f'p{i}')!r}, 'w').write('x')"], f"p{i}.log") for i in (0, 1)]
    assert run_steps([writer, pair], tmp_path) == 0
    assert (tmp_path / "dst.jsonl").read_text() == "row\n" and (tmp_path / "p0").exists() and (tmp_path / "p1").exists()
    bg = Step([py, "-c", "import time; time.sleep(1); print('bg done')"], str(tmp_path / "bg.log"), detach=True)
    assert run_steps([bg], tmp_path) == 0 and (tmp_path / "bg.log.pid").exists()
    assert wait_detached(tmp_path / "bg.log", 120) and (tmp_path / "bg.log").read_text() == "bg done\n"


def test_device_run_sh_dispatches_to_the_registry(tmp_path):
    r = subprocess.run(["bash", "bench/device_run.sh", "no-such-part"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path)}, timeout=300)
    assert "unknown part no-such-part; the parts: " in r.stdout and "e2emfu" in r.stdout, r.stdout + r.stderr


def test_parts_left_out_of_the_generic_run_have_their_own():
    for name, test_file in DEDICATED.items():
        src = (ROOT / "tests" / test_file).read_text()
        assert name in PARTS and '"bench.parts", "run", "--tiny"' in src and f'"{name}"' in src, (name, test_file)
    generic = {p for p in PARTS if p not in DEDICATED and p not in SAME_AS}  # run here, alone or before another
    for name, other in SAME_AS.items():  # the same command lines, run by the other part's tiny run
        mine, theirs = steps_of(name, ROOT / "out", True), steps_of(other, ROOT / "out", True)
        assert mine and all(s.argv in [_unniced(t.argv) for t in theirs] for s in mine), (name, other)
        assert other in generic and other not in DEDICATED and other not in SAME_AS, other


def _unniced(argv: list[str]) -> list[str]:
    """A command line without its `nice -n N` prefix (a detached study runs niced)."""
    return argv[3:] if argv[:2] == ["nice", "-n"] else argv


# A part's tiny run is mostly start-up (imports in one process at a time), so two parts run side by side on the
# suite's two cores: while a part's test waits for its run, the next selected parts start in the background as
# soon as fewer than two run. node8 starts alone (nothing beside it, nothing started before it ends) and stays
# alone until its log (OUT/node8.log) shows its next phase: its run phase needs extraction still going when
# training steps, a balance a neighbour could tip; its later phases (extraction alone, training alone) only need
# a few commits or steps, however slow.
ALONE = {"node8": ("node8.log", "=== extract")}
SIDE_BY_SIDE = 2
LIMIT_S = 1800  # one part's run, from its start


class _Run:
    """`python -m bench.parts run --tiny` of one part (after the part it needs) in its own directory: OUT is out/."""

    def __init__(self, name: str, base: Path):
        self.names = [AFTER[name], name] if name in AFTER else [name]
        self.out, self.base, self.t0 = base / "out", base, time.monotonic()
        with (base / "stdout.txt").open("w") as o, (base / "stderr.txt").open("w") as e:
            self.p = subprocess.Popen([sys.executable, "-m", "bench.parts", "run", "--tiny", *self.names], cwd=ROOT,
                                      stdout=o, stderr=e, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                      env={**os.environ, "OUT": str(self.out), "CUDA_VISIBLE_DEVICES": ""})

    def running(self) -> bool:
        return self.p.poll() is None

    def alone_part_done(self) -> bool:
        """Whether the part no longer needs the machine to itself (see ALONE): always, but for an ALONE part
        before its log's marker line or its end."""
        if self.names[-1] not in ALONE or not self.running():
            return True
        log, marker = ALONE[self.names[-1]]
        path = self.out / log
        return path.exists() and marker in path.read_text(errors="replace")

    def output(self) -> tuple[str, str]:
        return tuple((self.base / f).read_text(errors="replace") for f in ("stdout.txt", "stderr.txt"))

    def kill(self) -> None:
        if self.running():
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


@pytest.fixture(scope="module")
def part_runs():
    runs: dict[str, _Run] = {}  # started, not yet checked by their test
    yield runs
    for run in runs.values():  # started for a test that did not run (a stopped session)
        run.kill()


def _selected_parts(request) -> list[str]:
    """The parts of this function's selected tests, in order (only this one where another pytest-xdist worker may
    run the others: helpers_cli.one_worker_per_file)."""
    items = [i for i in request.session.items if getattr(i, "originalname", None) == request.node.originalname]
    if not one_worker_per_file(request.config) or request.node.nodeid not in [i.nodeid for i in items]:
        return [request.node.callspec.params["name"]]
    return [i.callspec.params["name"] for i in items]


def _start_next(runs: dict, after: list[str], factory) -> None:
    """Start the parts in `after`, in order, while fewer than SIDE_BY_SIDE run; never an ALONE part or one past it."""
    for name in after:
        if name in ALONE or sum(r.running() for r in runs.values()) >= SIDE_BY_SIDE:
            return
        if name not in runs:
            runs[name] = _Run(name, factory.mktemp(f"part-{name}"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted([p for p in PARTS if p not in AFTER.values() and p not in DEDICATED
                                         and p not in SAME_AS and p not in COLLECT_PARTS],
                                        key=lambda p: p not in ALONE))  # ALONE parts first
def test_part_runs_at_its_tiny_size_on_the_cpu(name, part_runs, request, tmp_path_factory, machine):
    """What `bash bench/device_run.sh smoke` runs, each part in its own run (two side by side, see above): exit 0
    and every --out file written. An ALONE part first waits for the other pytest-xdist workers' tests to end, and
    holds their next ones until its marker (conftest's `machine`)."""
    queue = _selected_parts(request)
    after = queue[queue.index(name) + 1:]
    if name in ALONE and not part_runs.get(name):
        machine.alone()
    run = part_runs.pop(name, None) or _Run(name, tmp_path_factory.mktemp(f"part-{name}"))
    while run.running():
        if time.monotonic() - run.t0 > LIMIT_S:
            run.kill()
            pytest.fail(f"{name}: still running after {LIMIT_S} s")
        if run.alone_part_done():
            machine.share()
            _start_next(part_runs, after, tmp_path_factory)
        time.sleep(0.5)
    machine.share()
    _start_next(part_runs, after, tmp_path_factory)
    stdout, stderr = run.output()
    assert run.p.returncode == 0, stdout[-4000:] + stderr[-2000:]
    for n in run.names:
        for s in steps_of(n, run.out, True):
            outs = [s.argv[i + 1] for i, a in enumerate(s.argv[:-1]) if a == "--out" and s.argv[i + 1].endswith(".json")]
            for o in outs:
                assert Path(o).is_file(), f"{n}: {o} not written\n{stdout[-3000:]}"
            for _src, dst in s.copy:  # a study's rows reached OUT
                assert Path(dst).exists(), f"{n}: {dst} not copied\n{stdout[-3000:]}"
    if name == "e2e":  # issue 46's start and end as train prints them for the bench (DFLASH_EXIT_STACKS)
        import json

        for r in (v for v in json.loads((run.out / "train_e2e.json").read_text()).values() if isinstance(v, dict)
                  and "rc" in v):
            assert set(r["head_thread_s"]) == {"began", "checksum", "load"}, r["head_thread_s"]
            assert list(r["end_phases_s"]) == ["final checkpoint", "Lightning teardown", "loaders", "checkpoint wait",
                                               "summary"], r["end_phases_s"]
            assert r["exit_handlers_begin_s"] is not None and r["exit_after_final_checkpoint_s"] is not None


# the child of the next test: each part's pytest arguments through pytest.main, one after the other in this one
# process (torch, conftest and the test modules imported once), its exit code and the last lines it printed
_COLLECT = r"""
import contextlib, io, json, sys
import pytest
results = []
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(args)
    results.append([int(code), out.getvalue()[-3000:]])
print("DFLASH_COLLECT " + json.dumps(results))
"""


@pytest.mark.slow
def test_the_gpu_test_parts_collect_their_tests_at_the_tiny_size(tmp_path):
    """What `bench/device_run.sh smoke` runs of the GPU-test parts (COLLECT_PARTS), each step's pytest arguments as
    the part passes them, collected in one process: every one exits 0 with at least one test collected (a
    mistyped file, test id, -m or -k expression collects nothing, or fails)."""
    steps = [(name, s) for name in COLLECT_PARTS for s in steps_of(name, tmp_path / name, True)]
    assert {"gputests", "attntests", "iscausal", "gpuleft"} <= {name for name, _ in steps}, COLLECT_PARTS
    r = subprocess.run([sys.executable, "-c", _COLLECT, json.dumps([s.argv[3:] for _, s in steps])], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and last.startswith("DFLASH_COLLECT "), (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    results = json.loads(last[len("DFLASH_COLLECT "):])
    assert len(results) == len(steps)
    for (name, s), (code, out) in zip(steps, results):
        assert code == 0 and re.search(r"\b[1-9]\d*(/\d+)? tests? collected", out), (name, s.argv, code, out)


def test_an_alone_parts_marker_is_the_line_that_starts_its_next_phase():
    """node8's marker (ALONE) is what bench/node_bench.py prints as the phase after its run phase begins."""
    from bench.node_bench import PHASES

    assert ALONE == {"node8": ("node8.log", "=== extract")}
    assert PHASES.index("extract") == PHASES.index("run") + 1
    assert 'print(f"=== {phase}", flush=True)' in (ROOT / "bench" / "node_bench.py").read_text()
    assert steps_of("node8", ROOT / "out", True)[0].log == "node8.log"


def test_fastfwd_runs_the_named_gpu_test_files_side_by_side_on_the_gpu_only(tmp_path, monkeypatch):
    """FF_TEST_FILES / FF_TEST_JOBS reach the GPU command (the device call that runs the bench and the GPU tests
    of what changed); the tiny size keeps its collection of the fast forward's tests (no pytest-xdist here)."""
    files = "tests/test_fast_forward.py tests/test_gpu_train.py tests/test_fp8_gemm.py"
    monkeypatch.setenv("FF_TEST_FILES", files)
    monkeypatch.setenv("FF_TEST_JOBS", "3")
    bench, test = steps_of("fastfwd", tmp_path, False)
    assert test.argv[test.argv.index("gpu") + 1:][:3] == files.split()
    assert test.argv[test.argv.index("-n"):][:4] == ["-n", "3", "--dist", "loadfile"]
    assert "--collect-only" not in test.argv and "--no-fp8-gemm" not in bench.argv
    tiny = steps_of("fastfwd", tmp_path, True)[1].argv
    assert "-n" not in tiny and "--collect-only" in tiny and "tests/test_gpu_train.py" not in tiny
    for f in files.split():
        assert (ROOT / f).exists(), f


def test_a_step_stopped_at_its_limit_gets_sigint_first_so_it_can_report(tmp_path):
    """pytest prints its summary on SIGINT (a SIGKILL lost the names of a cut GPU run's tests, 2026-12-01)."""
    # the step starts with SIGINT blocked (a child inherits the signal mask) and unblocks it inside the try: a
    # SIGINT that comes during a slow start (a busy machine) waits, pending, and is still the one it reports on,
    # so the limit can be short (it was 10 s, a guess at Python's start-up on a busy machine)
    code = ("try:\n    import signal, time\n    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
            "    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('summary: 3 passed', flush=True)\n"
            "    raise SystemExit(2)\n")
    step = Step([sys.executable, "-c", code], "cut.log", timeout=1)
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job (`.ci/run &`): the runner undoes it
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        assert run_steps([step], tmp_path) == 1
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, saved)
    assert "summary: 3 passed" in (tmp_path / "cut.log").read_text()


def test_gpu_test_parts_name_each_test_and_take_workers_and_a_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_TEST_JOBS", "5")
    monkeypatch.setenv("GPU_TEST_LIMIT", "560")
    step, alone = steps_of("gputests", tmp_path, False)  # the tests that start dflash on the GPU run after, alone
    assert "-v" in step.argv and step.argv[step.argv.index("-n"):][:4] == ["-n", "5", "--dist", "loadfile"]
    m = step.argv.index("-m", step.argv.index("pytest"))  # the marker expression (not python -m)
    assert step.timeout == 560 and step.argv[m + 1:m + 3] == ["gpu and not gpu_alone", "tests/"]
    assert alone.argv[m + 1:m + 3] == ["gpu and gpu_alone", "tests/"] and "-n" not in alone.argv and alone.timeout == 560
    tiny = steps_of("gputests", tmp_path, True)  # its smoke run collects both selections (part gpualone: the second)
    assert len(PARTS["gputests"](Ctx(tmp_path, True))) == 1  # side by side: only collections at the tiny size
    assert len(PARTS["gputests"](Ctx(tmp_path, False))) == 2  # on the GPU one after the other
    assert [t.argv[m + 1] for t in tiny] == ["gpu and not gpu_alone", "gpu and gpu_alone"]
    assert all("-n" not in t.argv and "--collect-only" in t.argv for t in tiny)
    monkeypatch.setenv("GPU_TEST_ALONE", "0")
    assert len(steps_of("gputests", tmp_path, False)) == 1
    monkeypatch.setenv("GPU_TEST_JOBS", "1")
    (one,) = steps_of("gputests", tmp_path, False)  # one worker: every GPU test in one run, as before
    assert one.argv[m + 1] == "gpu" and "-n" not in one.argv


def test_fastfwd_can_run_its_bench_alone_with_a_profile_and_without_fp8(tmp_path, monkeypatch):
    monkeypatch.setenv("FF_TEST_FILES", "")
    monkeypatch.setenv("FF_FP8", "0")
    monkeypatch.setenv("FF_PROFILE", "4")
    monkeypatch.setenv("FF_WRITERS", "thread,null")
    monkeypatch.setenv("FF_REF", "0")
    (bench,) = steps_of("fastfwd", tmp_path, False)
    assert "--no-fp8-gemm" in bench.argv and bench.argv[bench.argv.index("--profile-batches") + 1] == "4"
    assert bench.argv[bench.argv.index("--writers") + 1] == "thread,null" and "--no-reference" in bench.argv
    assert len(steps_of("fastfwd", tmp_path, True)) == 2  # the smoke run keeps the test collection
