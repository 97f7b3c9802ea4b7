"""What a torch.profiler trace says about the GPU: which of its CUDA events are real device work, and how long the
GPU was busy. One owner for both the training profile (stages/train_profile.py) and the extraction profile
(bench/fastfwd_bench.py).

Contract:
- `device_work(events)`: the kernels and copies among `prof.events()`; never the GPU spans of user annotations
  (`Optimizer.step#AdamW.step`, `## Call CompiledFxGraph ... ##`, `record_function` ranges), which cover every
  kernel queued inside them and the GPU's backlog before those (on the H200, 2026-12-01, the optimizer's span read
  240 ms a step and made "other" a quarter of the GPU time), nor the host's synchronisations that the profiler
  draws on the GPU's timeline (`SYNC_EVENTS`).
- `union_us(intervals)`: the length of the union of [start, end) intervals, so work overlapping on two streams is
  counted once; wall time minus it is the time the GPU had nothing to do.
- `is_copy(name)`: a memcpy/memset event (the copy engines), as opposed to a kernel (the SMs).
"""

from __future__ import annotations

import torch


SYNC_EVENTS = ("Event Sync", "Stream Sync", "Device Sync", "Context Sync")  # the host's waits, drawn on the GPU's
# timeline when the profiler records them (enable_cuda_sync_events): on the H200 (2026-12-02) they made "other"
# half the extraction window's device time and hid its idle gaps


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def device_work(events) -> list:
    """The kernels and copies among a profile's events (see the module docstring)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if getattr(e, "device_type", None) == cuda and not getattr(e, "is_user_annotation", False)
            and "#" not in e.name and e.name not in SYNC_EVENTS]


def is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))
