"""The hidden-state store: the one module that owns its schema. Both stages read and write through it.

Layout (Zarr v3, zarr-python 3), `schema_version` 1:

    STORE/zarr.json                 root group; attrs["dflash"] = provenance (see `make_provenance`)
    STORE/frozen_head.safetensors   the target's embed_tokens / lm_head / final norm (frozen, for training)
    STORE/shards/NNNNN/             one group per extract shard, written ONLY by that shard's worker
        tokens     int32  [T]          token ids, all samples of the shard back to back (token-major)
        loss_mask  uint8  [T]          1 = supervised (assistant) token
        features   [T, L, ...]         the encoded features; with the other parts of the store's encoding
        scales     [T, L, ...]         (fp8, intN only) and outliers [T, L, 4] (intN only): shapes and dtypes
                                       per encoding in pipeline.encoding (bf16: uint16 [T, L, H] bf16 bits)
        sample_start  int64 [N]        first token of each sample in this shard's token arrays
        sample_length int32 [N]
        sample_id     uint64 [N]       the ingest's content hash (16 hex digits)
        split         uint8 [N]        0 = train, 1 = validation
      attrs["progress"] = {committed_batches, committed_samples, committed_tokens, done, ...}

Contract:
- Ragged samples are flat token-major arrays plus per-sample start/length; L = len(layer_ids), H = hidden.
- Every array is chunked along its first axis, blosc(zstd, byte shuffle) then a crc32c checksum per chunk,
  so corruption is detected on read. zarr writes each chunk to a temporary file and renames it, so a
  killed writer never leaves a torn chunk behind.
- Concurrency: a shard's group is created and written only by its own worker; the parent writes only the
  root. No two processes ever write the same chunk, and there is no shared resize or append.
- Commit protocol: a worker resizes its arrays, writes a batch's chunks, and only then updates
  attrs["progress"] (one atomic metadata write). Readers and resume trust `progress`, never array shapes:
  rows past `committed_tokens` are garbage from an interrupted batch and are overwritten on resume.
- A store still being written is read through `committed_refs` (a shard's commit record and committed rows,
  read afresh) and `StoreReader.read_rows`, which reopens an array opened before its shard grew.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipeline.encoding import ENCODINGS, part_names, parts_spec

SCHEMA_VERSION = 1
FROZEN_HEAD_FILE = "frozen_head.safetensors"
SHARDS_GROUP = "shards"
SPLITS = {"train": 0, "validation": 1}
SAMPLE_CHUNK = 8192  # rows per chunk of the per-sample arrays


class StoreError(RuntimeError):
    """A store that cannot be used as asked; the message says what is wrong and what to do."""


def shard_name(index: int) -> str:
    return f"{SHARDS_GROUP}/{index:05d}"


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


def is_local(path: str) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def exists(path: str) -> bool:
    if is_local(path):
        return Path(str(path).removeprefix("file://")).exists()
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


# ----------------------------------------------------------------------------------------------------------
# Root: creation and provenance
# ----------------------------------------------------------------------------------------------------------


def read_root_attrs(path: str) -> Optional[dict]:
    """The store's `dflash` attrs, None if the path does not exist; StoreError if it is not a dflash store."""
    if not exists(path):
        return None
    zarr = _zarr()
    try:
        root = zarr.open_group(path, mode="r")
    except Exception as e:  # noqa: BLE001 - any failure here means "not a zarr group"
        raise StoreError(
            f"{path} exists but is not a dflash store (not a Zarr v3 group: {type(e).__name__}: {e}); "
            "choose another --store path or remove it"
        ) from None
    attrs = dict(root.attrs).get("dflash")
    if not isinstance(attrs, dict) or "schema_version" not in attrs:
        raise StoreError(f"{path} is a Zarr group but not a dflash store (no 'dflash' attributes); choose another path")
    if attrs["schema_version"] != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has store schema_version {attrs['schema_version']}, this dflash reads {SCHEMA_VERSION}; "
            "use the dflash version that wrote it or re-extract"
        )
    return attrs


