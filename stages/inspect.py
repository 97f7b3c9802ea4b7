"""`dflash inspect`: a store's attributes, sizes and progress, read through the schema module.

Contract: `inspect_store` prints samples, tokens, bytes on disk, bytes per token and compression ratio per array,
provenance and per-shard completion; it never modifies the store. Returns 0. `store_summary` is the same
figures as a dict (`dflash status` and the benches use it). The provenance and every progress record are read
checked (pipeline/store.py): one that fails its checksum raises StoreDataError naming it and `dflash verify`
(stages/verify.py), which reads every chunk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from pipeline import store as st


def _attrs(path: str, check: bool = True) -> dict:
    attrs = st.read_root_attrs(path, check=check)
    if attrs is None:
        raise st.StoreError(f"no store at {path}")
    return attrs


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
    attrs = _attrs(path)
    shards, per_array = [], {}
    total_tokens = total_samples = 0
    for state in st.read_all_progress(path):  # a record that fails its checksum stops here, named
        i, g, p = state.index, state.group, state.progress
        if not state.started:
            shards.append({"shard": i, "started": False, "done": False, "samples": 0, "tokens": 0})
            continue
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
