"""The hidden-state store: the one module that owns its schema. Both stages read and write through it, and
it is the only module of pipeline/, data/ and stages/ that imports zarr (pipeline/store_lock.py needs none;
tests/test_layering.py holds every other module to that). What the root record says (building it, comparing
it with a run or a config, re-encoding it) and the frozen head's contents are pipeline/provenance.py's.

Layout (Zarr v3, zarr-python 3), `schema_version` 1:

    STORE/zarr.json                 root group; attrs["dflash"] = provenance (pipeline/provenance.py builds it),
                                    attrs["dflash_integrity"] = {version, provenance_sha256} (written here)
    STORE/frozen_head.safetensors   the target's embed_tokens / lm_head / final norm (frozen, for training)
    STORE/frozen_head.safetensors.sha256   {"sha256", "bytes"} of that file (pipeline.provenance)
    STORE/locks/shard-NNNNN.lock    the lock of a shard being written (pipeline.store_lock); absent otherwise
    STORE/shards/NNNNN/             one group per extract shard, written ONLY by the holder of its lock
        tokens     int32  [T]          token ids, all samples of the shard back to back (token-major)
        loss_mask  uint8  [T]          1 = supervised (assistant) token
        features   [T, L, ...]         the encoded features; with the other parts of the store's encoding
        scales     [T, L, ...]         (fp8, intN only) and outliers [T, L, 4] (intN only): shapes and dtypes
                                       per encoding in pipeline.encoding (bf16: uint16 [T, L, H] bf16 bits)
        sample_start  int64 [N]        first token of each sample in this shard's token arrays
        sample_length int32 [N]
        sample_id     uint64 [N]       the ingest's content hash (16 hex digits)
        split         uint8 [N]        0 = train, 1 = validation
      attrs["progress"] = {committed_batches, committed_samples, committed_tokens, done, every_chunk, ...}
      attrs["progress_sha256"] = sha256 of that record

Contract:
- Ragged samples are flat token-major arrays plus per-sample start/length; L = len(layer_ids), H = hidden.
- Shard i of N holds the samples `shard_rows(samples, i, N)` = samples[i::N] of the ingest's order, the one
  sharding rule (ingest's per-shard sample files, the workers, the parent's disk estimate, a followed store's
  planned rows, regeneration's shards).
- Every array is chunked along its first axis, blosc(zstd, byte shuffle) then a crc32c checksum per chunk,
  so corruption is detected on read. zarr writes each chunk to a temporary `*.partial` file and renames
  it, so a killed writer never leaves a torn chunk behind (a resumed shard deletes its stale `*.partial`
  files; `dflash verify` lists any). Every chunk is stored, even an all-zero one (`write_empty_chunks`;
  progress["every_chunk"] says a shard was written so), so an absent chunk is always damage.
- One writer per shard, enforced: a `ShardWriter` holds the shard's lock file (host, pids, heartbeat;
  pipeline/store_lock.py) or adopts the one its parent holds for it. A second writer is refused at once,
  naming the holder's host and pid. A lock whose processes died (same machine) or whose heartbeat
  expired (another machine, default 120 s) is taken over without manual cleanup. `dflash extract` takes
  the locks of all the shards it runs before starting any worker, so two parents never share a shard.
- Commits only grow a shard: before writing, a writer checks that it still holds the lock and that the
  on-disk progress record is the one it last committed, else it stops without writing; arrays are only
  ever resized up (and trimmed to the committed rows when the shard finishes).
- Commit protocol: a worker grows its arrays, writes a batch's chunks, and only then updates
  attrs["progress"] with its checksum (one atomic metadata write). Readers and resume trust `progress`,
  never array shapes: rows past `committed_tokens` are garbage from an interrupted batch, overwritten on
  resume.
- Reads are checked (`StoreReader.read_rows`, the one read path of training, eval and recode): the first
  read of each chunk checks that its file exists (remembered, one stat per chunk per reader), a decode
  failure (crc32c mismatch, damaged file) or a short read is caught, and either raises `StoreDataError`
  naming the store, shard, array, chunk and the samples it holds, and saying to run `dflash verify`. No
  caller ever sees zarr's fill value for a committed row. Opening a store checks the provenance and every
  progress record against their checksums; training also checks the frozen head's.
- Progress records are read checked: one shard by `read_progress`/`shard_progress`, every shard at once by
  `read_all_progress` (the reader, inspect/status, verify, the extract parent, train's and run's "finished?",
  the multi-node start-up check). A record that fails its checksum raises StoreDataError, or with
  report=True is handed back with its problem and no progress; nothing outside this module parses a record.
- Stores written before these checksums (no "dflash_integrity" attribute) stay readable: their missing
  checksums are reported by `dflash verify` as notes, and since they did not store all-zero chunks, an
  absent loss_mask, split or sample_start chunk is read as zeros there (any other absent chunk is damage).
- A store still being written is read through `committed_refs` (a shard's commit record, checksum-checked,
  and its committed rows, read afresh) and `StoreReader.read_sample`/`read_rows`, which reopen an array opened
  before its shard grew.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipeline.encoding import ENCODINGS, part_names, parts_spec
from pipeline.errors import StoreError, UserError
from pipeline.store_lock import ShardLock, exists, is_local, is_new  # noqa: F401  (re-exported: st.exists, ...)

SCHEMA_VERSION = 1
FROZEN_HEAD_FILE = "frozen_head.safetensors"
SHARDS_GROUP = "shards"
SPLITS = {"train": 0, "validation": 1}
SAMPLE_CHUNK = 8192  # rows per chunk of the per-sample arrays
SAMPLE_ARRAYS = ("sample_start", "sample_length", "sample_id", "split")
INTEGRITY_ATTR = "dflash_integrity"  # root attribute: {"version": 1, "provenance_sha256": ...}
PROGRESS_SHA = "progress_sha256"  # shard attribute beside "progress"
# arrays that can hold all-zero chunks, which stores written before "every_chunk" did not store
MAYBE_EMPTY = ("loss_mask", "split", "sample_start")


class StoreDataError(StoreError):
    """Missing or damaged data found where it was read; the message names store, shard, array, chunk, samples."""

    def __init__(self, message: str):
        # a DataLoader worker's error reaches the training process re-raised as
        # StoreDataError("Caught StoreDataError in DataLoader worker ... Original Traceback ... StoreDataError: MSG"):
        # keep MSG, so the command prints one clear error and not a traceback
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


def digest(obj: Any) -> str:
    """sha256 of an attribute value's canonical JSON (what a round trip through zarr.json preserves)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_name(index: int) -> str:
    return f"{SHARDS_GROUP}/{index:05d}"


