"""`dflash train`'s start-up, measured: each phase's seconds from the process's start to the end of the first
batch, printed as one line when start-up is over (issue 31 item 1; stages/progress.py prints it).

Torch-free and Lightning-free, so that the launcher can start timing before the heavy imports. The phases are
those of stages/train.run_train in order (names without commas: benches parse the line):
launch and imports (interpreter, CLI, torch, config), store checks, Lightning imports (and the training
module's), compile cache and loaders, drafter (built on its device), trainer, frozen-head check wait (what the
checksum thread had left), fit set-up (other ranks started, compile settings, optimizer, a resume's restore),
first batch (its loading and compiling).
"""

from __future__ import annotations

import os
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
    start); `line()` is the start-up line: the total and each phase's seconds."""

    def __init__(self, started: float | None = None):
        self.t = started if started is not None else _begun if _begun is not None else process_start_time()
        self.phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self.phases.append((name, max(0.0, now - self.t)))
        self.t = now

    def line(self, where: str = "") -> str:
        total = sum(s for _, s in self.phases)
        return f"train: start-up{where} {total:.1f} s: " + ", ".join(f"{n} {s:.1f}" for n, s in self.phases)