# Provenance keys that must match between a store and the run that writes to or trains from it.
IDENTITY_KEYS = (
    "target.config_sha256", "target.weights_sha256", "target.hidden_size", "target.vocab_size", "layer_ids",
    "encoding", "tokenizer.sha256", "tokenizer.chat_template_sha256", "tokenizer.enable_thinking",
    "dataset.fingerprint", "max_length", "num_shards",
)


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def provenance_differences(stored: dict, expected: dict, keys: tuple[str, ...] = IDENTITY_KEYS) -> list[str]:
    """Human-readable lines, one per key where the store and the current run disagree."""
    diffs = []
    for key in keys:
        a, b = _get(stored, key), _get(expected, key)
        if b is None:
            continue
        if a != b:
            diffs.append(f"{key}: store has {a!r}, this run has {b!r}")
    return diffs


def create_or_open_store(path: str, provenance: dict) -> dict:
    """Create the root of a new store, or check that an existing one was made by the same run.

    Returns the stored provenance. Raises StoreError naming every difference otherwise.
    """
    stored = read_root_attrs(path)
    if stored is not None:
        diffs = provenance_differences(stored, provenance)
        if diffs:
            raise StoreError(
                f"the store at {path} was made by a different run:\n  " + "\n  ".join(diffs)
                + "\nUse a new --store path for this configuration, or rerun with the configuration that made it."
            )
        return stored
    zarr = _zarr()
    try:
        if is_local(path):
            Path(path).mkdir(parents=True, exist_ok=True)
        root = zarr.open_group(path, mode="a")
        root.require_group(SHARDS_GROUP)
        root.attrs["dflash"] = provenance  # written last: a store without it is not (yet) a dflash store
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
    validation_batches: int = -1  # the plan's first batches holding the validation samples (-1: not recorded)

    @classmethod
    def from_attrs(cls, attrs: dict) -> "Progress":
        p = attrs.get("progress") or {}
        return cls(**{k: p[k] for k in cls.__dataclass_fields__ if k in p})

    def to_attrs(self) -> dict:
        return dict(self.__dict__)


class ShardWriter:
    """Appends committed batches to one shard group; the only writer of that group."""

    def __init__(self, path: str, shard_index: int, root_attrs: dict):
        zarr = _zarr()
        self.path, self.index = path, shard_index
        self.encoding = root_attrs["encoding"]
        L, H = len(root_attrs["layer_ids"]), root_attrs["target"]["hidden_size"]
        chunk = int(root_attrs["chunk_tokens"])
        clevel = int(root_attrs.get("clevel", 3))
        root = zarr.open_group(path, mode="a")
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
        for name, (shape, chunks, dtype) in specs.items():
            if name in existing:
                self.arrays[name] = g[name]
            else:
                size = np.dtype(dtype).itemsize
                self.arrays[name] = g.create_array(
                    name, shape=shape, chunks=chunks, dtype=dtype, compressors=_codecs(size, clevel), fill_value=0
                )
        self.group = g
        self.progress = Progress.from_attrs(dict(g.attrs))

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
        if not p.plan_fingerprint:
            p.plan_fingerprint, p.planned_samples, p.planned_tokens = plan_fingerprint, planned_samples, planned_tokens
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
        n, T = len(sample_ids), len(tokens)
        t0, s0 = p.committed_tokens, p.committed_samples
        if T:
            missing = set(self.parts) - set(parts)
            if missing:
                raise StoreError(f"batch for shard {self.index} lacks the {sorted(missing)} part(s) of encoding {self.encoding}")
            for name, data in [("tokens", tokens), ("loss_mask", loss_mask)] + [(k, parts[k]) for k in self.parts]:
                arr = self.arrays[name]
                arr.resize((t0 + T,) + arr.shape[1:])
                arr[t0 : t0 + T] = data
        if n:
            starts = t0 + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64)
            for name, data in (("sample_start", starts), ("sample_length", lengths.astype(np.int32)),
                               ("sample_id", sample_ids.astype(np.uint64)), ("split", splits.astype(np.uint8))):
                arr = self.arrays[name]
                arr.resize((s0 + n,))
                arr[s0 : s0 + n] = data
        p.committed_batches += 1
        p.committed_samples += n
        p.committed_tokens += T
        p.nonfinite_skipped += nonfinite_skipped
        self._commit()
        return p

    def finish(self) -> Progress:
        self.progress.done = True
        self._commit()
        return self.progress

    def _commit(self) -> None:
        self.group.attrs["progress"] = self.progress.to_attrs()


# ----------------------------------------------------------------------------------------------------------
# Reader (training, eval, inspect)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleRef:
    shard: int
    start: int
    length: int
    sample_id: int
    split: int
    row: int = -1  # the sample's row in its shard (set by `committed_refs`)


