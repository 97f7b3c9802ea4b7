"""What both regeneration engines share: the engine interface, the turn-by-turn driver, and the commit log.

Contract:
- An engine has `generate(prompts: list[Prompt]) -> list[Reply] | None` (None: stopped, nothing to keep).
  `Prompt.ids` is the prompt rendered by ingest's renderer (`data.prompts.render_prompt_ids`); the embedded
  engine generates from the ids, the server engine sends the messages and checks the server's prompt token
  count against len(ids). Replies come back in prompt order.
- `regenerate_batch` answers a batch of conversations turn by turn: round k sends turn k of every
  conversation still going, built from its segments and the target's own earlier responses. A conversation
  ends early (recorded in its row) at a prompt over max_prompt_tokens, an empty response (the model's own
  answer), or a response cut at max_new_tokens (kept, or dropped with keep_truncated=false): these repeat on a
  rerun, so their rows are committed. A reply with `error` (the server refused the prompt, or answered with
  no text: a tool call, a refusal, `content: null`) fails the whole conversation: its row carries `failed`
  and is never committed, so a rerun retries it.
- Accounting (`account`): every input row ends as written (a row with messages), skipped with a reason (a
  bad row, a prompt over max_prompt_tokens, a conversation with no response kept) or failed with a reason,
  and written + skipped + failed equals the rows read; the manifest and the last line say so.
- `CommitLog` is an append-only JSONL file, one complete record per line, written with one write and fsynced.
  A line is committed once it ends with a newline and parses; opening the log cuts a torn last line (a kill -9
  mid-write), so the work it held is recomputed and nothing is duplicated or lost.
- Rows (one per conversation): index, messages (None when no response was kept), tokens generated, the turn
  cut at max_new_tokens (or None), and why the conversation ended early (or None); a failed row also has
  `failed` (its reason) and is handed to the parent, never to a commit log.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from data.prompts import Conversation, history_for, render_prompt_ids
from pipeline.errors import UserError

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")


class RegenError(UserError, RuntimeError):
    """A problem the user can fix (another run's directory, a server serving another model, ...): one message."""


@dataclass
class Prompt:
    messages: list  # the conversation so far (chat messages), generation prompt implied
    ids: list  # its rendered token ids
    seed: int


@dataclass
class Reply:
    text: str = ""
    tokens: int = 0  # tokens generated, the stop token included
    truncated: bool = False  # cut at max_new_tokens
    error: Optional[str] = None  # this response failed (a 4xx answer, no text): the conversation fails
    token_ids: Optional[list] = None  # embedded engine: the generated ids (stop token included)


def turn_seed(seed: int, index: int, turn: int) -> int:
    """A per-response seed derived from the run's seed, the conversation and the turn (stable across resumes)."""
    return int(hashlib.sha256(f"{seed}:{index}:{turn}".encode()).hexdigest()[:8], 16)


def conversation_of(conv: Conversation, responses: list[str]) -> Optional[list[dict]]:
    """The output conversation: segments interleaved with the responses kept (None when there are none)."""
    if not responses:
        return None
    n = len(responses)
    return history_for(conv, n - 1, responses) + [{"role": "assistant", "content": responses[n - 1]}]


def regenerate_batch(engine: Any, tokenizer: Any, convs: list[Conversation], settings: dict,
                     should_stop: Callable[[], bool] = lambda: False) -> Optional[list[dict]]:
    """Answer every turn of `convs` (see the module contract); None when stopped before the end."""
    state = {c.index: {"responses": [], "tokens": 0, "truncated": None, "ended": None, "failed": None} for c in convs}
    for turn in range(max(len(c.segments) for c in convs)):
        prompts, owners = [], []
        for c in convs:
            st = state[c.index]
            if st["ended"] or st["failed"] or st["truncated"] is not None or turn >= len(c.segments):
                continue
            messages = history_for(c, turn, st["responses"])
            ids = render_prompt_ids(tokenizer, messages, settings["enable_thinking"])
            if len(ids) > settings["max_prompt_tokens"]:
                st["ended"] = f"turn {turn}: prompt of {len(ids)} tokens > max_prompt_tokens {settings['max_prompt_tokens']}"
                continue
            prompts.append(Prompt(messages, ids, turn_seed(settings["seed"], c.index, turn)))
            owners.append(c)
        if not prompts:
            break
        if should_stop():
            return None
        replies = engine.generate(prompts)
        if replies is None:
            return None
        for c, r in zip(owners, replies):
            st = state[c.index]
            st["tokens"] += r.tokens
            if r.error:
                st["failed"] = f"turn {turn}: {r.error}"
            elif not r.text.strip():
                st["ended"] = f"turn {turn}: empty response"
            elif r.truncated:
                st["truncated"] = turn
                if settings["keep_truncated"]:
                    st["responses"].append(r.text)
                else:
                    st["ended"] = f"turn {turn}: cut at max_new_tokens (dropped: regenerate.keep_truncated=false)"
            else:
                st["responses"].append(r.text)
    rows = []
    for c in convs:
        st = state[c.index]
        if st["failed"]:  # never committed: a rerun answers the whole conversation again
            rows.append({"index": c.index, "messages": None, "tokens": st["tokens"], "truncated": None,
                         "ended": None, "failed": st["failed"]})
            continue
        kept = trainable_prefix(tokenizer, c, st["responses"], settings["enable_thinking"])
        if len(kept) < len(st["responses"]):
            st["ended"] = (f"turn {len(kept)}: the chat template rewrites earlier turns (e.g. strips their reasoning), "
                           f"so ingest cannot place them; kept the first {len(kept)} turn(s)")
            st["truncated"] = st["truncated"] if st["truncated"] is not None and st["truncated"] < len(kept) else None
        rows.append({"index": c.index, "messages": conversation_of(c, kept), "tokens": st["tokens"],
                     "truncated": st["truncated"], "ended": st["ended"]})
    return rows


def trainable_prefix(tokenizer: Any, conv: Conversation, responses: list[str], enable_thinking: bool) -> list[str]:
    """The longest prefix of the responses whose conversation ingest can tokenise (a template that rewrites
    earlier turns, like Qwen3's with thinking on, makes later turns unlocatable; one turn always works)."""
    from data.ingest import ChatTemplateError, tokenize_conversation

    while len(responses) > 1:
        try:
            tokenize_conversation(tokenizer, conversation_of(conv, responses), 1, enable_thinking)
            return responses
        except ChatTemplateError:
            responses = responses[:-1]
    return responses


def read_log(path: Path) -> tuple[list[dict], int, int]:
    """(committed records, bytes they take, file size) of a commit log; a torn tail is left out, not cut."""
    data = path.read_bytes() if path.exists() else b""
    records, good = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            record = json.loads(line)
        except ValueError:
            break
        records.append(record)
        good += len(line)
    return records, good, len(data)


class CommitLog:
    """The append-only JSONL of one writer (see the module contract)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records, good, size = read_log(self.path)
        if good < size:  # a torn tail: the record being written when the process died
            with open(self.path, "r+b") as f:
                f.truncate(good)
        self.file = open(self.path, "ab")

    def append(self, record: dict) -> None:
        self.file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.records.append(record)

    def close(self) -> None:
        self.file.close()


def committed_rows(work_dir: Path) -> dict[int, dict]:
    """Every committed row of every log under work_dir/logs, by conversation index. Read-only: other writers
    may be appending (their torn tails are left alone)."""
    rows: dict[int, dict] = {}
    for path in sorted((work_dir / "logs").glob("*.jsonl")):
        for record in read_log(path)[0]:
            for row in record.get("rows", []):
                if row["index"] in rows:
                    raise RegenError(f"conversation {row['index']} committed twice (again in {path}); two runs "
                                       "wrote this directory at once: start over with a new --out")
                rows[row["index"]] = row
    return rows


def write_outputs(out_dir: Path, files: list[str], convs: list[Conversation], identity: dict, cfg: Any, command: str,
                  seconds: float, report: Any, failed: Optional[dict[int, str]] = None) -> dict:
    """Write one JSONL per input file (rows in input order) and then manifest.json; returns the manifest.
    `failed` (conversation index -> reason) are this attempt's failures: listed, not written, and retried by a
    rerun; any other conversation without a committed row is an error."""
    from data.prompts import MANIFEST, MANIFEST_KIND, output_names
    from pipeline import __version__

    work = out_dir / "work"
    rows = committed_rows(work)
    settings = identity["settings"]
    names = output_names(files)
    per_file: list[list[str]] = [[] for _ in files]
    failed = failed or {}
    lists: dict[str, list] = {"truncated": [], "ended_early": [], "dropped": [], "skipped_prompts": [], "failed": []}
    responses = tokens = 0
    for c in convs:
        if c.length > settings["max_prompt_tokens"]:
            lists["skipped_prompts"].append({"source": c.source, "prompt_tokens": c.length})
            continue
        row = rows.get(c.index)
        if row is None and c.index in failed:
            lists["failed"].append({"source": c.source, "reason": failed[c.index]})
            continue
        if row is None:
            raise RegenError(f"conversation {c.index} ({c.source}) has no committed response; rerun to finish it")
        tokens += row["tokens"]
        if row["messages"] is None:
            lists["dropped"].append({"source": c.source, "reason": row["ended"]})
            continue
        per_file[c.file].append(json.dumps({"messages": row["messages"]}, ensure_ascii=False) + "\n")
        responses += sum(m["role"] == "assistant" for m in row["messages"])
        where = {"output": names[c.file], "line": len(per_file[c.file]), "source": c.source}
        if row["truncated"] is not None:
            lists["truncated"].append({**where, "turn": row["truncated"]})
        if row["ended"]:
            lists["ended_early"].append({**where, "reason": row["ended"]})
    for name, lines in zip(names, per_file):
        write_text_atomic(out_dir / name, "".join(lines))
    engines = sorted({"server" if p.name == "server.jsonl" else "embedded" for p in (work / "logs").glob("*.jsonl")})
    manifest = {
        "kind": MANIFEST_KIND, "dflash_version": __version__, "command": command,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": {"path": cfg.target.path, **identity["target"]},
        "tokenizer": identity["tokenizer"],
        "sampling": {k: settings[k] for k in SAMPLING_KEYS},
        "max_prompt_tokens": settings["max_prompt_tokens"], "keep_truncated": settings["keep_truncated"],
        "engines": engines, "prompts": {"files": files, **identity["prompts"], "bad_rows_skipped": dict(report.skipped)},
        "outputs": {n: {"input": f, "conversations": len(lines)} for n, f, lines in zip(names, files, per_file)},
        "conversations": sum(len(x) for x in per_file), "responses": responses, "output_tokens": tokens,
        "seconds_last_attempt": round(seconds, 1), **lists,
        "accounting": account(report, per_file, lists), "complete": not lists["failed"],
    }
    write_text_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def account(report: Any, per_file: list, lists: dict) -> dict:
    """Where every input row went (see the module contract); a sum that does not add up is a bug, not data."""
    bad = sum(n for reason, n in report.skipped.items() if reason != "empty file")  # an empty file has no row
    acc = {"input": report.rows_read, "written": sum(len(x) for x in per_file),
           "skipped": {"bad rows": bad, "prompt over max_prompt_tokens": len(lists["skipped_prompts"]),
                       "no response kept": len(lists["dropped"])},
           "failed": len(lists["failed"])}
    if acc["written"] + sum(acc["skipped"].values()) + acc["failed"] != acc["input"]:
        raise RuntimeError(f"regenerate's accounting does not add up: {acc}")  # pragma: no cover - a bug
    return acc


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
