"""Extraction's inner loop: forward each batch, encode its features on the GPU, copy them to pinned host memory on
a side stream and write them on a writer thread, all overlapped (`pipelined_extract`).

Contract:
- batches yields (meta, input_ids [B, S] long CPU right-padded, lengths [B]). on_batch(meta, parts {name: np
  [T, ...]} (pipeline.encoding), bad np.bool_ [B]) runs on the writer thread, in batch order, with the tokens of
  samples whose features are not finite already removed (bad marks them). At most queue_depth batches wait for
  the writer; an error on the writer thread stops the loop and is raised by it.
- No host-device synchronisation of its own between two forwards on CUDA, so the host queues the next batch while
  the GPU still runs the last one and a writer thread holding the GIL for a moment does not leave the GPU idle:
  the inputs go up from pinned memory, and which rows of the [B, S] batch are real tokens (and whose sample each
  is) is worked out on the host from `lengths`, never with a boolean mask on the device (its size would need a
  sync). A batch without padding is run without an attention mask: the forward is the same (transformers drops
  an all-ones mask after checking it on the device, a sync) and the GDN layers skip the masking pass.
- `LoopStats` (returned): seconds the host waited for the writer with the queue full (the writer is the
  bottleneck when this grows), seconds the writer was busy (writing, not waiting for a copy), batches. The profiler sees the named ranges
  `extract.forward`, `extract.encode`, `extract.queue` and `extract.write` (bench/fastfwd_bench.py profiles them).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from pipeline.encoding import encode, to_storage
from pipeline.target import FeatureCapture, capture_features


@dataclass
class LoopStats:
    batches: int = 0
    queue_wait_s: float = 0.0  # the host blocked on a full queue: waiting for the writer
    writer_busy_s: float = 0.0  # the writer thread inside to_storage + on_batch
    copy_wait_s: float = 0.0  # the writer thread waiting for a batch's device-to-host copy (the GPU still on it)
    wall_s: float = 0.0


def token_rows(lengths: list[int], S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [T], sample [T]) for a right-padded [B, S] batch: the flat index b * S + s of each real token, samples
    back to back in batch order, and the batch row each token belongs to. Computed on the host (CPU long)."""
    lens = torch.as_tensor(lengths, dtype=torch.long)  # [B]
    sample = torch.repeat_interleave(torch.arange(len(lengths)), lens)  # [T]
    first = torch.cumsum(lens, 0) - lens  # [B] the first flat token of each sample
    pos = torch.arange(int(lens.sum())) - first[sample]  # [T] position inside its sample
    return sample * S + pos, sample


def pipelined_extract(model, capture: FeatureCapture, encoding: str, device: torch.device, batches, on_batch,
                      queue_depth: int = 3, should_stop=lambda: False) -> LoopStats:
    """Forward each batch and hand its features to `on_batch` on a writer thread, overlapped (the module's
    contract). The conductor: the writer thread (`_write_loop`), then per batch its GPU side (`_gpu_batch`) and
    its hand-over to the writer (`_hand_over`); at the end the writer drained and its first error raised."""
    cuda = device.type == "cuda"
    q: queue.Queue = queue.Queue(maxsize=max(1, queue_depth))
    errors: list[BaseException] = []
    stats = LoopStats()

    def up(t: torch.Tensor) -> torch.Tensor:  # host -> device without a sync (pinned source on CUDA)
        return t.pin_memory().to(device, non_blocking=True) if cuda else t.to(device)

    thread = threading.Thread(target=_write_loop, kwargs=dict(q=q, errors=errors, stats=stats, on_batch=on_batch),
                              name="store-writer", daemon=True)
    thread.start()
    side = torch.cuda.Stream() if cuda else None
    start = time.perf_counter()
    try:
        for meta, ids, lens in batches:
            if should_stop() or errors:
                break
            item = _gpu_batch(model=model, capture=capture, encoding=encoding, device=device, up=up, side=side,
                              meta=meta, ids=ids, lens=lens)
            _hand_over(q=q, item=item, stats=stats)
    finally:
        q.put(None)
        thread.join()
        stats.wall_s = time.perf_counter() - start
    if errors:
        raise errors[0]
    return stats