class StoreReader:
    """Random access to committed samples. Open it inside each DataLoader worker (zarr is not fork-safe)."""

    def __init__(self, path: str, require_complete: bool = True):
        attrs = read_root_attrs(path)
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
        refs = []
        for i in range(int(attrs["num_shards"])):
            name = shard_name(i)
            try:
                g = root[name]
            except KeyError:
                self.progress[i] = Progress()
                continue
            prog = Progress.from_attrs(dict(g.attrs))
            self.shards[i], self.progress[i] = g, prog
            n = prog.committed_samples
            if n == 0:
                continue
            starts, lengths = g["sample_start"][:n], g["sample_length"][:n]
            ids, splits = g["sample_id"][:n], g["split"][:n]
            refs.extend(SampleRef(i, int(s), int(l), int(d), int(sp)) for s, l, d, sp in zip(starts, lengths, ids, splits))
        missing = [i for i, p in self.progress.items() if not p.done]
        if require_complete and missing:
            raise StoreError(
                f"the store at {path} is not complete: shard(s) {missing} have not finished; "
                f"resume extraction with `dflash extract` (same config and --shards), or inspect with `dflash inspect {path}`"
            )
        refs.sort(key=lambda r: r.sample_id)  # deterministic order independent of sharding
        self.samples = refs
        # opened arrays, by (shard, name): opening one reads and parses its zarr.json, which was half of
        # a sample's read time when done per read. Opened after the progress above was read, so each
        # array's shape covers every committed sample.
        self._arrays: dict[tuple[int, str], Any] = {}

    def indices(self, split: str) -> list[int]:
        code = SPLITS[split]
        return [i for i, r in enumerate(self.samples) if r.split == code]

    def read(self, index: int) -> dict[str, np.ndarray]:
        """One sample: tokens int32 [S], loss_mask uint8 [S] and the encoding's parts (features, ...) [S, ...]."""
        r = self.samples[index]
        return self.read_rows(r.shard, r.start, r.length)

    def read_rows(self, shard: int, start: int, length: int) -> dict[str, np.ndarray]:
        """Token rows [start, start + length) of a shard: a sample found by `committed_refs` after this reader
        opened (a store still being written), or one of `samples`."""
        sl = slice(start, start + length)
        return {name: self._array(shard, name, sl.stop)[sl] for name in token_arrays(self.encoding)}

    def _array(self, shard: int, name: str, rows: int = 0):
        key = (shard, name)
        arr = self._arrays.get(key)
        if arr is None or arr.shape[0] < rows:  # first use, or the shard grew since this reader opened it
            if shard not in self.shards:
                self.shards[shard] = _zarr().open_group(self.path, mode="r")[shard_name(shard)]
            arr = self._arrays[key] = self.shards[shard][name]  # reads the array's metadata afresh
        return arr


def _shard_group(path: str, shard: int):
    try:
        return _zarr().open_group(path, mode="r")[shard_name(shard)]
    except KeyError:
        return None


def shard_progress(path: str, shard: int) -> Optional[Progress]:
    """A shard's commit record, read afresh; None while the shard has not started."""
    g = _shard_group(path, shard)
    return None if g is None else Progress.from_attrs(dict(g.attrs))


def committed_refs(path: str, shard: int, from_row: int = 0) -> tuple[Optional[Progress], list[SampleRef]]:
    """A shard's commit record and its committed samples from row `from_row` on, read afresh: how training
    follows a store that extraction is still writing. (None, []) while the shard has not started. Rows are
    trusted up to `progress.committed_samples` only (see the commit protocol above)."""
    g = _shard_group(path, shard)
    if g is None:
        return None, []
    prog = Progress.from_attrs(dict(g.attrs))
    n = prog.committed_samples
    if n <= from_row:
        return prog, []
    starts, lengths = g["sample_start"][from_row:n], g["sample_length"][from_row:n]
    ids, splits = g["sample_id"][from_row:n], g["split"][from_row:n]
    return prog, [SampleRef(shard, int(s), int(l), int(d), int(sp), from_row + k)
                  for k, (s, l, d, sp) in enumerate(zip(starts, lengths, ids, splits))]


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
        return Path(path.removeprefix("file://")).read_bytes()
    import fsspec

    with fsspec.open(path, "rb") as f:
        return f.read()


def sample_id_to_int(sample_id: str) -> int:
    return int(sample_id[:16], 16)


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
