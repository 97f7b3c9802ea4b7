"""`dflash inspect`: a store's attributes, sizes and progress, read through the schema module.

Contract: `inspect_store` prints samples, tokens, bytes on disk, bytes per token and compression ratio per array,
per-shard completion and the provenance summarised (what made the store, from which target, tokenizer and data;
layer types counted, not listed); it never modifies the store. Returns 0. `store_summary` is the same figures as
a dict (`dflash status`, `dflash inspect --json` and the benches use it). A path that is another dflash
directory (a training run, an export, an eval output, a checkpoint) is refused as what it is (`not_a_store`). The provenance and every progress record are read
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
    other = not_a_store(path)
    if other:
        raise st.StoreError(other)
    attrs = st.read_root_attrs(path, check=check)
    if attrs is None:
        raise st.StoreError(f"no store at {path}")
    return attrs


def not_a_store(path: str) -> str | None:
    """The refusal of a local path that is another kind of dflash output than a store (None for anything else):
    a store command pointed at a run directory must say so, not call it a broken store to remove."""
    p = Path(path)
    if not st.is_local(path) or (p / "zarr.json").exists():
        return None
    if p.is_file() and p.suffix == ".ckpt":
        kind, hint = "a training checkpoint", f"evaluate it with `dflash eval {path}` or export it with `dflash export`"
    elif p.is_dir() and ((p / "checkpoints").is_dir() or (p / "progress.json").exists()):
        store = _run_store(p)
        kind = "a training run directory"
        hint = f"see it with `dflash status {path}`" + (f"; it trained on the store {store}" if store else "")
    elif p.is_dir() and (p / "model.safetensors").exists() and (p / "config.json").exists():
        kind, hint = "an exported drafter", f"evaluate it with `dflash eval {path}`"
    elif p.is_dir() and (p / "report.json").exists():
        kind, hint = "an eval output directory", f"its figures are in {p / 'report.json'}"
    else:
        return None
    return f"{path} is {kind}, not a store (this command reads a STORE.zarr that `dflash extract` wrote); {hint}"


def _run_store(run: Path) -> str | None:
    import yaml

    try:
        return (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("store", {}).get("path")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None


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


def inspect_store(path: str, out=sys.stdout, as_json: bool = False) -> int:
    s = store_summary(path)
    if as_json:  # `dflash inspect --json`: the same figures for a script, the provenance whole
        print(json.dumps(s, indent=1), file=out)
        return 0
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
    for line in provenance_lines(a):
        print(line, file=out)
    return 0


def _short(sha) -> str:
    return f"{str(sha)[:12]}..." if sha else "not recorded"


def provenance_lines(a: dict) -> list[str]:
    """The provenance in a few lines: what made the store and when, the target (path, checksums, layer types
    counted), the tokenizer and the data (files, samples, fingerprint)."""
    from collections import Counter

    t, tok, ds = a.get("target", {}), a.get("tokenizer", {}), a.get("dataset", {})
    types = ", ".join(f"{n} x {k}" for k, n in Counter(t.get("layer_types") or []).items()) or "not recorded"
    files = ds.get("files") or []
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    think = {True: "on", False: "off"}.get(tok.get("enable_thinking"), "not recorded")
    return [f"made by    dflash {a.get('dflash_version', '?')} (schema {a.get('schema_version', '?')}) at "
            f"{a.get('created_at', '?')}: {a.get('created_by', '?')}",
            f"target at  {t.get('path', '?')}  config {_short(t.get('config_sha256'))}  weights "
            f"{_short(t.get('weights_sha256'))} ({t.get('weights_hash', '?')})  layer types {types}",
            f"tokenizer  {tok.get('name', '?')}  {_short(tok.get('sha256'))}  chat template "
            f"{_short(tok.get('chat_template_sha256'))}  thinking {think}",
            f"data       {ds.get('samples', '?')} samples ({ds.get('validation_samples', 0)} validation), "
            f"{ds.get('tokens', '?')} tokens from {shown or 'no files recorded'}; fingerprint "
            f"{_short(ds.get('fingerprint'))}"]
