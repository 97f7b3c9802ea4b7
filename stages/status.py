"""`dflash status RUN_OR_STORE`: state, progress, throughput and ETA of an extraction or a training run, read
from its files only (works from another shell while the run goes on, and after it stopped).

Contract: a store is recognised by its dflash root attributes and reports per-shard commits plus the
parent's last status line (STORE/logs/extract-status.json); a run directory by RUN/progress.json and its
checkpoints. A recorded "running" state whose process no longer exists on this host is shown as
"stopped (process gone)". Exit 0 when the state could be read.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipeline import store as st
from pipeline.store_lock import pid_alive


def _age(t: float) -> str:
    s = int(time.time() - t)
    return f"{s}s ago" if s < 120 else f"{s // 60} min ago"


def show_status(path: str, out=sys.stdout) -> int:
    p = Path(path)
    attrs = None
    try:
        attrs = st.read_root_attrs(path)
    except st.StoreError:
        attrs = None
    if attrs is not None:
        from stages.inspect import store_summary

        s = store_summary(path)
        status = p / "logs" / "extract-status.json"
        rec = json.loads(status.read_text()) if status.exists() else {}
        state = rec.get("state", "unknown")
        if state == "running" and not pid_alive(int(rec.get("pid", -1))):
            state = "stopped (process gone)"
        if s["complete"]:
            state = "finished"
        print(f"extraction {path}: {state}" + (f", last update {_age(rec['time'])}" if rec.get("time") else ""), file=out)
        if rec.get("line"):
            print(f"  {rec['line']}", file=out)
        if rec.get("error"):
            print(f"  error: {rec['error']}", file=out)
        for sh in s["shards"]:
            pct = 100 * sh["tokens"] / max(1, sh.get("planned_tokens") or 1)
            print(f"  shard {sh['shard']}: {'done' if sh['done'] else 'not done'}, {sh['samples']} samples, "
                  f"{sh['tokens']} tokens committed ({pct:.0f}%)", file=out)
        return 0
    prog = p / "progress.json"
    if prog.exists():
        rec = json.loads(prog.read_text())
        ckpts = sorted((p / "checkpoints").glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
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
