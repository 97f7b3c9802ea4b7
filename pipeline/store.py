"""The hidden-state store: the one module that owns its schema (the layout and the contract below, names,
codecs, the root and progress records and their checks). The store layer is this module, its writer
(pipeline/store_writer.py: ShardWriter) and its reader (pipeline/store_reader.py: StoreReader, committed_refs);
both stages read and write through them, and they are the only modules of pipeline/, data/ and stages/ that
import zarr (pipeline/store_lock.py needs none; tests/test_layering.py holds every other module to that). What
the root record says (building it, comparing it with a run or a config, re-encoding it) and the frozen head's
contents are pipeline/provenance.py's.

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
from pipeline.errors import StoreError
from pipeline.store_lock import exists, is_local, is_new  # noqa: F401  (re-exported: st.exists, st.is_new)

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


def zarr_module():
    import zarr  # imported lazily: DataLoader workers open the store after fork, never before

    return zarr


def chunk_codecs(typesize: int, clevel: int) -> list:
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
    zarr = zarr_module()
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
    return dict(zarr_module().open_group(path, mode="r").attrs)


def write_root(path: str, provenance: dict) -> dict:
    """Create the root group of a new store holding `provenance` (pipeline/provenance.py builds it and decides
    whether an existing store may be continued) with its checksum; returns the record as zarr.json holds it."""
    zarr = zarr_module()
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
# Progress records: a shard's commit record, read checked (written by pipeline/store_writer.py)
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
    return shard_states(path, zarr_module().open_group(path, mode="r"), int(attrs["num_shards"]), report)


def shard_states(path: str, root, num_shards: int, report: bool = False) -> list[ShardState]:
    """`read_all_progress` on a root group already open (StoreReader opens it once for this and its arrays)."""
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


def shard_group(path: str, shard: int):
    """(the shard's group, its checked commit record) read afresh, or (None, None) before the shard started."""
    root = zarr_module().open_group(path, mode="r")
    try:
        g = root[shard_name(shard)]
    except KeyError:
        return None, None
    return g, read_progress(path, shard, dict(g.attrs), INTEGRITY_ATTR in dict(root.attrs))


def shard_progress(path: str, shard: int) -> Optional[Progress]:
    """A shard's commit record, read afresh and checked; None while the shard has not started."""
    return shard_group(path, shard)[1]


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