def shard_rows(items, shard: int, num_shards: int):
    """The rows of `items` that shard `shard` of `num_shards` takes: items[shard::num_shards], in order. The one
    sharding rule of ingest's sample files, extraction, its disk estimate, a followed store's planned rows and
    regeneration. A sequence is sliced (a list stays a list, a range a range); any other iterable (a file's
    lines) is read through. StoreError for a shard index outside 0..num_shards-1."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, numbers.Integral) or num_shards < 1:
        raise StoreError(f"the number of shards must be a whole number of at least 1, got {num_shards!r}")
    if isinstance(shard, bool) or not isinstance(shard, numbers.Integral) or not 0 <= shard < num_shards:
        raise StoreError(f"shard index {shard!r} is out of range for {num_shards} shard(s): shards are numbered "
                         f"0..{num_shards - 1}")
    if isinstance(items, (Sequence, np.ndarray)):
        return items[shard::num_shards]
    return list(itertools.islice(items, shard, None, num_shards))


def _zarr():
    import zarr  # imported lazily: DataLoader workers open the store after fork, never before

    return zarr


def _codecs(typesize: int, clevel: int) -> list:
    from zarr.codecs import BloscCodec, Crc32cCodec

    shuffle = "shuffle" if typesize > 1 else "bitshuffle"
    return [BloscCodec(cname="zstd", clevel=clevel, shuffle=shuffle, typesize=typesize), Crc32cCodec()]


def feature_dtype(encoding: str) -> str:
    if encoding not in ENCODINGS:
        raise StoreError(f"unknown feature encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")
    return parts_spec(encoding, 2, 32)["features"][1]


def token_arrays(encoding: str) -> tuple[str, ...]:
    """The per-token arrays of a shard (rows = tokens) for this encoding."""
    return ("tokens", "loss_mask", *part_names(encoding))


# ----------------------------------------------------------------------------------------------------------
# Root: the provenance record's bytes (its schema version and checksum); what it says is pipeline/provenance.py's
# ----------------------------------------------------------------------------------------------------------


def read_root_attrs(path: str, check: bool = True) -> Optional[dict]:
    """The store's `dflash` attrs, None if the path does not exist; StoreError if it is not a dflash store,
    StoreDataError if (check) the provenance does not match its recorded checksum. A path that holds nothing but
    the creation lock (a root being created) does not exist yet either."""
    if is_new(path):
        return None
    zarr = _zarr()
    try:
        root = zarr.open_group(path, mode="r")
    except Exception as e:  # noqa: BLE001 - any failure here means "not a zarr group"
        raise StoreError(
            f"{path} exists but is not a dflash store (not a Zarr v3 group: {type(e).__name__}: {e}); "
            "choose another --store path or remove it"
        ) from None
    root_attrs = dict(root.attrs)
    attrs = root_attrs.get("dflash")
    if not isinstance(attrs, dict) or "schema_version" not in attrs:
        raise StoreError(f"{path} is a Zarr group but not a dflash store (no 'dflash' attributes); choose another path")
    if attrs["schema_version"] != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has store schema_version {attrs['schema_version']}, this dflash reads {SCHEMA_VERSION}; "
            "use the dflash version that wrote it or re-extract"
        )
    problem = provenance_problem(path, root_attrs) if check else None
    if problem:
        raise StoreDataError(problem + f"; run `dflash verify {path}`")
    return attrs


def provenance_problem(path: str, root_attrs: dict) -> Optional[str]:
    """Why the root provenance cannot be trusted, or None (also None for a store from before checksums)."""
    integrity = root_attrs.get(INTEGRITY_ATTR)
    if not isinstance(integrity, dict):
        return None
    if integrity.get("provenance_sha256") != digest(root_attrs.get("dflash")):
        return (f"the provenance of {path} (attribute 'dflash' in {path}/zarr.json) does not match its recorded "
                "checksum: it was edited or damaged after the store was created, so what the features are "
                "(target, layer_ids, encoding, ...) is unknown; restore the original zarr.json or re-extract")
    return None


def root_attributes(path: str) -> dict:
    """Every attribute of the root group, unchecked: the provenance under "dflash" and, beside it, the integrity
    record (INTEGRITY_ATTR) that `provenance_problem` and the frozen head's check read."""
    return dict(_zarr().open_group(path, mode="r").attrs)