def _write_loop(*, q: queue.Queue, errors: list[BaseException], stats: LoopStats, on_batch) -> None:
    """The writer thread: for each queued item until None, wait for its device-to-host copy (if any), turn its parts
    into storage arrays, drop the tokens of its non-finite samples and call `on_batch`. After an error (kept in
    `errors` for the main thread) it only drains the queue. Adds its waits and busy time to `stats`."""
    while True:
        item = q.get()
        if item is None:
            return
        if errors:
            continue
        t0 = time.perf_counter()
        try:
            meta, lens, event, parts, bad = item
            if event is not None:
                event.synchronize()
                stats.copy_wait_s += time.perf_counter() - t0
                t0 = time.perf_counter()
            with record_function("extract.write"):
                arrays = {k: to_storage(v) for k, v in parts.items()}
                bad = bad.numpy()
                if bad.any():  # rare: drop the samples whose features are not finite
                    keep_tok = np.repeat(~bad, np.asarray(lens))
                    arrays = {k: v[keep_tok] for k, v in arrays.items()}
                on_batch(meta, arrays, bad)
        except BaseException as e:  # noqa: BLE001 - surfaced by the main thread
            errors.append(e)
        stats.writer_busy_s += time.perf_counter() - t0


def _gpu_batch(*, model, capture: FeatureCapture, encoding: str, device: torch.device, up, side, meta,
               ids: torch.Tensor, lens) -> tuple:
    """One batch's GPU side, queued with no host-device sync: the forward (a mask only for a padded batch), the
    real tokens' features gathered (rows from `token_rows`, on the host) and encoded, the samples holding a NaN/Inf
    feature flagged, and on CUDA (`side` a stream) the copy to pinned host memory (`_copy_to_host`). `up` uploads a
    host tensor. -> the writer's item (meta, lens, copy event or None, parts, bad)."""
    B, S = ids.shape
    lens = [int(n) for n in lens]
    rows, sample = token_rows(lens, S)
    with record_function("extract.forward"):
        att = None
        if min(lens) < S:  # padded: the mask, built on the device from the lengths
            att = (torch.arange(S, device=device)[None, :] < up(torch.tensor(lens))[:, None]).long()
        feats = capture_features(model, capture, up(ids), att)  # [B, S, L, H]
    with record_function("extract.encode"):
        flat = feats.flatten(0, 1).index_select(0, up(rows))  # [T, L, H], samples back to back
        del feats
        tok_ok = torch.isfinite(flat).flatten(1).all(dim=1)  # [T]
        bad = torch.zeros(B, dtype=torch.int32, device=device).index_add_(
            0, up(sample), (~tok_ok).to(torch.int32)) > 0  # [B] sample has a NaN/Inf feature
        parts = encode(flat, encoding)
        del flat
        if side is not None:
            return _copy_to_host(side=side, meta=meta, lens=lens, parts=parts, bad=bad)
        return (meta, lens, None, parts, bad)


def _copy_to_host(*, side: torch.cuda.Stream, meta, lens: list[int], parts: dict[str, torch.Tensor],
                  bad: torch.Tensor) -> tuple:
    """Copy a batch's encoded parts and its bad-sample flags into fresh pinned host memory on the side stream,
    after the work queued so far and without a sync (the device tensors are kept for the side stream until the
    copy is done). -> the writer's item, with the event that marks the copy done."""
    done = torch.cuda.Event()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host = {}
        for k, t in parts.items():
            host[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host[k].copy_(t, non_blocking=True)
        host_b = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
        host_b.copy_(bad, non_blocking=True)
        done.record(side)
    for t in (*parts.values(), bad):
        t.record_stream(side)
    return (meta, lens, done, host, host_b)


def _hand_over(*, q: queue.Queue, item: tuple, stats: LoopStats) -> None:
    """Queue a batch's item for the writer, blocking while the queue is full (that wait is added to `stats`), and
    count the batch."""
    t0 = time.perf_counter()
    with record_function("extract.queue"):
        q.put(item)
    stats.queue_wait_s += time.perf_counter() - t0
    stats.batches += 1
