"""`dflash inspect` and `dflash verify`: read a store's attributes and chunks through the schema module.

Contract:
- `inspect_store` prints samples, tokens, bytes on disk, bytes per token and compression ratio per array,
  provenance and per-shard completion; it never modifies the store. Returns 0.
- `verify_store` reads every chunk covering committed rows (crc32c checksums are checked by zarr on
  decode), and checks: every such chunk exists (zarr would silently read a missing one as zeros), array
  lengths cover the commit, sample offsets are contiguous, token ids are in the vocabulary, features are
  finite, sample ids are unique, the frozen head is present, every shard finished. Exit 0 when clean,
  1 with a report of every problem otherwise.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline import store as st
from pipeline.encoding import decode, from_storage, part_names


def _open(path: str):
    import zarr

    attrs = st.read_root_attrs(path)
    if attrs is None:
        raise st.StoreError(f"no store at {path}")
    return attrs, zarr.open_group(path, mode="r")


def _disk_bytes(path: str, rel: str) -> int:
    if st.is_local(path):
        d = Path(path) / rel
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.exists() else 0
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return int(fs.du(p.rstrip("/") + "/" + rel))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def store_summary(path: str) -> dict:
    attrs, root = _open(path)
    shards, per_array = [], {}
    total_tokens = total_samples = 0
    for i in range(attrs["num_shards"]):
        try:
            g = root[st.shard_name(i)]
        except KeyError:
            shards.append({"shard": i, "started": False, "done": False, "samples": 0, "tokens": 0})
            continue
        p = st.Progress.from_attrs(dict(g.attrs))
        shards.append({"shard": i, "started": True, "done": p.done, "samples": p.committed_samples,
                       "tokens": p.committed_tokens, "planned_samples": p.planned_samples,
                       "planned_tokens": p.planned_tokens, "nonfinite_skipped": p.nonfinite_skipped})
        total_tokens += p.committed_tokens
        total_samples += p.committed_samples
        for name in g.array_keys():
            a = g[name]
            rows = p.committed_tokens if name in st.token_arrays(attrs["encoding"]) else p.committed_samples
            raw = rows * int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize
            e = per_array.setdefault(name, {"raw_bytes": 0, "disk_bytes": 0})
            e["raw_bytes"] += raw
            e["disk_bytes"] += _disk_bytes(path, f"{st.shard_name(i)}/{name}")
    disk = sum(e["disk_bytes"] for e in per_array.values())
    head = st.frozen_head_path(path)
    return {"path": path, "provenance": attrs, "shards": shards, "arrays": per_array, "samples": total_samples,
            "tokens": total_tokens, "disk_bytes": disk, "frozen_head": st.exists(head),
            "complete": all(s["done"] for s in shards)}


def inspect_store(path: str, out=sys.stdout) -> int:
    s = store_summary(path)
    a = s["provenance"]
    tok = max(1, s["tokens"])
    raw_bf16 = len(a["layer_ids"]) * a["hidden_size"] * 2
    print(f"store      {path}", file=out)
    print(f"target     {a['target']['name']}  ({a['target']['model_type']}, {a['target']['num_hidden_layers']} layers, "
          f"hidden {a['hidden_size']}, vocab {a['target']['vocab_size']})", file=out)
    print(f"layers     {a['layer_ids']}   encoding {a['encoding']}   max_length {a['max_length']}", file=out)
    print(f"samples    {s['samples']} ({a['dataset']['validation_samples']} validation planned)   tokens {s['tokens']}", file=out)
    print(f"on disk    {_human(s['disk_bytes'])}   {s['disk_bytes'] / tok:.1f} B/token   "
          f"(raw bf16 features: {raw_bf16} B/token, {raw_bf16 / max(1e-9, s['disk_bytes'] / tok):.2f}x smaller)", file=out)
    print("arrays     name            raw         disk        B/token   ratio", file=out)
    for name, e in sorted(s["arrays"].items()):
        ratio = e["raw_bytes"] / e["disk_bytes"] if e["disk_bytes"] else float("nan")
        print(f"           {name:<15} {_human(e['raw_bytes']):<11} {_human(e['disk_bytes']):<11} "
              f"{e['disk_bytes'] / tok:<9.1f} {ratio:.2f}x", file=out)
    print("shards", file=out)
    for sh in s["shards"]:
        state = "done" if sh["done"] else ("running/stopped" if sh["started"] else "not started")
        pct = 100 * sh["tokens"] / max(1, sh.get("planned_tokens") or 1) if sh["started"] else 0.0
        print(f"           [{sh['shard']}] {state:<16} {sh['samples']} samples, {sh['tokens']} tokens ({pct:.0f}%)"
              + (f", {sh['nonfinite_skipped']} skipped (NaN/Inf)" if sh.get("nonfinite_skipped") else ""), file=out)
    print(f"frozen head {'present' if s['frozen_head'] else 'MISSING'}   complete: {'yes' if s['complete'] else 'no'}", file=out)
    print("provenance " + json.dumps({k: a[k] for k in ("target", "tokenizer", "dataset", "created_by", "created_at",
                                                          "dflash_version", "schema_version")}, indent=1), file=out)
    return 0


def _chunk_exists(path: str, array_rel: str, chunk_index: int, ndim: int) -> bool:
    key = "c/" + "/".join([str(chunk_index)] + ["0"] * (ndim - 1))
    return st.exists(str(path).rstrip("/") + f"/{array_rel}/{key}")


def verify_store(path: str, out=sys.stdout) -> int:
    attrs, root = _open(path)
    problems: list[str] = []
    vocab = attrs["target"]["vocab_size"]
    enc = attrs["encoding"]
    ids_seen: set[int] = set()
    checked_tokens = 0
    for i in range(attrs["num_shards"]):
        name = st.shard_name(i)
        try:
            g = root[name]
        except KeyError:
            problems.append(f"shard {i}: not started")
            continue
        p = st.Progress.from_attrs(dict(g.attrs))
        if not p.done:
            problems.append(f"shard {i}: not finished ({p.committed_samples}/{p.planned_samples} samples committed)")
        n, T = p.committed_samples, p.committed_tokens
        arrays = {k: g[k] for k in g.array_keys()}
        token_arrays = st.token_arrays(enc)
        for k in (*token_arrays, "sample_start", "sample_length", "sample_id", "split"):
            if k not in arrays:
                problems.append(f"shard {i}: array {k} missing")
                continue
            rows = T if k in token_arrays else n
            a = arrays[k]
            if a.shape[0] < rows:
                problems.append(f"shard {i}: {k} has {a.shape[0]} rows but {rows} are committed (truncated array)")
                continue
            for c in range(math.ceil(rows / a.chunks[0])):
                if not _chunk_exists(path, f"{name}/{k}", c, a.ndim):
                    problems.append(f"shard {i}: {k} chunk {c} is missing (rows {c * a.chunks[0]}..)")
        if any(x.startswith(f"shard {i}:") and ("missing" in x or "truncated" in x) for x in problems):
            continue
        try:
            starts, lengths = arrays["sample_start"][:n], arrays["sample_length"][:n]
            sids = arrays["sample_id"][:n]
            if n and (starts[0] != 0 or np.any(starts[1:] != starts[:-1] + lengths[:-1]) or starts[-1] + lengths[-1] != T):
                problems.append(f"shard {i}: sample offsets are not contiguous or do not add up to {T} tokens")
            dup = len(sids) - len(set(sids.tolist()))
            if dup or ids_seen.intersection(sids.tolist()):
                problems.append(f"shard {i}: duplicate sample ids")
            ids_seen.update(sids.tolist())
            rows = arrays["features"].chunks[0]
            for t0 in range(0, T, rows * 8):
                sl = slice(t0, min(T, t0 + rows * 8))
                toks = arrays["tokens"][sl]
                if toks.size and (toks.min() < 0 or toks.max() >= vocab):
                    problems.append(f"shard {i}: token ids out of range [0, {vocab}) at rows {sl.start}..{sl.stop}")
                    break
                arrays["loss_mask"][sl]
                x = decode({k: from_storage(arrays[k][sl]) for k in part_names(enc)}, enc, torch.float32)
                if not torch.isfinite(x).all():
                    problems.append(f"shard {i}: non-finite features in rows {sl.start}..{sl.stop}")
                    break
                checked_tokens += sl.stop - sl.start
        except Exception as e:  # noqa: BLE001 - checksum mismatch, unreadable chunk, ...
            problems.append(f"shard {i}: unreadable data ({type(e).__name__}: {e})")
    if not st.exists(st.frozen_head_path(path)):
        problems.append(f"frozen head {st.FROZEN_HEAD_FILE} is missing")
    if problems:
        print(f"verify: {path} has {len(problems)} problem(s):", file=out)
        for pr in problems:
            print(f"  - {pr}", file=out)
        return 1
    print(f"verify: {path} is valid: {len(ids_seen)} samples, {checked_tokens} tokens, every chunk read and checked", file=out)
    return 0