def write_root(path: str, provenance: dict) -> dict:
    """Create the root group of a new store holding `provenance` (pipeline/provenance.py builds it and decides
    whether an existing store may be continued) with its checksum; returns the record as zarr.json holds it."""
    zarr = _zarr()
    try:
        if is_local(path):
            Path(path).mkdir(parents=True, exist_ok=True)
        root = zarr.open_group(path, mode="a")
        root.require_group(SHARDS_GROUP)
        provenance = json.loads(json.dumps(provenance))  # as zarr.json will hold it, so the checksum matches a re-read
        # written last and in one metadata write: a store without it is not (yet) a dflash store
        root.update_attributes({"dflash": provenance,
                                INTEGRITY_ATTR: {"version": 1, "provenance_sha256": digest(provenance)}})
    except OSError as e:
        raise StoreError(f"cannot create the store at {path}: {e}; choose a writable --store path "
                         "(or set store.path) with room for the features") from None
    return provenance


# ----------------------------------------------------------------------------------------------------------
# Shard writer (one per extract worker)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Progress:
    committed_batches: int = 0
    committed_samples: int = 0
    committed_tokens: int = 0
    done: bool = False
    nonfinite_skipped: int = 0
    plan_fingerprint: str = ""
    planned_samples: int = 0
    planned_tokens: int = 0
    every_chunk: bool = False  # every chunk of the committed rows is stored, all-zero ones included
    validation_batches: int = -1  # the plan's first batches holding the validation samples (-1: not recorded)

    @classmethod
    def from_attrs(cls, attrs: dict) -> "Progress":
        p = attrs.get("progress") or {}
        return cls(**{k: p[k] for k in cls.__dataclass_fields__ if k in p})

    def to_attrs(self) -> dict:
        return dict(self.__dict__)

    def committed(self) -> tuple:
        return self.committed_batches, self.committed_samples, self.committed_tokens, self.done


def progress_problem(path: str, index: int, shard_attrs: dict, integrity: bool) -> Optional[str]:
    """Why shard `index`'s progress record cannot be trusted, or None. `integrity`: the store records checksums."""
    p = shard_attrs.get("progress")
    if p is None:
        return None
    sha = shard_attrs.get(PROGRESS_SHA)
    if sha is None and not integrity:
        return None
    if sha != digest(p):
        return (f"the progress record of shard {index} of {path} (attribute 'progress' in "
                f"{path}/{shard_name(index)}/zarr.json) does not match its checksum: it was edited or damaged, so "
                f"which rows are committed is unknown; re-extract the shard (remove {path}/{shard_name(index)} and "
                "rerun the same `dflash extract` command)")
    return None


def read_progress(path: str, index: int, shard_attrs: dict, integrity: bool) -> Progress:
    """Shard `index`'s commit record from its group's attributes; StoreDataError if it fails its checksum."""
    problem = progress_problem(path, index, shard_attrs, integrity)
    if problem:
        raise StoreDataError(problem + f"; `dflash verify {path}` lists every problem")
    return Progress.from_attrs(shard_attrs)


