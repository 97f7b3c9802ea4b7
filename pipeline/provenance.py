"""What a store says about where it came from (its root record), and its frozen head: built, compared, read here.

Contract:
- The root record (attrs["dflash"] of STORE/zarr.json) is built only here: `build_provenance` for an extraction
  (target and tokenizer fingerprints, layer ids, the encoding's layout, the dataset's fingerprint that ingest
  computes, max length, shard count, command, version), `recoded_provenance` for `dflash recode` (the source's
  record with the new encoding's fields and `recoded_from`). pipeline/store.py writes it with its checksum
  (`write_root`) and reads it back checked (`read_root_attrs`: schema version and checksum); nothing else
  writes it.
- It is compared only here, each difference one line naming the key and both values: `provenance_differences`
  (IDENTITY_KEYS, what must match between a store and the run that continues it; `create_or_open_store`
  refuses a store made by another run), `config_differences` (a store against a training or eval config: target
  name and fingerprint, layer ids, hidden size, vocabulary, thinking mode), `export_differences` (against what a
  drafter export recorded) and `recode_source_problem` (a recode target made from another source).
- The frozen head (`STORE/frozen_head.safetensors`, pipeline/store.py) is written with a sidecar
  `frozen_head.safetensors.sha256` holding {"sha256", "bytes"} of the whole file: sidecar first, then the
  head, each replaced atomically, so a head written by this code always has its checksum beside it.
  `frozen_head_problem` reports a missing, changed (checksum) or unreadable head; `check_frozen_head` raises
  it as StoreDataError (training calls it at start, in a background thread: `start_frozen_head_check`, whose
  `wait()` raises the same error before `fit`). Heads of stores from before checksums (no
  "dflash_integrity" root attribute) and without a sidecar are accepted, unchecked. `load_frozen_head` is the
  one read of its tensors for training and eval. Given `to=(device, dtype)`, the check's thread also loads the
  checked head there once the check passed (issue 46: 2.7 s of a 27B run's fit set-up on the H100 host, now beside
  Lightning's import), and `load_frozen_head` of the same file takes those tensors, once; a load that fails in
  the thread leaves nothing behind, and the fit loads the head itself as before.
- `target_differences` compares a target checkpoint with the one a store was extracted from by fingerprint
  (pipeline.target.target_fingerprint, every key it returns), never by name. Training needs no target, so a
  target path that is not a local directory here is skipped with one line on stderr saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from pipeline import __version__
from pipeline import store as st
from pipeline.store_lock import being_created, creating
from pipeline.encoding import check as check_encoding
from pipeline.encoding import parts_spec
from pipeline.target import resolve_layer_ids, target_fingerprint, tokenizer_fingerprint

# ----------------------------------------------------------------------------------------------------------
# The root record: built, re-encoded, compared
# ----------------------------------------------------------------------------------------------------------


def _encoding_fields(encoding: str, num_layers: int, hidden: int) -> dict:
    """The record's fields that follow from the feature encoding (per token; see pipeline/encoding.py)."""
    return {"encoding": encoding, "feature_dtype": st.feature_dtype(encoding),
            "feature_layout": {k: [list(shape), dt] for k, (shape, dt) in parts_spec(encoding, num_layers, hidden).items()}}


