"""What a store says about where it came from, and that its frozen head is intact.

Contract:
- The frozen head (`STORE/frozen_head.safetensors`, pipeline/store.py) is written with a sidecar
  `frozen_head.safetensors.sha256` holding {"sha256", "bytes"} of the whole file: sidecar first, then the
  head, each replaced atomically, so a head written by this code always has its checksum beside it.
  `frozen_head_problem` reports a missing, changed (checksum) or unreadable head; `check_frozen_head` raises
  it as StoreDataError (training calls it at start, in a background thread: `start_frozen_head_check`, whose
  `wait()` raises the same error before `fit`). Heads of stores from before checksums (no
  "dflash_integrity" root attribute) and without a sidecar are accepted, unchecked.
- `target_differences` compares a target checkpoint with the one a store was extracted from by fingerprint
  (pipeline.target.target_fingerprint, every key it returns), never by name. Training needs no target, so a
  target path that is not a local directory here is skipped with one line on stderr saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

from pipeline import store as st

SIDECAR = ".sha256"


def _sha256_file(path: str) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    if st.is_local(path):
        f = open(path.removeprefix("file://"), "rb")
    else:
        import fsspec

        f = fsspec.open(path, "rb").open()
    with f:
        while block := f.read(16 << 20):
            h.update(block)
            n += len(block)
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
    import zarr

    return st.INTEGRITY_ATTR in dict(zarr.open_group(store_path, mode="r").attrs)


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


def start_frozen_head_check(store_path: str):
    """`check_frozen_head` in a background thread; returns `wait()`, which raises what the check raised.

    At the 27B shape the head is 5 GB: its sha256 took ~7 s on the development CPU and a few seconds on the
    H200 host, on every rank. hashlib and file reads release the GIL, so the check overlaps the rest of the
    set-up (model build, loaders, Trainer); training calls `wait()` before `fit`, so a changed or damaged
    head still stops the run before its first step."""
    import threading

    failure: list[BaseException] = []

    def check() -> None:
        try:
            check_frozen_head(store_path)
        except BaseException as e:  # noqa: BLE001 (handed to wait(), re-raised in the caller's thread)
            failure.append(e)

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
    from pipeline.target import target_fingerprint

    fp = target_fingerprint(str(d))
    return [f"target.{k}: the store was extracted from a checkpoint with {stored_target[k]!r}, target.path "
            f"{target_path!r} has {v!r}" for k, v in fp.items() if k in stored_target and stored_target[k] != v]