@dataclass(frozen=True)
class ShardState:
    """One shard's commit record as `read_all_progress` read it."""

    index: int
    progress: Optional[Progress]  # None: not started, or its record failed its checksum (then `problem` says why)
    problem: Optional[str] = None  # only with report=True (without it such a record raises)
    group: Any = None  # the shard's group (None before the shard started), for a caller that reads its arrays

    @property
    def started(self) -> bool:
        return self.group is not None

    @property
    def done(self) -> bool:
        return self.progress is not None and self.progress.done


def read_all_progress(path: str, report: bool = False) -> list[ShardState]:
    """Every shard's commit record (shards 0..num_shards-1 of the root record, in order), read afresh in one pass
    and checked like `read_progress`: a record that fails its checksum raises the same StoreDataError, or with
    `report` comes back without progress and with its `problem`, for a caller that lists problems (verify) or
    leaves that shard to its own writer (the extract parent)."""
    attrs = read_root_attrs(path, check=False)  # the provenance's checksum is its readers' concern
    if attrs is None:
        raise StoreError(f"no store at {path}; run `dflash extract` first or pass --store PATH")
    return _shard_states(path, _zarr().open_group(path, mode="r"), int(attrs["num_shards"]), report)


def _shard_states(path: str, root, num_shards: int, report: bool = False) -> list[ShardState]:
    integrity = INTEGRITY_ATTR in dict(root.attrs)
    out = []
    for i in range(num_shards):
        try:
            g = root[shard_name(i)]
        except KeyError:
            out.append(ShardState(i, None))
            continue
        shard_attrs = dict(g.attrs)
        problem = progress_problem(path, i, shard_attrs, integrity) if report else None
        prog = None if problem else read_progress(path, i, shard_attrs, integrity)
        out.append(ShardState(i, prog, problem, g))
    return out


def _local_dir(path: str) -> Optional[Path]:
    return Path(str(path).removeprefix("file://")) if is_local(path) else None


def partial_files(path: str, under: str = "") -> list[Path]:
    """zarr's temporary `*.partial` chunk/metadata files (and ours) left by a killed writer (local stores)."""
    d = _local_dir(path)
    if d is None or not (d / under).is_dir():
        return []
    return sorted(f for f in (d / under).rglob("*.partial") if f.is_file())


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
        zarr = _zarr()
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
                    name, shape=shape, chunks=chunks, dtype=dtype, compressors=_codecs(size, clevel), fill_value=0,
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


# ----------------------------------------------------------------------------------------------------------
# Reader (training, eval, recode, inspect): every read is checked
# ----------------------------------------------------------------------------------------------------------


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
        zarr = _zarr()
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
        for state in _shard_states(path, root, int(attrs["num_shards"])):  # each record checked
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
            root = _zarr().open_group(self.path, mode="r")
            g = self.shards[shard] = root[shard_name(shard)]
            self.progress[shard] = read_progress(self.path, shard, dict(g.attrs), INTEGRITY_ATTR in dict(root.attrs))
            arr = self._arrays[key] = g[name]  # reads the array's metadata afresh
        return arr


def _shard_group(path: str, shard: int):
    """(the shard's group, its checked commit record) read afresh, or (None, None) before the shard started."""
    root = _zarr().open_group(path, mode="r")
    try:
        g = root[shard_name(shard)]
    except KeyError:
        return None, None
    return g, read_progress(path, shard, dict(g.attrs), INTEGRITY_ATTR in dict(root.attrs))


def shard_progress(path: str, shard: int) -> Optional[Progress]:
    """A shard's commit record, read afresh and checked; None while the shard has not started."""
    return _shard_group(path, shard)[1]


def committed_refs(path: str, shard: int, from_row: int = 0) -> tuple[Optional[Progress], list[SampleRef]]:
    """A shard's commit record and its committed samples from row `from_row` on, read afresh: how training
    follows a store that extraction is still writing. (None, []) while the shard has not started. Rows are
    trusted up to `progress.committed_samples` only (see the commit protocol above)."""
    g, prog = _shard_group(path, shard)
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


def frozen_head_path(store_path: str) -> str:
    return str(store_path).rstrip("/") + "/" + FROZEN_HEAD_FILE


def write_bytes_atomic(path: str, data: bytes) -> None:
    if is_local(path):
        p = Path(path.removeprefix("file://"))
        tmp = p.with_name(p.name + f".{os.getpid()}.partial")
        tmp.write_bytes(data)
        os.replace(tmp, p)
    else:
        import fsspec

        with fsspec.open(path, "wb") as f:
            f.write(data)


def read_bytes(path: str) -> bytes:
    if is_local(path):
        from pipeline.ckpt_io import require_regular

        require_regular(path, "store file")  # a FIFO would block the read forever
        return Path(path.removeprefix("file://")).read_bytes()
    import fsspec

    with fsspec.open(path, "rb") as f:
        return f.read()


def sample_id_to_int(sample_id: str) -> int:
    return int(sample_id[:16], 16)
