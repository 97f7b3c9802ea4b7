"""Checkpoints off the training's critical path (issue 31 item 2): `dflash train`'s Lightning CheckpointIO.

Contract:
- A save copies the checkpoint to host memory (into pinned buffers on CUDA, reused by the next save; they are
  pinned in a background thread when training starts, beside the first batch's compile, so the first save does
  not pay for pinning) and returns; a background thread writes that copy. Training waits only for the copy,
  and a second save for the first one's write (never more than one write in flight). Each written checkpoint
  logs one line: how long training waited, how long the write took behind it.
- Every write is atomic: a temporary file next to the target, fsync, rename, fsync of the directory. A crash or
  an error during a write leaves the previous file as it was; a write error is raised by the next save or wait.
- What must follow a write (ModelCheckpoint's `last.ckpt` link to the new step file, the removal of the step
  file it replaces) runs after the rename (`after_write`), so `last.ckpt` always names a complete file; after a
  failed write it never runs (the previous checkpoint and its link stay). `LinkAfterWrite` also holds the removal
  of the replaced step file until `last.ckpt` names the new one (a kill between the two leaves both files and a
  link to the new one, never a dangling link: issue 40), and never makes Lightning's versioned names
  (`last-v1.ckpt`, `step6-v1.ckpt`): a resumed run's link is `last.ckpt`, replaced in one rename.
- Loading (`--resume`) goes through pipeline.ckpt_io: weights_only with dflash's allow-list, whatever Lightning
  asks for, so a planted last.ckpt cannot run code. A write that fails with OSError (a full disk) names its file
  (`e.filename`), which pipeline.preflight's one-line disk message reads.
- `supersede()` gives up the write in flight because the next save replaces it (the final checkpoint): its file is
  never put in place, its link is not made (last.ckpt keeps naming the previous complete checkpoint), and the
  removals it held run once the next write is in place (after a failed one, never).
- `wait()` returns once the last write is in place (the end of fit, before an export reads the checkpoint and
  before the process exits; Lightning's teardown calls it too).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from pipeline import store as st
from pipeline.ckpt_io import relink, safe_checkpoint_io_class


_CRC_LOCK = threading.Lock()


class _NoCrc32:
    """torch.save without the CRC32 of each zip record, for the duration of one write (issue 46 item 3): on the
    H200 host an 8 GiB checkpoint wrote at 0.93 GB/s without it against 0.67 with it, leaving the main thread the
    same share of the GIL (bench part ckptwrite, docs/benchmarks-log.md). torch.load reads either (the records'
    CRC is not what protects a checkpoint here: the atomic rename is). The setting is torch's, process-wide, so
    it is set and restored under a lock; a torch without it writes as before."""

    def __enter__(self):
        _CRC_LOCK.acquire()
        get = getattr(torch.serialization, "get_crc32_options", None)
        self.before = get() if get is not None else None
        if self.before is not None:
            torch.serialization.set_crc32_options(False)

    def __exit__(self, *exc):
        try:
            if self.before is not None:
                torch.serialization.set_crc32_options(self.before)
        finally:
            _CRC_LOCK.release()


class Superseded(Exception):
    """A write given up because a newer checkpoint replaces it (`AsyncCheckpointIO.supersede`)."""


class _Stoppable:
    """The file torch.save streams into, refusing the next write once `stop` is set (the write then unwinds)."""

    def __init__(self, f, stop: threading.Event):
        self.f, self.stop = f, stop

    def write(self, b) -> int:
        if self.stop.is_set():
            raise Superseded()
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def write_atomic(obj, path: Path, stop: threading.Event | None = None) -> None:
    """torch.save to a temporary file beside `path`, fsync, rename into place, fsync the directory. `stop` set
    during the write: `Superseded` is raised and nothing replaces `path` (the temporary file is removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f, _NoCrc32():
            torch.save(obj, f if stop is None else _Stoppable(f, stop))  # streams: no second in-memory copy
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Superseded:
        raise
    except BaseException as e:
        if stop is not None and stop.is_set():  # torch.save's zip writer wraps the refusal in its own error
            raise Superseded() from e
        if isinstance(e, OSError):
            e.filename = e.filename or str(path)  # which file the full disk refused (pipeline.preflight)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)


def fast_pinning() -> bool:
    """Pin host memory with cudaHostRegister over several threads instead of one cudaHostAlloc per buffer (torch's
    `pinned_use_cuda_host_register`): the first checkpoint pins ~21 GB at the 27B shape, which cost training a 15 s
    stall on the H200 (2026-12-01) in one thread. A setting of torch's host allocator only (same buffers, same
    bytes); False where this torch has no such setting (then pinning stays as it was)."""
    opts = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    for name in ("torch._C._accelerator_setAllocatorSettings", "torch.cuda.memory._set_allocator_settings"):
        mod, _, fn = name.rpartition(".")
        try:
            getattr(__import__(mod, fromlist=[fn]), fn)(opts)
            return True
        except (AttributeError, ImportError, RuntimeError, TypeError, ValueError):
            continue
    return False


class HostCopy:
    """Copies a checkpoint's tensors to host memory; on CUDA into pinned buffers kept for the next save.

    The buffers are a pool keyed by (shape, dtype), each taken once per save (the order of the checkpoint's
    tensors does not matter). `reserve` pins the pool for tensors the first save will hold in a background
    thread (issue 31: the first save pinned ~21 GB at the 27B shape, a 4.5 s stall even with fast pinning);
    a save waits for that thread, then allocates whatever the reservation did not foresee. `device_types`:
    whose tensors go to the pool (tests use "cpu" with pin=False)."""

    def __init__(self, device_types: tuple = ("cuda",), pin: bool = True):
        self.pool: dict[tuple, list[torch.Tensor]] = {}
        self.device_types, self.pin = device_types, pin
        self._reserving: threading.Thread | None = None
        self.reserved = 0  # buffers the reservation made (tests and the log read it)

    def reserve(self, specs: list[tuple[tuple, torch.dtype]]) -> None:
        """Pin buffers for `specs` [(shape, dtype)] in a background thread (the first save waits for it)."""
        def run():
            if self.pin:
                fast_pinning()  # before the first pinned buffer: the allocator reads it once
            for shape, dtype in specs:
                self.pool.setdefault((tuple(shape), dtype), []).append(self._alloc(shape, dtype))
                self.reserved += 1

        self._reserving = threading.Thread(target=run, name="dflash-pin", daemon=True)
        self._reserving.start()

    def join(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _alloc(self, shape, dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.pin)

    def __call__(self, obj):
        self.join()
        self.taken: dict[tuple, int] = {}
        self.cuda = False
        out = self._copy(obj)
        if self.cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        return out

    def _copy(self, obj):
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, dict):  # (OrderedDict state dicts keep their type)
            return type(obj)((k, self._copy(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self._copy(v) for v in obj)
        if isinstance(obj, np.ndarray):
            return obj.copy()
        return obj  # numbers, strings, config objects: not changed by the steps that follow

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type not in self.device_types:
            return t.clone()  # the next step changes parameters and optimizer state in place
        self.cuda = self.cuda or t.device.type == "cuda"
        key = (tuple(t.shape), t.dtype)
        bufs, j = self.pool.setdefault(key, []), self.taken.get(key, 0)
        self.taken[key] = j + 1
        if j == len(bufs):  # not foreseen (or no reservation): allocated now, kept for the next save
            if self.pin and not any(self.pool.values()):
                fast_pinning()
            bufs.append(self._alloc(t.shape, t.dtype))
        return bufs[j].copy_(t, non_blocking=True)


def checkpoint_specs(module: torch.nn.Module, device_type: str = "cuda",
                     step_on_device: bool = False) -> list[tuple[tuple, torch.dtype]]:
    """The device tensors a training checkpoint of `module` holds, as (shape, dtype): its state dict's, and two
    moments per trainable parameter (AdamW's exp_avg and exp_avg_sq), plus its fp32 step scalar where the
    optimizer keeps it on the device (`step_on_device`: fused AdamW; foreach keeps it on the CPU)."""
    specs = [(tuple(t.shape), t.dtype) for t in module.state_dict().values()
             if isinstance(t, torch.Tensor) and t.device.type == device_type]
    moments = [(tuple(p.shape), p.dtype) for p in module.parameters()
               if p.requires_grad and p.device.type == device_type]
    steps = [((), torch.float32)] * len(moments) if step_on_device else []
    return specs + moments + moments + steps


class AsyncCheckpointIO(safe_checkpoint_io_class(TorchCheckpointIO)):  # loads: weights_only, always
    """See the module contract. `log`: where the per-checkpoint line goes (stderr)."""

    def __init__(self, log: Callable[[str], None] | None = None):
        super().__init__()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-checkpoint")
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self._after: list[tuple[str, Callable[[], None]]] = []  # (kind, action) for the write in flight
        self._deferred: list[Callable[[], None]] = []  # a superseded write's removals: after the next write
        self._writing = False  # a write is in flight and has not yet taken its after_write actions
        self._stop: threading.Event | None = None  # set to give up the write in flight (supersede)
        self._copy = HostCopy()
        self.reserve = self._copy.reserve  # pin the first save's buffers early (stages/train_task.on_train_start)
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.stalls: list[float] = []  # training's wait per save, in seconds (tests and benches read it)

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        t0 = time.perf_counter()
        self.wait()  # a second save waits for the first one's write, and only for it
        if not st.is_local(str(path)):
            return super().save_checkpoint(checkpoint, path, storage_options)
        waited = time.perf_counter() - t0
        host = self._copy(checkpoint)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        path = Path(str(path).removeprefix("file://"))
        with self._lock:
            self._writing, self._stop = True, threading.Event()
            self._pending = self._pool.submit(self._write, host, path, stall, waited, self._stop)

    def _write(self, host, path: Path, stall: float, waited: float, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            write_atomic(host, path, stop)
        except Superseded:  # its link would name a file that is not there; its removals wait for the next write
            with self._lock:
                after, self._after, self._writing = self._after, [], False
                self._deferred += [fn for kind, fn in after if kind == "remove"]
            self.log(f"train: checkpoint {path.name} given up after {time.perf_counter() - t0:.1f} s: the final "
                     "checkpoint replaces it")
            return
        except BaseException:
            with self._lock:
                self._after, self._writing, self._deferred = [], False, []
            raise
        with self._lock:
            after, self._after, self._writing = self._after, [], False
            deferred, self._deferred = self._deferred, []
        for _, fn in after:
            fn()
        for fn in deferred:
            fn()
        prior = f" ({waited:.2f} s of it for the previous write)" if waited >= 0.01 else ""
        self.log(f"train: checkpoint {path.name} written: training waited {stall:.2f} s{prior} to copy it to host "
                 f"memory; the write behind it took {time.perf_counter() - t0:.1f} s")

    def supersede(self) -> bool:
        """Give up the write in flight, if any, because the next save replaces it (the final checkpoint at the end
        of a fit: at the 27B shape waiting for the last step checkpoint's write cost 16.5 s before the final one's
        own, issue 46). Its file is never put in place and its last.ckpt link is not made (last.ckpt keeps
        naming the previous checkpoint); the removals it held run after the next write is in place. -> whether a
        write was in flight."""
        with self._lock:
            if not self._writing or self._stop is None:
                return False
            self._stop.set()
            return True

    def after_write(self, fn: Callable[[], None], kind: str = "link") -> None:
        """Run `fn` once the write in flight is in place (now when there is none). When that write failed (it
        can fail before Lightning asks for what follows it: a disk already full), `fn` is dropped: the link and
        the removal it stands for follow a file that is not there, and the previous checkpoint stays named by
        last.ckpt (the write's error is raised by the next save or wait)."""
        with self._lock:
            if self._writing:
                self._after.append((kind, fn))
                return
            pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            return
        fn()

    def remove_checkpoint(self, path) -> None:
        self.after_write(lambda: super(AsyncCheckpointIO, self).remove_checkpoint(path), kind="remove")

    def wait(self) -> None:
        """Until the last write is in place (or given up); raises its error, if it failed."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def teardown(self) -> None:
        self.wait()


class LinkAfterWrite(ModelCheckpoint):
    """ModelCheckpoint whose `last.ckpt` link is made once the step file it names is written (AsyncCheckpointIO),
    so that a crash during a write leaves the link on the previous, complete checkpoint; the step file the new one
    replaces is removed only after the link moved (see the module contract). No versioned names: a resume from
    the first checkpoint (whose state has no last_model_path) would otherwise link `last-v1.ckpt` and leave
    `last.ckpt` naming the removed step file."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, enable_version_counter=False, **kwargs)
        self._held: list[str] = []  # step files to remove once last.ckpt names their successor
        self._holding = False

    def _save_topk_checkpoint(self, trainer, monitor_candidates) -> None:
        self._holding = True
        try:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
        finally:
            self._holding = False

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        if self._holding:
            self._held.append(filepath)
        else:
            super()._remove_checkpoint(trainer, filepath)

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)  # the link (after the write), then the removals
        held, self._held = self._held, []
        for f in held:
            super()._remove_checkpoint(trainer, f)

    def _link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:
        io = trainer.strategy.checkpoint_io
        if trainer.is_global_zero and isinstance(io, AsyncCheckpointIO):
            io.after_write(lambda: relink(filepath, linkpath))
            trainer.strategy.barrier()
        else:
            super()._link_checkpoint(trainer, filepath, linkpath)


def wait_for_checkpoints(trainer, sync: bool = False) -> None:
    """The last checkpoint write is in place (a no-op for another CheckpointIO). `sync`: then a barrier, so that
    every rank sees what rank 0 wrote (its last.ckpt link): a decision taken on each rank from the files on disk
    (stages/progress.save_final) is the same on all of them. Every rank must call it with sync."""
    io = getattr(trainer.strategy, "checkpoint_io", None)
    if isinstance(io, AsyncCheckpointIO):
        io.wait()
    if sync and trainer.world_size > 1:
        trainer.strategy.barrier()
