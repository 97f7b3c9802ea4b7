"""Where a training step's wall time goes: `train.profile_steps = [first, last)` profiles those optimizer steps.

Contract:
- `StepProfile` (a Lightning callback; every rank) starts torch.profiler (CPU, and CUDA when training runs on
  a GPU) at the first micro-batch of optimizer step `first`, and stops it when step `last` is reached. The
  window's wall time per optimizer step is then split into:
  - GPU busy: the union of the kernel and memcpy intervals on this rank's GPU (overlapping streams counted once);
  - GPU idle: the rest of the wall time. This is the gap between the bench step and end to end (loader waits,
    optimizer and logging on the host, synchronisations);
  - GPU time by kernel family (GEMM, flex/Triton, NCCL, elementwise, copies, other) and the top kernels;
  - the host ops with the most self time (the data loader's `__next__`, `optimizer.step`, backward, ...).
- It writes RUN/logs/profile-rank{R}.json (the figures) and .txt (the same as tables) and prints one line.
  A window that training never reaches writes nothing. Profiling slows the steps it covers, so keep it out of
  a window whose rate is measured. Nothing here changes what is trained.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning as L
import torch

from pipeline.gpu_trace import device_work, union_us

FAMILIES = (  # (family, name fragments), first match wins; kernel names of torch 2.1x on H100/H200
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
    ("flex/triton", ("flex", "triton_")),
    ("copies", ("memcpy", "memset", "copy", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ("reductions", ("reduce", "softmax", "norm")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, parts in FAMILIES if any(p in low for p in parts)), "other")


def summarise(prof, steps: int, wall_s: float, cuda: bool, top: int = 12) -> dict:
    """The figures of one profiled window (see the module docstring)."""
    out: dict = {"steps": steps, "wall_ms_per_step": 1e3 * wall_s / max(1, steps)}
    events = prof.events()
    if cuda:
        dev = device_work(events)
        busy_us = union_us([(e.time_range.start, e.time_range.end) for e in dev])
        out["gpu_busy_ms_per_step"] = busy_us / 1e3 / max(1, steps)
        out["gpu_idle_fraction"] = max(0.0, 1.0 - busy_us / 1e6 / wall_s) if wall_s > 0 else None
        fams: dict[str, float] = {}
        kernels: dict[str, float] = {}
        for e in dev:
            us = e.time_range.end - e.time_range.start
            fams[family(e.name)] = fams.get(family(e.name), 0.0) + us
            kernels[e.name] = kernels.get(e.name, 0.0) + us
        total = sum(fams.values()) or 1.0
        out["gpu_families"] = {k: {"ms_per_step": v / 1e3 / max(1, steps), "share": v / total}
                               for k, v in sorted(fams.items(), key=lambda kv: -kv[1])}
        out["top_kernels"] = [{"name": k[:120], "ms_per_step": v / 1e3 / max(1, steps)}
                              for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]]
    avgs = prof.key_averages()
    host = sorted(avgs, key=lambda a: -a.self_cpu_time_total)[:top]
    out["top_host_ops"] = [{"name": a.key[:120], "self_ms_per_step": a.self_cpu_time_total / 1e3 / max(1, steps),
                            "calls": a.count} for a in host]
    # the named ranges around the ops (the loader's __next__, Optimizer.step, Lightning's hooks): what the host
    # was doing while the GPU idled, by total time
    ranges = [a for a in avgs if not a.key.startswith(("aten::", "cuda", "cudnn", "void ", "Memcpy", "Memset"))]
    out["top_ranges"] = [{"name": a.key[:120], "ms_per_step": a.cpu_time_total / 1e3 / max(1, steps), "calls": a.count}
                         for a in sorted(ranges, key=lambda a: -a.cpu_time_total)[:top]]
    return out


def as_text(s: dict, first: int, last: int) -> str:
    lines = [f"optimizer steps {first}-{last - 1}: {s['wall_ms_per_step']:.1f} ms wall per step"]
    if "gpu_busy_ms_per_step" in s:
        lines.append(f"GPU busy {s['gpu_busy_ms_per_step']:.1f} ms per step, idle {100 * s['gpu_idle_fraction']:.1f}% "
                     "of the wall time")
        lines += ["", "| kernel family | ms / step | share |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['ms_per_step']:.1f} | {100 * v['share']:.1f}% |" for k, v in s["gpu_families"].items()]
        lines += ["", "| kernel | ms / step |", "| --- | --- |"]
        lines += [f"| `{k['name']}` | {k['ms_per_step']:.2f} |" for k in s["top_kernels"]]
    lines += ["", "| host range | ms / step | calls |", "| --- | --- | --- |"]
    lines += [f"| `{h['name']}` | {h['ms_per_step']:.2f} | {h['calls']} |" for h in s["top_ranges"]]
    lines += ["", "| host op | self ms / step | calls |", "| --- | --- | --- |"]
    lines += [f"| `{h['name']}` | {h['self_ms_per_step']:.2f} | {h['calls']} |" for h in s["top_host_ops"]]
    return "\n".join(lines) + "\n"


class StepProfile(L.Callback):
    def __init__(self, first: int, last: int, logs_dir: Path, cuda: bool):
        self.first, self.last, self.logs, self.cuda = first, last, Path(logs_dir), cuda
        self.prof = None
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.prof is None and not self.done and trainer.global_step >= self.first:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if self.cuda:
                torch.cuda.synchronize()
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.t0, self.step0 = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.prof is not None and trainer.global_step >= self.last:
            self._finish(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.prof is not None:  # the run ended inside the window: what it covered
            self._finish(trainer)

    def _finish(self, trainer) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        steps = trainer.global_step - self.step0
        s = summarise(self.prof, steps, wall, self.cuda)
        self.prof, self.done = None, True
        rank = trainer.global_rank
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.logs / f"profile-rank{rank}.json").write_text(json.dumps(s, indent=1))
        (self.logs / f"profile-rank{rank}.txt").write_text(as_text(s, self.step0, self.step0 + steps))
        busy = (f", GPU idle {100 * s['gpu_idle_fraction']:.1f}%" if s.get("gpu_idle_fraction") is not None else "")
        if rank == 0:
            print(f"train: profiled steps {self.step0}-{self.step0 + steps - 1}: {s['wall_ms_per_step']:.1f} ms per "
                  f"step{busy}; {self.logs / 'profile-rank0.txt'}", file=sys.stderr, flush=True)
