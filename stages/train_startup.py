"""`dflash train`'s start-up, measured: each phase's seconds from the process's start to the end of the first
batch, printed as one line when start-up is over (issue 31 item 1; stages/progress.py prints it).

Torch-free and Lightning-free, so that the launcher can start timing before the heavy imports. The phases are
those of stages/train.run_train in order (names without commas: benches parse the line):
launch and imports (interpreter, CLI, torch, config), store checks, Lightning imports (and the training
module's), compile cache and loaders, drafter (built on its device), trainer, compile imports (Inductor's, in a
run that compiles), frozen-head check wait (what the thread that checks the head and loads it onto the device had
left), fit set-up (other ranks started, compile settings, optimizer, a resume's restore),
first batch (its loading and compiling).

Two phases are broken down further, each in a line of its own printed with the start-up line (issue 46: the
remaining causes of the warm first batch): a second `StartupPhases` splits fit set-up at Lightning's hooks (its
environment and setup hooks; model, optimizer and a resume's restore up to on_fit_start; the training module's
on_fit_start: the frozen head to the device, the compile set-up; a sanity check; the loops and loaders up to
on_train_start), and `compile_summary` splits the first batch's compile time by dynamo's own
timers (torch._dynamo.utils.compile_times: tracing, the backend and its cache loads, guards). `thread_line` says
what the frozen head's thread did and when (its checksum, the CUDA start, the load onto the GPU).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc), else now: the start of the user's wait."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


_begun: float | None = None


def begin() -> None:
    """An in-process caller (`dflash demo`, after its other stages) starts training's start-up clock now."""
    global _begun
    _begun = time.time()


class StartupPhases:
    """`mark(name)` ends the phase called `name` (it began where the last one ended, the first at the process's
    start, or at `started`); `line()` is the start-up line: the total and each phase's seconds. Also the parts of
    one phase (fit set-up's: `line(where, "fit set-up")`)."""

    def __init__(self, started: float | None = None):
        self.t = started if started is not None else _begun if _begun is not None else process_start_time()
        self.phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self.phases.append((name, max(0.0, now - self.t)))
        self.t = now

    def took(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (a hook of the module, which runs inside another phase): counted here, and no
        longer in the phase that holds it."""
        self.phases.append((name, max(0.0, seconds)))
        self.t += max(0.0, seconds)

    def line(self, where: str = "", phase: str = "start-up") -> str:
        """`train: PHASE T s: name s, ...` (phase_text's format)."""
        return phase_text(phase, where, sum(s for _, s in self.phases), self.phases)


def phase_text(phase: str, where: str, total: float, parts: list) -> str:
    """`train: PHASE{where} T s: name s, ...`: the one format of the start-up, fit set-up, frozen-head thread and end
    lines (names without commas, numbers to 0.1 s); `read_phase_text` reads it back (benches parse these lines)."""
    return f"train: {phase}{where} {total:.1f} s: " + ", ".join(f"{n} {s:.1f}" for n, s in parts)


def read_phase_text(line: str, phase: str) -> dict | None:
    """{name: seconds} of a `phase_text` line for PHASE (any rank's), else None."""
    m = re.match(rf"train: {re.escape(phase)}(?: on rank \d+)? [0-9.]+ s: (.*)", line)
    if not m:
        return None
    return {p.rsplit(" ", 1)[0]: float(p.rsplit(" ", 1)[1]) for p in m.group(1).split(", ")}


def thread_line(timeline: list[tuple[str, float]], started: float, where: str = "") -> str | None:
    """`train: frozen-head thread{where} T s: began B, checksum s, CUDA start s, load s` from the check's thread's
    timeline (pipeline/provenance.HEAD_THREAD: ("began", wall time) then (step, seconds)); B counts from the
    process's start, so the line shows which start-up phases the thread ran beside. None before it began."""
    if not timeline or timeline[0][0] != "began":
        return None
    steps = timeline[1:]
    return phase_text("frozen-head thread", where, sum(s for _, s in steps),
                      [("began", max(0.0, timeline[0][1] - started))] + steps)


# dynamo's timers (torch._dynamo.utils.compile_times) -> the names the line gives them; nested timers overlap
COMPILE_TIMERS = (("_compile.compile_inner", "dynamo in all"), ("bytecode_tracing", "tracing"),
                  ("OutputGraph.call_user_compiler", "backend"), ("fx_codegen_and_compile", "inductor"),
                  ("PyCodeCache.load_by_key_path", "kernel loads"), ("async_compile.wait", "kernel compiles"),
                  ("build_guards", "guards"))


def compile_summary(times: dict[str, list[float]], frames: int | None = None, where: str = "") -> str:
    """One line of the compile time so far from dynamo's timers ({name: [seconds, ...]}, as
    `torch._dynamo.utils.compile_times(repr="csv")` gives them): the time under each of COMPILE_TIMERS present,
    in seconds (nested: tracing and the backend are parts of dynamo's total, inductor a part of the backend)."""
    parts = [f"{label} {sum(times[key]):.1f}" for key, label in COMPILE_TIMERS if key in times]
    head = f"train: compiles so far{where}" + (f" ({frames} frames)" if frames is not None else "")
    return f"{head}: " + (", ".join(parts) if parts else "none")


def dynamo_times() -> tuple[dict[str, list[float]], int | None]:
    """(dynamo's timers {name: [seconds per call]}, frames compiled) in this process; empty before any compile."""
    import torch._dynamo.utils as du

    names, values = du.compile_times(repr="csv")
    times = {n: [float(v) for v in str(vs).split(",") if v.strip()] for n, vs in zip(names, values)}
    frames = du.counters.get("stats", {}).get("unique_graphs")
    return times, (int(frames) if frames is not None else None)
