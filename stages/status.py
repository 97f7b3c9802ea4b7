"""`dflash status RUN_OR_STORE`: state, progress, throughput and ETA of an extraction or a training run, read
from its files only (works from another shell while the run goes on, and after it stopped).

Contract: a store is recognised by its dflash root attributes and reports per-shard commits plus the
parents' last status lines (STORE/logs/extract-status.json, and extract-status-from-NNNNN.json of each call
that ran a set of shards: one per node); every shard's line names the host holding its lock and that lock's
heartbeat age (pipeline/store_lock.py), its tokens/s and ETA from the newest status record covering it. A
run directory by RUN/progress.json and its checkpoints. A recorded "running" state whose process no longer
exists on this host (or, from another host, whose record is older than a lock's ttl) is shown as "stopped
(process gone)". Exit 0 when the state could be read. `as_json` (`dflash status --json`): the same state as one JSON
object on stdout: {"kind": "extraction", state, samples, tokens, complete, shards, records} or {"kind": "training",
progress.json's fields, last_checkpoint}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import socket

from pipeline import store as st
from pipeline.procinfo import pid_alive
from pipeline.store_lock import DEFAULT_TTL, holder


def _age(t: float) -> str:
    s = int(time.time() - t)
    return f"{s}s ago" if s < 120 else f"{s // 60} min ago"


def _status_records(logs: Path) -> list[dict]:
    """Every extraction call's last status record (the whole store's, and one per node's shard set)."""
    out = []
    for f in sorted(logs.glob("extract-status*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # being replaced right now
    return out


def _state(rec: dict) -> str:
    state = rec.get("state", "unknown")
    if state != "running":
        return state
    here = rec.get("host", socket.gethostname()) == socket.gethostname()
    alive = pid_alive(int(rec.get("pid", -1))) if here else time.time() - rec.get("time", 0) < DEFAULT_TTL
    return state if alive else "stopped (process gone)"


def _shard_detail(path: str, sh: dict, recs: list[dict]) -> str:
    """`, on HOST (heartbeat 5s ago), 1.2K tok/s, ETA 3m10s` for a shard being written; '' for others."""
    if sh["done"]:
        return ""
    from pipeline.lifecycle import fmt_eta, fmt_rate

    parts = []
    lock = holder(path, sh["shard"])
    if lock:
        parts.append(f"on {lock.get('host', '?')} (heartbeat {_age(float(lock.get('heartbeat', 0)))})")
    mine = [r for r in recs if str(sh["shard"]) in r.get("shards", {}) and _state(r) == "running"]
    if mine:
        m = max(mine, key=lambda r: r.get("time", 0))["shards"][str(sh["shard"])]
        if "rate_tok_s" in m:
            parts.append(f"{fmt_rate(m['rate_tok_s'])} tok/s, ETA {fmt_eta(m.get('eta_s'))}")
    return (", " + ", ".join(parts)) if parts else ""


def show_status(path: str, out=sys.stdout, as_json: bool = False) -> int:
    p = Path(path)
    attrs = None
    try:
        attrs = st.read_root_attrs(path)
    except st.StoreError:
        attrs = None
    if attrs is not None:
        from stages.inspect import store_summary

        s = store_summary(path)
        recs = _status_records(p / "logs")
        rec = max(recs, key=lambda r: r.get("time", 0)) if recs else {}
        running = [r for r in recs if _state(r) == "running"]
        state = _state(rec) if recs else "unknown"  # the newest call's
        if running:  # several calls (one per node's shard set): running while any of them runs
            state = "running" + (f" ({len(running)} of {len(recs)} extraction calls)" if len(recs) > 1 else "")
        if s["complete"]:
            state = "finished"
        if as_json:
            print(json.dumps({"kind": "extraction", "path": path, "state": state, "samples": s["samples"],
                              "tokens": s["tokens"], "complete": s["complete"], "shards": s["shards"],
                              "records": recs}, indent=1), file=out)
            return 0
        print(f"extraction {path}: {state}" + (f", last update {_age(rec['time'])}" if rec.get("time") else ""), file=out)
        for r in sorted(recs, key=lambda r: r.get("time", 0)):
            if r.get("line"):
                print(f"  {r['line']}" + (f"  ({r['host']})" if len(recs) > 1 and r.get("host") else ""), file=out)
            if r.get("error"):
                print(f"  error: {r['error']}", file=out)
        for sh in s["shards"]:
            pct = 100 * sh["tokens"] / max(1, sh.get("planned_tokens") or 1)
            print(f"  shard {sh['shard']}: {'done' if sh['done'] else 'not done'}, {sh['samples']} samples, "
                  f"{sh['tokens']} tokens committed ({pct:.0f}%){_shard_detail(path, sh, recs)}", file=out)
        return 0
    prog = p / "progress.json"
    if prog.exists():
        rec = json.loads(prog.read_text())
        ckpts = sorted((p / "checkpoints").glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
        if as_json:
            print(json.dumps({"kind": "training", "path": path, **rec,
                              "last_checkpoint": str(ckpts[-1]) if ckpts else None}, indent=1), file=out)
            return 0
        print(f"training {path}: {rec['state']}, step {rec.get('step')}"
              + (f"/{rec['total_steps']}" if rec.get("total_steps") else "") + f", last update {_age(rec['time'])}", file=out)
        if rec.get("steps_per_s"):
            print(f"  {rec['steps_per_s']:.2f} steps/s, {rec['tokens_per_s']:,.0f} tokens/s, ETA {rec['eta_s'] / 60:.1f} min",
                  file=out)
        d = rec.get("data", {})
        if d.get("stream_epoch") and "readable_samples" in d:  # a run following a store still being written
            behind = max(0, d["readable_samples"] - d["global_batches_done"] * d["batch_size"])
            print(f"  following the store: first epoch in commit order, {behind} committed samples not trained yet"
                  + ("" if d.get("store_final") else ", extraction still writing"), file=out)
        for k, v in sorted(rec.get("metrics", {}).items()):
            print(f"  {k} = {v:.4f}", file=out)
        if rec.get("error"):
            print(f"  error: {rec['error']}", file=out)
        if ckpts:
            print(f"  last checkpoint: {ckpts[-1]} ({_age(ckpts[-1].stat().st_mtime)}); resume with --resume", file=out)
        return 0
    raise FileNotFoundError(f"{path} is neither a dflash store nor a training run directory (no progress.json yet)")