def build_provenance(cfg, tokenizer, samples, num_shards: int, command: str, dataset_fingerprint: str,
                     precision: str = "bf16") -> dict:
    """The root record of the store `dflash extract` makes from `cfg` and the ingested `samples` (whose
    fingerprint data.ingest.dataset_fingerprint computes). StoreError for an encoding the target cannot take."""
    tfp = target_fingerprint(cfg.target.path)
    layer_ids = resolve_layer_ids(cfg.target.layer_ids, tfp["num_hidden_layers"], cfg.target.num_feature_layers)
    try:
        check_encoding(cfg.store.encoding, tfp["hidden_size"])
    except ValueError as e:
        raise st.StoreError(f"store.encoding: {e}") from None
    tok = tokenizer_fingerprint(tokenizer)
    tok["enable_thinking"] = cfg.data.enable_thinking
    encoding = _encoding_fields(cfg.store.encoding, len(layer_ids), tfp["hidden_size"])
    return {
        "schema_version": st.SCHEMA_VERSION,
        "dflash_version": __version__,
        "target": {"name": cfg.target.name, "path": cfg.target.path, **tfp, "precision": precision},
        "layer_ids": layer_ids,
        "hidden_size": tfp["hidden_size"],
        "encoding": encoding["encoding"],
        "feature_dtype": encoding["feature_dtype"],
        "feature_layout": encoding["feature_layout"],
        "chunk_tokens": cfg.store.chunk_tokens,
        "clevel": cfg.store.clevel,
        "tokenizer": tok,
        "dataset": {
            "fingerprint": dataset_fingerprint,
            "files": cfg.data.train_files + cfg.data.validation_files,
            "samples": len(samples),
            "tokens": int(sum(len(s.input_ids) for s in samples)),
            "validation_samples": sum(s.split == "validation" for s in samples),
        },
        "max_length": cfg.data.max_length,
        "num_shards": num_shards,
        "created_by": command,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def recoded_provenance(src_attrs: dict, src: str, encoding: str, clevel: Optional[int] = None) -> dict:
    """The root record of `dflash recode`'s DST: SRC's record with the new encoding's fields, its clevel (default
    SRC's) and `recoded_from` (SRC's path, encoding and creation time)."""
    prov = dict(src_attrs)
    prov.update(_encoding_fields(encoding, len(src_attrs["layer_ids"]), int(src_attrs["hidden_size"])))
    prov.update({"clevel": int(clevel if clevel is not None else src_attrs.get("clevel", 1)),
                 "recoded_from": {"path": str(src), "encoding": src_attrs["encoding"],
                                  "created_at": src_attrs.get("created_at")}})
    return prov


def recode_source_problem(stored: dict, src_attrs: dict, dst: str) -> Optional[str]:
    """Why an existing DST cannot be continued by a recode of a source with `src_attrs`, or None."""
    if stored.get("recoded_from", {}).get("encoding") not in (None, src_attrs["encoding"]):
        return f"{dst} was recoded from a different source; choose a new DST"
    return None


# Provenance keys that must match between a store and the run that writes to or trains from it.
IDENTITY_KEYS = (
    "target.config_sha256", "target.weights_sha256", "target.hidden_size", "target.vocab_size", "layer_ids",
    "encoding", "tokenizer.sha256", "tokenizer.chat_template_sha256", "tokenizer.enable_thinking",
    "dataset.fingerprint", "max_length", "num_shards", "target.precision",
)
# what a store written before a key existed holds for it (target.precision: every store before issue 45 was bf16)
LEGACY = {"target.precision": "bf16"}


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
        a = LEGACY.get(key) if a is None else a
        if b is None:
            continue
        if a != b:
            diffs.append(f"{key}: store has {a!r}, this run has {b!r}")
    return diffs


def create_or_open_store(path: str, provenance: dict) -> dict:
    """Create the root of a new store, or check that an existing one was made by the same run.

    Returns the stored provenance. Raises StoreError naming every difference otherwise.
    """
    # Runs that start on a new store at once (a second shell, the nodes of a multi-node extraction): one creates
    # the root under the creation lock, the others wait for it and compare. The order of the two looks matters:
    # a root that is not new was begun under that lock, so if the lock is gone by now, the root is finished.
    if st.is_new(path) or being_created(path):
        with creating(path):
            stored = st.read_root_attrs(path)
            if stored is None:
                return st.write_root(path, provenance)
    else:
        stored = st.read_root_attrs(path)
    diffs = provenance_differences(stored, provenance)
    if diffs:
        raise st.StoreError(
            f"the store at {path} was made by a different run:\n  " + "\n  ".join(diffs)
            + "\nUse a new --store path for this configuration, or rerun with the configuration that made it."
        )
    return stored


def config_differences(cfg, attrs: dict) -> tuple[list[int], list[str]]:
    """(the layer ids `cfg` resolves to on the store's target, one line per way the store at `attrs` does not fit
    `cfg`): target name and (a readable local target.path) fingerprint, layer ids, drafter hidden size, mask
    token within the vocabulary, thinking mode. Training and eval refuse a store with any."""
    t = attrs["target"]
    diffs = []
    if cfg.target.name and cfg.target.name != t["name"]:
        diffs.append(f"target: store was extracted from {t['name']!r}, config says {cfg.target.name!r}")
    diffs += target_differences(cfg.target.path, t)  # by fingerprint, when target.path is readable here
    expected_ids = resolve_layer_ids(cfg.target.layer_ids, t["num_hidden_layers"], cfg.target.num_feature_layers)
    if expected_ids != attrs["layer_ids"]:
        diffs.append(f"layer ids: store has {attrs['layer_ids']}, config gives {expected_ids}")
    if cfg.drafter.hidden_size != attrs["hidden_size"]:
        diffs.append(f"hidden size: store has {attrs['hidden_size']}, drafter.hidden_size is {cfg.drafter.hidden_size}")
    if not 0 <= cfg.drafter.mask_token_id < t["vocab_size"]:
        diffs.append(f"vocab: drafter.mask_token_id {cfg.drafter.mask_token_id} is outside the store's vocabulary of {t['vocab_size']}")
    thinking = attrs.get("tokenizer", {}).get("enable_thinking")
    if thinking is not None and bool(thinking) != cfg.data.enable_thinking:
        diffs.append(f"thinking mode: the store's conversations were rendered with enable_thinking={bool(thinking)}, "
                     f"data.enable_thinking is {cfg.data.enable_thinking} (the drafter must be served the way it "
                     "was trained)")
    return expected_ids, diffs


def export_differences(attrs: dict, exported_target: dict) -> list[str]:
    """One line per way the store's target differs from what a drafter export recorded of its own (name, vocab)."""
    t, mine = attrs["target"], exported_target or {}
    diffs = []
    if mine.get("name") and mine["name"] != t["name"]:
        diffs.append(f"target: store was extracted from {t['name']!r}, the drafter was trained for {mine['name']!r}")
    if mine.get("vocab_size") is not None and int(mine["vocab_size"]) != int(t["vocab_size"]):
        diffs.append(f"vocab: the store's target has {t['vocab_size']} tokens, the drafter was exported for "
                     f"{mine['vocab_size']}")
    return diffs


# ----------------------------------------------------------------------------------------------------------
# The frozen head: written, checked, read
# ----------------------------------------------------------------------------------------------------------

SIDECAR = ".sha256"


def _sha256_file(path: str) -> tuple[str, int]:
    """(sha256 hex, bytes) of a file. A local file is read in 256 MB blocks into one reused buffer: the check runs in
    a thread beside `dflash train`'s CPU-bound imports, and each block's read and hash hands the GIL back and forth;
    on the 2-core machine a 1.5 GB file hashed 1.3 s alone took 2.3 s beside a busy thread in 16 MB blocks and 1.9 s
    in 256 MB ones (issue 46: the head's check and load, 6.5 s alone on the GPU host, took ~12 s there)."""
    h, n = hashlib.sha256(), 0
    if not st.is_local(path):
        import fsspec

        with fsspec.open(path, "rb").open() as f:
            while block := f.read(16 << 20):
                h.update(block)
                n += len(block)
        return h.hexdigest(), n
    local = path.removeprefix("file://")
    buf = bytearray(max(1, min(256 << 20, os.path.getsize(local))))
    view = memoryview(buf)
    with open(local, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            h.update(view[:got])
            n += got
    return h.hexdigest(), n


def write_frozen_head(store_path: str, data: bytes) -> None:
    """Write the frozen head file and its checksum (sidecar first: a present head always has its checksum)."""
    head = st.frozen_head_path(store_path)
    record = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    st.write_bytes_atomic(head + SIDECAR, json.dumps(record).encode())
    st.write_bytes_atomic(head, data)


def copy_frozen_head(src: str, dst: str) -> None:
    """Copy src's head to dst (recode), checked against src's checksum first."""
    check_frozen_head(src)
    write_frozen_head(dst, st.read_bytes(st.frozen_head_path(src)))


def _has_integrity(store_path: str) -> bool:
    return st.INTEGRITY_ATTR in st.root_attributes(store_path)


def frozen_head_problem(store_path: str, deep: bool = False) -> Optional[str]:
    """Why the frozen head cannot be used, or None. deep: also load it and check names and finite values
    (`dflash verify`); otherwise only the checksum is compared (a few seconds for 5 GB)."""
    head = st.frozen_head_path(store_path)
    if not st.exists(head):
        return (f"{head} is missing: rerun the same `dflash extract` command (a worker writes it before its first "
                "batch, also for a finished store)")
    sidecar = head + SIDECAR
    if st.exists(sidecar):
        try:
            record = json.loads(st.read_bytes(sidecar))
            want, size = record["sha256"], int(record["bytes"])
        except (ValueError, KeyError, TypeError):
            return f"{sidecar} is damaged (not a checksum record); restore it, or delete the head and its sidecar and rerun `dflash extract`"
        got, n = _sha256_file(head)
        if (got, n) != (want, size):
            return (f"{head} does not match its recorded checksum ({n} bytes, sha256 {got[:16]}..; recorded {size} "
                    f"bytes, {want[:16]}..): it was changed or damaged after extraction. Delete it and its "
                    f"{SIDECAR} file and rerun the same `dflash extract` command to write it again")
    elif _has_integrity(store_path):
        return (f"{sidecar} is missing, so {head} cannot be checked; delete the head and rerun the same "
                "`dflash extract` command to write both")
    return _head_content_problem(store_path, head) if deep else None


def _head_content_problem(store_path: str, head: str) -> Optional[str]:
    import torch
    from safetensors.torch import load

    attrs = st.read_root_attrs(store_path, check=False) or {}
    target = attrs.get("target", {})
    try:
        tensors = load(st.read_bytes(head))
    except Exception as e:  # noqa: BLE001 - any parse failure
        return f"{head} cannot be read as safetensors ({type(e).__name__}: {e})"
    need = ["embed_tokens.weight", "norm.weight"] + ([] if target.get("tie_word_embeddings") else ["lm_head.weight"])
    lacking = [k for k in need if k not in tensors]
    if lacking:
        return f"{head} lacks {lacking}"
    vocab, hidden = target.get("vocab_size"), target.get("hidden_size")
    for k, t in tensors.items():
        if k != "norm.weight" and vocab and tuple(t.shape) != (vocab, hidden):
            return f"{head}: {k} has shape {tuple(t.shape)}, the store's target has vocab {vocab} x hidden {hidden}"
        if not torch.isfinite(t).all():
            return f"{head}: {k} holds non-finite values (NaN/Inf)"
    return None


def check_frozen_head(store_path: str) -> None:
    """Raise StoreDataError if the frozen head is missing or does not match its checksum."""
    problem = frozen_head_problem(store_path)
    if problem:
        raise st.StoreDataError(f"{problem}; `dflash verify {store_path}` checks the whole store")


_PRELOADED: dict[str, tuple] = {}  # head file -> (embed, head) loaded by the check's thread (start_frozen_head_check)
# the check's thread's timeline: ("began", wall time), then (step, seconds): checksum, CUDA start, load
HEAD_THREAD: list[tuple[str, float]] = []


def load_frozen_head(head_file: str, device, dtype) -> tuple:
    """(embed_tokens, lm_head) of a frozen head file (`st.frozen_head_path`) on `device` in `dtype`; a tied target
    stores the embedding once and both are then the same tensor. A local file is memory-mapped straight to the
    device (2 x 2.5 GB at the 27B shape). Check it first (`check_frozen_head`): this only reads. A head the check's
    thread loaded already (`to=`) is taken from there, moved where it was not loaded as asked."""
    pre = _PRELOADED.pop(head_file, None)
    if pre is not None:
        embed, head = (t.to(device, dtype) for t in pre)
        return embed, (embed if pre[1] is pre[0] else head)
    from safetensors.torch import load, load_file

    if st.is_local(head_file):
        t = load_file(head_file.removeprefix("file://"), device=str(device))
    else:
        t = load(st.read_bytes(head_file))
    embed = t["embed_tokens.weight"].to(device, dtype)
    head = t["lm_head.weight"].to(device, dtype) if "lm_head.weight" in t else embed
    return embed, head


def start_frozen_head_check(store_path: str, to: Optional[tuple] = None):
    """`check_frozen_head` in a background thread; returns `wait()`, which raises what the check raised.

    At the 27B shape the head is 5 GB: its sha256 took ~7 s on the development CPU and a few seconds on the
    H200 host, on every rank. hashlib and file reads release the GIL, so the check overlaps the rest of the
    set-up (model build, loaders, Trainer); training calls `wait()` before `fit`, so a changed or damaged
    head still stops the run before its first step. `to=(device, dtype)`: after a passing check the thread loads
    the head there for `load_frozen_head` (the module contract); `wait()` also waits for that load. On a GPU the
    thread first starts CUDA off the GIL (pipeline/cuda_start.py), so torch's own start, which holds the GIL, does
    not stop the main thread's imports. `HEAD_THREAD` keeps the thread's timeline for the start-up lines."""
    import threading
    import time

    failure: list[BaseException] = []
    head_file = st.frozen_head_path(store_path)
    HEAD_THREAD.clear()

    def check() -> None:
        t = time.time()
        HEAD_THREAD.append(("began", t))
        try:
            check_frozen_head(store_path)
        except BaseException as e:  # noqa: BLE001 (handed to wait(), re-raised in the caller's thread)
            failure.append(e)
            return
        HEAD_THREAD.append(("checksum", time.time() - t))
        if to is not None:
            try:
                device = to[0]
                if getattr(device, "type", str(device).split(":")[0]) == "cuda":  # off the GIL (issue 46)
                    from pipeline.cuda_start import start_cuda

                    t = time.time()
                    start_cuda(getattr(device, "index", None) or 0)
                    HEAD_THREAD.append(("CUDA start", time.time() - t))
                t = time.time()
                _PRELOADED[head_file] = load_frozen_head(head_file, *to)
                HEAD_THREAD.append(("load", time.time() - t))
            except Exception as e:  # noqa: BLE001 - the fit loads it itself and meets the error there
                print(f"train: the frozen head was not loaded ahead ({type(e).__name__}: {e}); the fit loads it",
                      file=sys.stderr, flush=True)

    thread = threading.Thread(target=check, name="frozen-head-sha256", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failure:
            raise failure[0]

    return wait


def target_differences(target_path: str, stored_target: dict, out=None) -> list[str]:
    """One line per fingerprint field where the checkpoint at `target_path` differs from the store's target.

    Only a local directory is fingerprinted (training must not download or need the target): otherwise one
    line on `out` says the check was skipped. Local rank > 0 (a DDP rank Lightning re-executed) skips it
    silently: rank 0 of the node already compared."""
    if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        return []
    d = Path(str(target_path))
    if not (d / "config.json").is_file():
        same = str(target_path) == str(stored_target.get("path"))
        print(f"train: target.path {target_path!r} is not a readable local checkpoint here, so the store's target "
              "fingerprint is not compared" + ("" if same else f" (the store was extracted from "
                                               f"{stored_target.get('path')!r}; names and shapes are compared)"),
              file=out or sys.stderr)
        return []
    fp = target_fingerprint(str(d))
    return [f"target.{k}: the store was extracted from a checkpoint with {stored_target[k]!r}, target.path "
            f"{target_path!r} has {v!r}" for k, v in fp.items() if k in stored_target and stored_target[k] != v]
