"""What an evaluated drafter achieved, kept with it (issue 42 items 2 and 6): the τ record and τ by context length.

Contract:
- Who writes dflash_tau.json (pipeline/tau_record.py: TAU_FILE, the record's keys, `write_tau` / `read_tau`):
  * `dflash eval` (`record_eval`) writes it into its OUT directory beside report.json. OUT defaults to RUN/eval,
    so the eval of a run's checkpoint or of RUN/export leaves it in the run. When the drafter evaluated is an
    export directory, the record is written into that directory too and its checksums.sha256 entry added
    (pipeline/export_dir.py `add_checksum`; the rest of the directory was verified when eval loaded it). A later
    eval replaces the record: it says what the latest eval measured.
  * `dflash export` (stages/export.py, `record_for_export`) copies into the new export the record of RUN/eval
    when that eval measured the checkpoint's own step of the same run (RUN/eval/report.json's drafter origin);
    otherwise the export's record is {"evaluated": false, "reason": ...} saying why and how to get one. The
    export writes it before its checksums, so checksums.sha256 covers it.
- τ by context length (`by_context`): a measurement's context is the number of tokens before its block. Offline,
  an anchor's position (the uniform anchors, `offline_eval`); online, the position of a verify step's last
  verified token (the prompt's length for the first step, then plus each step's tokens). Per bucket of
  pipeline/tau_record.py's CONTEXT_BUCKETS with data: the mean acceptance length offline (`tau_offline`) and per
  verify step online (`tau_online`), None where that side has none, and n = offline blocks + online steps.
- Fingerprints: the prompt set's is the sha256 of the held-out prompts' messages as JSON with sorted keys (the
  eval.num_prompts prompts `--online` decodes, stages/eval_online.py `heldout_prompts`); the target's is its
  weights' sha256 (pipeline.target.target_fingerprint), from the store's record when the target is not readable.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional

from pipeline.tau_record import CONTEXT_BUCKETS, TAU_FILE, context_bucket, read_tau, write_tau


def bucket_taus(pairs: Iterable[tuple[int, int]]) -> dict[str, dict]:
    """(context length, acceptance length) pairs -> {bucket label: {"tau", "n"}}, buckets with data only, in
    CONTEXT_BUCKETS order."""
    sums: dict[str, list] = {}
    for ctx, length in pairs:
        s = sums.setdefault(context_bucket(int(ctx)), [0, 0])
        s[0] += int(length)
        s[1] += 1
    return {label: {"tau": round(sums[label][0] / sums[label][1], 4), "n": sums[label][1]}
            for label, _lo, _hi in CONTEXT_BUCKETS if label in sums}


def online_pairs(per_prompt: list[dict]) -> list[tuple[int, int]]:
    """(context, tokens of the step) of every verify step of the online eval's prompts."""
    out = []
    for p in per_prompt:
        pos = int(p["prompt_tokens"])
        for step in p.get("acceptance_lengths") or []:
            out.append((pos, int(step)))
            pos += int(step)
    return out


def by_context(report: dict) -> dict[str, dict]:
    """The record's by_context from an eval report (its offline["by_context"] and online per_prompt)."""
    off = (report.get("offline") or {}).get("by_context") or {}
    on = bucket_taus(online_pairs((report.get("online") or {}).get("per_prompt") or []))
    return {label: {"tau_offline": (off.get(label) or {}).get("tau"), "tau_online": (on.get(label) or {}).get("tau"),
                    "n": (off.get(label) or {}).get("n", 0) + (on.get(label) or {}).get("n", 0)}
            for label, _lo, _hi in CONTEXT_BUCKETS if label in off or label in on}


def describe_by_context(table: dict[str, dict]) -> str:
    """One line: 'tau by context: <512 offline 2.10 online 1.95 (n 40); ...'."""
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    return "tau by context: " + "; ".join(f"{k} offline {f(v['tau_offline'])} online {f(v['tau_online'])} (n {v['n']})"
                                          for k, v in table.items())


