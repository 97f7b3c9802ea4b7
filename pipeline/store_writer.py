"""The shard writer: the one writer of a shard group (one per extract worker, and the recode), keeping the
store's write rules of pipeline/store.py's contract: it holds the shard's lock (pipeline/store_lock.py) or adopts
its parent's, checks before each write that it still holds it and that the on-disk progress record is the one it
last committed, grows and never shrinks its arrays (trimmed to the committed rows when the shard finishes), and
commits a batch by writing its chunks first and then the checksummed progress record in one metadata write.
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from pipeline.encoding import part_names, parts_spec
from pipeline.errors import StoreError
from pipeline.store import (INTEGRITY_ATTR, PROGRESS_SHA, SAMPLE_ARRAYS, SAMPLE_CHUNK, Progress, chunk_codecs, digest,
                            partial_files, read_bytes, read_progress, shard_name, zarr_module)
from pipeline.store_lock import ShardLock


def _this_command() -> str:
    import shlex
    import sys

    return shlex.join(sys.argv)


class ShardWriter:
    """Appends committed batches to one shard group; the only writer of that group (it holds the shard's lock).

    `lock_token`: the lock a parent process took for this one (`dflash extract` passes it to its workers);
    without it the writer takes the lock itself. Use as a context manager, or call `close()`/`finish()`."""

    def __init__(self, path: str, shard_index: int, root_attrs: dict, lock_token: Optional[str] = None,
                 command: str = ""):
        self.path, self.index = path, shard_index
        self._own_lock = lock_token is None
        self.lock = (ShardLock.acquire(path, shard_index, command or _this_command()) if self._own_lock
                     else ShardLock.adopt(path, shard_index, lock_token))
        try:
            self._open(root_attrs)
        except BaseException:
            self.close()
            raise

    def _open(self, root_attrs: dict) -> None:
        zarr = zarr_module()
        path, shard_index = self.path, self.index
        self.encoding = root_attrs["encoding"]
        L, H = len(root_attrs["layer_ids"]), root_attrs["target"]["hidden_size"]
        chunk = int(root_attrs["chunk_tokens"])
        clevel = int(root_attrs.get("clevel", 3))
        root = zarr.open_group(path, mode="a")
        self.integrity = INTEGRITY_ATTR in dict(root.attrs)
        # stale temporary files of a killed writer: this process holds the lock, so none of them is live
        self.removed_partials = 0
        for f in partial_files(path, shard_name(shard_index)):
            f.unlink(missing_ok=True)
            self.removed_partials += 1
        g = root.require_group(shard_name(shard_index))
        specs = {
            "tokens": ((0,), (chunk * 16,), "int32"),
            "loss_mask": ((0,), (chunk * 16,), "uint8"),
            "sample_start": ((0,), (SAMPLE_CHUNK,), "int64"),
            "sample_length": ((0,), (SAMPLE_CHUNK,), "int32"),
            "sample_id": ((0,), (SAMPLE_CHUNK,), "uint64"),
            "split": ((0,), (SAMPLE_CHUNK,), "uint8"),
        }
        for name, (shape, dtype) in parts_spec(self.encoding, L, H).items():
            rows = chunk if name == "features" else chunk * 4  # small parts: fewer, larger chunks
            specs[name] = ((0, *shape), (rows, *shape), dtype)
        self.parts = part_names(self.encoding)
        self.arrays = {}
        existing = set(g.array_keys())
        every = {"write_empty_chunks": True}  # an absent chunk must mean damage, never "all zeros"
        for name, (shape, chunks, dtype) in specs.items():
            if name in existing:
                self.arrays[name] = g[name].with_config(every)
            else:
                size = np.dtype(dtype).itemsize
                self.arrays[name] = g.create_array(
                    name, shape=shape, chunks=chunks, dtype=dtype, compressors=chunk_codecs(size, clevel), fill_value=0,
                    config=every,
                )
        self.group = g
        self.progress = read_progress(path, shard_index, dict(g.attrs), self.integrity)

    def start(self, plan_fingerprint: str, planned_samples: int, planned_tokens: int,
              validation_batches: int = -1) -> Progress:
        """Record the shard's batch plan; refuse to resume a shard that was planned differently.
        `validation_batches`: how many leading batches of the plan hold the validation samples (a training run
        that follows the growing store reads the validation split once they are committed)."""
        p = self.progress
        if p.plan_fingerprint and p.plan_fingerprint != plan_fingerprint:
            raise StoreError(
                f"shard {self.index} of {self.path} was started with a different batch plan (extract.token_budget "
                "or extract.max_batch_size changed since); rerun with the values that started it"
            )
        fresh = not p.every_chunk and p.committed_batches == 0  # all its rows will be written by this writer
        if not p.plan_fingerprint or fresh:
            self._check_owner()
            p.plan_fingerprint, p.planned_samples, p.planned_tokens = plan_fingerprint, planned_samples, planned_tokens
            p.every_chunk = p.every_chunk or fresh
            p.validation_batches = validation_batches
            self._commit()
        return p

    def write_batch(
        self,
        sample_ids: np.ndarray,  # uint64 [n]
        splits: np.ndarray,  # uint8 [n]
        lengths: np.ndarray,  # int32 [n]
        tokens: np.ndarray,  # int32 [T]
        loss_mask: np.ndarray,  # uint8 [T]
        parts: dict[str, np.ndarray],  # the encoding's parts, each [T, ...] (features, scales, outliers)
        nonfinite_skipped: int = 0,
    ) -> Progress:
        """Write one batch after the last commit, then commit it. Safe to kill at any point."""
        p = self.progress
        if p.done:
            raise StoreError(f"shard {self.index} of {self.path} is finished; nothing more is written to it")
        self._check_owner()
        n, T = len(sample_ids), len(tokens)
        t0, s0 = p.committed_tokens, p.committed_samples
        if T:
            missing = set(self.parts) - set(parts)
            if missing:
                raise StoreError(f"batch for shard {self.index} lacks the {sorted(missing)} part(s) of encoding {self.encoding}")
            for name, data in [("tokens", tokens), ("loss_mask", loss_mask)] + [(k, parts[k]) for k in self.parts]:
                self._grow(name, t0 + T)[t0 : t0 + T] = data
        if n:
            starts = t0 + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64)
            for name, data in (("sample_start", starts), ("sample_length", lengths.astype(np.int32)),
                               ("sample_id", sample_ids.astype(np.uint64)), ("split", splits.astype(np.uint8))):
                self._grow(name, s0 + n)[s0 : s0 + n] = data
        p.committed_batches += 1
        p.committed_samples += n
        p.committed_tokens += T
        p.nonfinite_skipped += nonfinite_skipped
        self._commit()
        return p

    def _grow(self, name: str, rows: int):
        """The array, resized up to at least `rows` rows. Never down: rows past the commit may belong to a
        batch being rewritten, and shrinking once deleted another writer's newer chunks."""
        arr = self.arrays[name]
        if arr.shape[0] < rows:
            arr.resize((rows,) + arr.shape[1:])
        return arr

    def finish(self) -> Progress:
        """Mark the shard done: arrays trimmed to exactly the committed rows, then the commit; lock released."""
        self._check_owner()
        p = self.progress
        for name, arr in self.arrays.items():
            rows = p.committed_samples if name in SAMPLE_ARRAYS else p.committed_tokens
            if arr.shape[0] > rows:  # garbage of an interrupted batch past the commit; never below it
                arr.resize((rows,) + arr.shape[1:])
        p.done = True
        self._commit()
        self.close()
        return p

    def close(self) -> None:
        """Release the shard's lock (if this writer took it). Committed work stays; a rerun resumes after it."""
        if self._own_lock:
            self.lock.release()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_owner(self) -> None:
        """Stop before writing if another process took the lock or committed to this shard since our last commit."""
        self.lock.check()
        raw = read_bytes(f"{str(self.path).rstrip('/')}/{shard_name(self.index)}/zarr.json")
        disk = Progress.from_attrs(json.loads(raw).get("attributes", {}))
        if disk.committed() != self.progress.committed():
            raise StoreError(
                f"shard {self.index} of {self.path} was changed by another writer: its progress record says "
                f"{disk.committed_batches} batches / {disk.committed_tokens} tokens committed (done={disk.done}), "
                f"this writer last committed {self.progress.committed_batches} / {self.progress.committed_tokens}. "
                "This writer stops without writing (nothing committed is touched); make sure no other process "
                "writes this store, then rerun the same command"
            )

    def _commit(self) -> None:
        record = self.progress.to_attrs()
        self.group.update_attributes({"progress": record, PROGRESS_SHA: digest(record)})
