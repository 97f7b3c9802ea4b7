"""Reading a store: `StoreReader` (training, eval, recode, inspect) and `committed_refs` (a store still being
written), keeping the read rules of pipeline/store.py's contract: rows are trusted up to a shard's checked commit
record only; every chunk read is checked (its file's existence once per reader, its crc32c on decode, a short
read), and a failure raises StoreDataError naming the store, shard, array, chunk and the samples it holds, never
zarr's fill value; `dflash verify` (stages/verify.py) reuses the chunk helpers here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pipeline.errors import StoreError
from pipeline.store import (INTEGRITY_ATTR, MAYBE_EMPTY, SAMPLE_ARRAYS, SPLITS, Progress, StoreDataError, exists,
                            read_progress, read_root_attrs, shard_group, shard_name, shard_states, token_arrays,
                            zarr_module)


@dataclass(frozen=True)
class SampleRef:
    shard: int
    start: int
    length: int
    sample_id: int
    split: int
    row: int = -1  # the sample's row in its shard (set by `committed_refs`)


def chunk_key(arr, c: int) -> str:
    """The store key (relative to the array) of chunk `c` along the first axis."""
    return arr.metadata.chunk_key_encoding.encode_chunk_key((c,) + (0,) * (arr.ndim - 1))


def chunk_exists(path: str, shard: int, name: str, arr, c: int) -> bool:
    return exists(f"{str(path).rstrip('/')}/{shard_name(shard)}/{name}/{chunk_key(arr, c)}")


def samples_in_rows(cols: Optional[dict], name: str, r0: int, r1: int, committed: int) -> str:
    """Which samples of a shard rows [r0, r1) of array `name` hold, for an error message."""
    if name in SAMPLE_ARRAYS:
        lo, hi = r0, min(r1, committed)
    elif cols is not None and "sample_start" in cols and "sample_length" in cols:
        ends = cols["sample_start"] + cols["sample_length"]
        lo, hi = int(np.searchsorted(ends, r0, side="right")), int(np.searchsorted(cols["sample_start"], r1))
    else:
        return "samples unknown (the per-sample arrays were not read)"
    if hi <= lo:
        return "no committed sample"
    text = f"1 sample, shard position {lo}" if hi - lo == 1 else f"{hi - lo} samples, shard positions {lo}..{hi - 1}"
    if cols is not None and "sample_id" in cols and name != "sample_id":
        ids = [f"{int(x):016x}" for x in cols["sample_id"][lo : min(hi, lo + 3)]]
        text += f", sample ids {', '.join(ids)}" + (f" and {hi - lo - 3} more" if hi - lo > 3 else "")
    return text


def decode_error(e: Exception) -> str:
    """A chunk read failure, briefly (zarr's checksum error goes on to print both checksums' bytes)."""
    text = str(e).split(". ")[0]
    if "checksum" in text:
        return "its crc32c checksum does not match: the file was changed or damaged"
    return f"{type(e).__name__}: {text[:120]}; the file is damaged"


def damage_message(path: str, shard: int, name: str, c: int, rows: int, what: str, samples: str) -> str:
    return (f"damaged store {path}: shard {shard}, array {name}, chunk {c} (rows {c * rows}..{(c + 1) * rows - 1}) "
            f"{what}; it holds {samples}. Nothing was read from it. Run `dflash verify {path}` to list every "
            f"problem, then restore the store from a copy or re-extract that shard (remove "
            f"{path}/{shard_name(shard)} and rerun the same `dflash extract` command)")


class StoreReader:
    """Random access to committed samples. Open it inside each DataLoader worker (zarr is not fork-safe)."""

    def __init__(self, path: str, require_complete: bool = True):
        attrs = read_root_attrs(path)  # checks the provenance checksum
        if attrs is None:
            raise StoreError(f"no store at {path}; run `dflash extract` first or pass --store PATH")
        zarr = zarr_module()
        self.path, self.attrs = path, attrs
        self.encoding = attrs["encoding"]
        self.layer_ids = list(attrs["layer_ids"])
        self.hidden_size = int(attrs["target"]["hidden_size"])
        root = zarr.open_group(path, mode="r")
        self.shards: dict[int, Any] = {}
        self.progress: dict[int, Progress] = {}
        # opened arrays, by (shard, name): opening one reads and parses its zarr.json, which costs half of
        # a sample's read time when done per read. Each array's shape covers every committed sample.
        self._arrays: dict[tuple[int, str], Any] = {}
        self._present: dict[tuple[int, str], set[int]] = {}  # chunks seen to exist, by (shard, name)
        self._columns: dict[int, dict[str, np.ndarray]] = {}  # per-sample arrays of each shard
        refs = []
        for state in shard_states(path, root, int(attrs["num_shards"])):  # each record checked
            i, prog = state.index, state.progress or Progress()
            self.progress[i] = prog
            if not state.started:
                continue
            self.shards[i] = state.group
            n = prog.committed_samples
            if n == 0:
                continue
            cols: dict[str, np.ndarray] = {}
            self._columns[i] = cols
            for k in ("sample_id", *SAMPLE_ARRAYS):  # ids first: an error in another array can name them
                cols[k] = self.read_rows(i, k, 0, n)
            refs.extend(SampleRef(i, int(s), int(l), int(d), int(sp)) for s, l, d, sp in
                        zip(cols["sample_start"], cols["sample_length"], cols["sample_id"], cols["split"]))
        missing = [i for i, p in self.progress.items() if not p.done]
        if require_complete and missing:
            raise StoreError(
                f"the store at {path} is not complete: shard(s) {missing} have not finished; "
                f"resume extraction with `dflash extract` (same config and --shards), or inspect with `dflash inspect {path}`"
            )
        refs.sort(key=lambda r: r.sample_id)  # deterministic order independent of sharding
        self.samples = refs

    def indices(self, split: str) -> list[int]:
        code = SPLITS[split]
        return [i for i, r in enumerate(self.samples) if r.split == code]

    def read(self, index: int) -> dict[str, np.ndarray]:
        """One sample: tokens int32 [S], loss_mask uint8 [S] and the encoding's parts (features, ...) [S, ...]."""
        r = self.samples[index]
        return self.read_sample(r.shard, r.start, r.length)

    def read_sample(self, shard: int, start: int, length: int) -> dict[str, np.ndarray]:
        """Token rows [start, start + length) of every token array of a shard, checked: a sample of `samples`,
        or one found by `committed_refs` after this reader opened (a store still being written)."""
        return {name: self.read_rows(shard, name, start, start + length) for name in token_arrays(self.encoding)}

    def columns(self, shard: int) -> dict[str, np.ndarray]:
        """The committed per-sample arrays (sample_start, sample_length, sample_id, split) of a shard."""
        return self._columns.get(shard) or {k: np.zeros(0, np.int64) for k in SAMPLE_ARRAYS}

    def read_rows(self, shard: int, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a shard's array, checked: StoreDataError instead of a fill value or a zarr error."""
        arr = self._array(shard, name, stop)
        if stop <= start:
            return arr[start:stop]
        rows = arr.chunks[0]
        seen = self._present.setdefault((shard, name), set())
        every = self.progress[shard].every_chunk or name not in MAYBE_EMPTY
        for c in range(start // rows, (stop - 1) // rows + 1):
            if c not in seen:
                if every and not chunk_exists(self.path, shard, name, arr, c):
                    raise self._damage(shard, name, c, rows, "is missing (zarr would have read it as zeros)")
                seen.add(c)
        try:
            out = arr[start:stop]
        except Exception as e:  # noqa: BLE001 - crc32c mismatch, undecodable or unreadable chunk
            c = next((c for c in range(start // rows, (stop - 1) // rows + 1) if not _readable(arr, c)), start // rows)
            raise self._damage(shard, name, c, rows, f"cannot be decoded ({decode_error(e)})") from None
        if len(out) != stop - start:
            c = arr.shape[0] // rows
            raise self._damage(shard, name, c, rows, f"is cut off: the array ends at row {arr.shape[0]} but rows up "
                               f"to {stop} are committed")
        return out

    def _damage(self, shard: int, name: str, c: int, rows: int, what: str) -> StoreDataError:
        p = self.progress[shard]
        committed = p.committed_samples if name in SAMPLE_ARRAYS else p.committed_tokens
        samples = samples_in_rows(self._columns.get(shard), name, c * rows, (c + 1) * rows, committed)
        return StoreDataError(damage_message(self.path, shard, name, c, rows, what, samples))

    def _array(self, shard: int, name: str, rows: int = 0):
        key = (shard, name)
        arr = self._arrays.get(key)
        if arr is None and shard in self.shards:
            arr = self._arrays[key] = self.shards[shard][name]
        if arr is None or arr.shape[0] < rows:  # a shard begun or grown since this reader opened (following)
            root = zarr_module().open_group(self.path, mode="r")
            g = self.shards[shard] = root[shard_name(shard)]
            self.progress[shard] = read_progress(self.path, shard, dict(g.attrs), INTEGRITY_ATTR in dict(root.attrs))
            arr = self._arrays[key] = g[name]  # reads the array's metadata afresh
        return arr


def committed_refs(path: str, shard: int, from_row: int = 0) -> tuple[Optional[Progress], list[SampleRef]]:
    """A shard's commit record and its committed samples from row `from_row` on, read afresh: how training
    follows a store that extraction is still writing. (None, []) while the shard has not started. Rows are
    trusted up to `progress.committed_samples` only (pipeline/store.py's commit protocol)."""
    g, prog = shard_group(path, shard)
    if g is None:
        return None, []
    n = prog.committed_samples
    if n <= from_row:
        return prog, []
    starts, lengths = g["sample_start"][from_row:n], g["sample_length"][from_row:n]
    ids, splits = g["sample_id"][from_row:n], g["split"][from_row:n]
    return prog, [SampleRef(shard, int(s), int(l), int(d), int(sp), from_row + k)
                  for k, (s, l, d, sp) in enumerate(zip(starts, lengths, ids, splits))]


def _readable(arr, c: int) -> bool:
    rows = arr.chunks[0]
    try:
        arr[c * rows : min((c + 1) * rows, arr.shape[0])]
        return True
    except Exception:  # noqa: BLE001
        return False
