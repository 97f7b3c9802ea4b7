"""The τ record of an export: what eval measured of the drafter, kept in the export directory (issue 42 item 2).

Contract (shared by stages/eval_record.py, which writes it, and stages/serve_check.py, which compares a serving
engine's acceptance with it):
- The file is `TAU_FILE` (dflash_tau.json) in an export directory (or an eval's OUT); an export's
  checksums.sha256 covers it (pipeline/export_dir.py).
- Its keys are exactly `RECORD_KEYS`: {"schema": 1, "evaluated": bool, "reason": str|None (why not evaluated),
  "tau_offline": float|None, "tau_online": float|None, "tokens_per_target_forward": float|None,
  "block_size": int, "temperature": float, "prompt_fingerprint": str|None, "target_fingerprint": str|None,
  "by_context": {bucket label: {"tau_offline": float|None, "tau_online": float|None, "n": int}}}.
  A record that is not evaluated has a reason; bucket labels are those of `CONTEXT_BUCKETS`.
- `write_tau` validates the record and replaces the file atomically (a reader never sees half of it);
  `read_tau` returns None when the file is absent and raises one-line `TauRecordError` (a UserError) naming the
  file, the problem and the fix when it is malformed.
- `context_bucket(n)`: the label of the bucket holding a context of n tokens (half-open [lo, hi) ranges).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from .errors import UserError

TAU_FILE = "dflash_tau.json"
SCHEMA = 1
CONTEXT_BUCKETS = (("<512", 0, 512), ("512-2K", 512, 2048), ("2K-8K", 2048, 8192), (">8K", 8192, None))
RECORD_KEYS = ("schema", "evaluated", "reason", "tau_offline", "tau_online", "tokens_per_target_forward",
               "block_size", "temperature", "prompt_fingerprint", "target_fingerprint", "by_context")
BUCKET_KEYS = ("tau_offline", "tau_online", "n")
_FIX = "re-run `dflash eval DRAFTER --online` to write it again"


class TauRecordError(UserError, ValueError):
    """A dflash_tau.json that is not a valid τ record; the message names the file, the key and the fix."""


def context_bucket(n_context_tokens: int) -> str:
    """The CONTEXT_BUCKETS label for a context of n tokens (negative counts are refused)."""
    n = int(n_context_tokens)
    if n < 0:
        raise ValueError(f"context_bucket: a context length cannot be negative ({n})")
    for label, lo, hi in CONTEXT_BUCKETS:
        if n >= lo and (hi is None or n < hi):
            return label
    raise AssertionError("CONTEXT_BUCKETS cover every length")  # pragma: no cover


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _opt_num(x) -> bool:
    return x is None or _num(x)


def _opt_str(x) -> bool:
    return x is None or isinstance(x, str)


def problem(record) -> Optional[str]:
    """What is wrong with a τ record (None when it is valid)."""
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    missing = [k for k in RECORD_KEYS if k not in record]
    unknown = sorted(k for k in record if k not in RECORD_KEYS)
    if missing or unknown:
        return f"missing keys {missing}" if missing else f"unknown keys {unknown}"
    if record["schema"] != SCHEMA:
        return f"schema {record['schema']!r} (this dflash reads schema {SCHEMA})"
    checks = (("evaluated", isinstance(record["evaluated"], bool), "true or false"),
              ("reason", _opt_str(record["reason"]), "a string or null"),
              ("tau_offline", _opt_num(record["tau_offline"]), "a number or null"),
              ("tau_online", _opt_num(record["tau_online"]), "a number or null"),
              ("tokens_per_target_forward", _opt_num(record["tokens_per_target_forward"]), "a number or null"),
              ("block_size", isinstance(record["block_size"], int) and not isinstance(record["block_size"], bool)
               and record["block_size"] > 0, "a positive integer"),
              ("temperature", _num(record["temperature"]) and record["temperature"] >= 0, "a number >= 0"),
              ("prompt_fingerprint", _opt_str(record["prompt_fingerprint"]), "a string or null"),
              ("target_fingerprint", _opt_str(record["target_fingerprint"]), "a string or null"),
              ("by_context", isinstance(record["by_context"], dict), "an object of context buckets"))
    for key, ok, want in checks:
        if not ok:
            return f"{key} is {record[key]!r}, not {want}"
    if not record["evaluated"] and not record["reason"]:
        return "evaluated is false but no reason says why"
    labels = [b[0] for b in CONTEXT_BUCKETS]
    for label, b in record["by_context"].items():
        if label not in labels:
            return f"by_context has the bucket {label!r}, not one of {labels}"
        if not isinstance(b, dict) or sorted(b) != sorted(BUCKET_KEYS):
            return f"by_context[{label!r}] is {b!r}, not an object with the keys {list(BUCKET_KEYS)}"
        if not (_opt_num(b["tau_offline"]) and _opt_num(b["tau_online"]) and isinstance(b["n"], int)
                and not isinstance(b["n"], bool) and b["n"] >= 0):
            return f"by_context[{label!r}] is {b!r}: taus must be numbers or null and n a count"
    return None


def write_tau(export_dir, record: dict) -> Path:
    """Validate `record` and write it as export_dir/dflash_tau.json atomically; returns the file's path."""
    bad = problem(record)
    path = Path(export_dir) / TAU_FILE
    if bad:
        raise TauRecordError(f"refusing to write the tau record {path}: {bad}; this is a bug in its writer")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{TAU_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_tau(export_dir) -> Optional[dict]:
    """export_dir/dflash_tau.json as a dict; None when absent; TauRecordError (one line) when malformed."""
    path = Path(export_dir) / TAU_FILE
    if not path.exists():
        return None
    if not path.is_file():
        raise TauRecordError(f"{path} is not a regular file; remove it and {_FIX}")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TauRecordError(f"{path} is not readable JSON ({str(e).splitlines()[0]}); {_FIX}") from None
    bad = problem(record)
    if bad:
        raise TauRecordError(f"{path} is not a valid tau record: {bad}; {_FIX}")
    return record