def prompt_fingerprint(prompts: list) -> str:
    """sha256 of the prompts' messages (JSON, sorted keys)."""
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()


def _prompt_fp(cfg) -> Optional[str]:
    from stages.eval_online import EvalError, heldout_prompts

    try:
        return prompt_fingerprint([m for _sid, m in heldout_prompts(cfg, cfg.eval.num_prompts)])
    except (EvalError, OSError, ValueError):
        return None


def _target_fp(cfg, store_attrs: Optional[dict]) -> Optional[str]:
    from pipeline.target import target_fingerprint

    try:
        return target_fingerprint(cfg.target.path)["weights_sha256"]
    except (OSError, ValueError, KeyError):
        return ((store_attrs or {}).get("target") or {}).get("weights_sha256")


def build_record(report: dict, cfg, store_attrs: Optional[dict] = None) -> dict:
    """The τ record of this eval (pipeline/tau_record.py's keys)."""
    off, on = report.get("offline") or {}, report.get("online") or {}
    return {"schema": 1, "evaluated": True, "reason": None,
            "tau_offline": off.get("tau"), "tau_online": on.get("tau"),
            "tokens_per_target_forward": on.get("tokens_per_target_forward"),
            "block_size": int(report["drafter"]["block_size"]), "temperature": float(cfg.eval.temperature),
            "prompt_fingerprint": _prompt_fp(cfg), "target_fingerprint": _target_fp(cfg, store_attrs),
            "by_context": by_context(report)}


def unevaluated(reason: str, block_size: int, temperature: float = 0.0) -> dict:
    """The record of an export that no eval measured: evaluated false, with the reason and the fix."""
    return {"schema": 1, "evaluated": False, "reason": reason, "tau_offline": None, "tau_online": None,
            "tokens_per_target_forward": None, "block_size": int(block_size), "temperature": float(temperature),
            "prompt_fingerprint": None, "target_fingerprint": None, "by_context": {}}


def record_eval(report: dict, cfg, out_dir: Path, src, store_attrs: Optional[dict] = None) -> list[Path]:
    """Write the record into OUT and, for an export directory, into it (its checksums updated). Returns the paths."""
    from pipeline.export_dir import add_checksum

    from stages.eval_online import log

    record = build_record(report, cfg, store_attrs)
    written = [write_tau(out_dir, record)]
    if src.kind == "export":
        try:
            written.append(write_tau(src.path, record))
            add_checksum(Path(src.path), TAU_FILE)
        except OSError as e:  # a read-only export (a hub cache): the record beside the report stands
            log(f"eval: WARNING: could not record tau in the export {src.path} ({e}); the record is {written[0]}")
    return written


def record_for_export(ckpt_path: str, step: int, block_size: int) -> dict:
    """The record a `dflash export` of the checkpoint (at `step`) writes: its run's eval of that step, else why not."""
    ckpt = Path(ckpt_path).resolve()
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    how = "run `dflash eval OUT --online` on the export to record it"
    if run is None:
        return unevaluated(f"the checkpoint {ckpt_path} is not in a run directory and was not evaluated; {how}",
                           block_size)
    from pipeline.errors import UserError

    try:
        record, report = read_tau(run / "eval"), run / "eval" / "report.json"
    except UserError as e:  # a malformed record never blocks an export; it is named instead
        return unevaluated(f"the run's eval record is unreadable ({e}); {how}", block_size)
    if record is None or not report.is_file():
        return unevaluated(f"no `dflash eval` of the run {run} yet ({run / 'eval' / TAU_FILE} is absent); {how}",
                           block_size)
    try:
        origin = json.loads(report.read_text())["drafter"].get("origin") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        origin = {}
    if origin.get("step") is None or int(origin["step"]) != int(step):
        return unevaluated(f"the run's eval ({run / 'eval'}) measured step {origin.get('step', '?')}, not this "
                           f"checkpoint's step {step}; {how}", block_size)
    return record
