"""Reading conversations: the rows of chat data files, checked and normalised, and one render through the target's
chat template. Both stage one's ingest (data/ingest.py) and regeneration's prompts (data/prompts.py) read through it.

Contract:
- Inputs: JSONL files whose rows are `{"messages": [{"role", "content"}, ...]}` or ShareGPT
  `{"conversations": [{"from", "value"}, ...]}` (roles human/user -> user, gpt/assistant -> assistant, system ->
  system), or directories written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict: "train" for train
  files, "validation" or "test" for validation files) whose rows have the same two shapes. `read_conversations`
  yields (source, line, messages) with messages normalised to `[{"role": "system"|"user"|"assistant", "content": str}]`.
- Bad rows (invalid JSON, JSON nested too deep for the parser, missing messages/conversations, unknown role,
  empty or non-string content, text with a lone surrogate such as "\\ud800", no assistant turn, an oversized
  row, empty file): with on_bad_row="error" the first one raises `IngestError` naming file, line (1-based; row
  index for datasets), reason and the fix; with "skip" they are counted by reason in `IngestReport.skipped`.
- Oversized rows: a JSONL line of more than `row_byte_cap(max_length)` bytes (64 bytes per token of
  data.max_length, at least 1 MiB; a row that long keeps under 1/16 of itself after truncation) is a bad row,
  read in bounded pieces and never parsed or tokenised; a datasets row whose contents exceed that many
  characters is one too.
- `_render` is the one call of the tokenizer's chat template (`enable_thinking` as a template variable); a
  failure is a `ChatTemplateError`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from pipeline.errors import UserError

FIX_HINT = "fix the row or rerun with --set data.on_bad_row=skip"
ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


class IngestError(UserError, ValueError):
    """A data problem; the message names the file, the line or row, the reason and the fix."""


class ChatTemplateError(IngestError):
    """The chat template failed, or its renders do not let us locate the assistant turns."""


ROW_BYTES_PER_TOKEN = 64  # an oversized row: more raw bytes than this per token of data.max_length ...
MIN_ROW_CAP = 1 << 20  # ... and more than 1 MiB
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # valid JSON ("\\ud800"), not text: UTF-8 cannot encode it


def row_byte_cap(max_length: int) -> int:
    """The size over which a row is a bad row (see the module contract)."""
    return max(MIN_ROW_CAP, ROW_BYTES_PER_TOKEN * max_length)


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass
class IngestReport:
    rows_read: int = 0
    samples: Counter = field(default_factory=Counter)  # kept samples per split
    tokens: int = 0
    supervised_tokens: int = 0
    truncated: int = 0  # kept samples cut to max_length
    duplicates: int = 0
    dropped: int = 0  # no two consecutive supervised tokens
    skipped: Counter = field(default_factory=Counter)  # bad rows by reason
    capped: int = 0  # unique conversations left out by max_samples
    max_length: int = 0

    def summary(self) -> str:
        n = sum(self.samples.values())
        pct = 100.0 * self.supervised_tokens / self.tokens if self.tokens else 0.0
        lines = [
            f"ingest: {self.rows_read:,} rows read -> {n:,} samples ({self.samples['train']:,} train, "
            f"{self.samples['validation']:,} validation), {self.tokens:,} tokens, "
            f"{self.supervised_tokens:,} supervised ({pct:.1f}%)"
        ]
        if self.truncated:
            lines.append(f"  {self.truncated:,} samples truncated to max_length={self.max_length}")
        if self.skipped:
            why = ", ".join(f"{reason} {count:,}" for reason, count in sorted(self.skipped.items()))
            lines.append(f"  skipped {sum(self.skipped.values()):,} bad rows: {why}")
        if self.dropped:
            lines.append(f"  dropped {self.dropped:,} samples with no two consecutive supervised tokens")
        if self.duplicates:
            lines.append(f"  {self.duplicates:,} duplicate conversations kept once")
        if self.capped:
            lines.append(f"  {self.capped:,} conversations left out by data.max_samples")
        return "\n".join(lines)


def _location(source: str, line_no: int) -> str:
    return f"{source}, row {line_no}" if source.endswith("]") and " [split " in source else f"{source}, line {line_no}"


def normalise_messages(row: Any, require_assistant: bool = True) -> list[dict[str, str]]:
    """Validate one row and return its normalised messages; raises _BadRow(reason, detail). With
    require_assistant=False (prompts) assistant turns may be missing and their content is not checked."""
    if not isinstance(row, dict):
        raise _BadRow("missing messages/conversations", f"the row is a JSON {type(row).__name__}, not an object")
    turns = row.get("messages", row.get("conversations"))
    if turns is None:
        keys = ", ".join(map(str, sorted(row)))
        raise _BadRow("missing messages/conversations", f"the row has no 'messages' or 'conversations' (keys: {keys})")
    if not isinstance(turns, list) or not turns:
        raise _BadRow("missing messages/conversations", "'messages'/'conversations' must be a non-empty list")
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadRow("missing messages/conversations", f"turn {k} is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or role not in ROLE_ALIASES:  # a list or an object is no role (nor hashable)
            raise _BadRow("unknown role", f"turn {k} has role {role!r} (expected one of {', '.join(ROLE_ALIASES)})")
        if not require_assistant and ROLE_ALIASES[role] == "assistant":
            messages.append({"role": "assistant", "content": content if isinstance(content, str) else ""})
            continue
        if not isinstance(content, str):
            raise _BadRow("non-string content", f"turn {k} content is {type(content).__name__}, not a string")
        if not content.strip():
            raise _BadRow("empty content", f"turn {k} ({role}) has empty content")
        bad = _LONE_SURROGATE.search(content)
        if bad:
            raise _BadRow("invalid text", f"turn {k} content holds a lone surrogate {bad.group()!r} at character "
                          f"{bad.start()} (a JSON \\ud800-style escape without its pair is not text)")
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise _BadRow("no assistant turn", "the conversation has no assistant turn to learn from")
    return messages


def _iter_jsonl(path: Path, max_row_bytes: Optional[int] = None) -> Iterator[tuple[int, Any]]:
    """(1-based line, parsed row or _BadRow) for each non-blank line; a line over max_row_bytes is read in 1 MiB
    pieces to its end and never held whole."""
    with open(path, "rb") as f:
        line_no = 0
        while True:
            raw = f.readline(max_row_bytes + 1) if max_row_bytes else f.readline()
            if not raw:
                return
            line_no += 1
            if max_row_bytes and len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # skip the rest of this line
                    raw = f.readline(MIN_ROW_CAP)
                    size += len(raw)
                yield line_no, _oversized(f"the row is {size:,} bytes", max_row_bytes)
                continue
            if not raw.strip():
                continue
            try:
                yield line_no, json.loads(raw)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
                yield line_no, _BadRow("invalid JSON", f"invalid JSON ({str(e)[:200]})")
            except RecursionError:
                yield line_no, _BadRow("invalid JSON", "invalid JSON (nested deeper than the JSON parser allows)")


def _oversized(what: str, cap: int) -> _BadRow:
    return _BadRow("oversized row", f"{what}, over the cap of {cap:,} (64 per token of data.max_length, at least "
                   "1 MiB): truncation would keep a small part of it, so it is neither parsed nor tokenised; "
                   "split or shorten the conversation, or raise data.max_length")


def _iter_dataset(path: Path, split: str) -> tuple[str, Iterator[tuple[int, Any]]]:
    try:
        import datasets
    except ImportError:
        raise IngestError(
            f"{path} is a directory (a `datasets` dataset?) but the `datasets` package is not installed; "
            "install it (pip install 'dflash[hf]') or convert the data to JSONL"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - load_from_disk raises several types for non-datasets dirs
        raise IngestError(f"{path} is a directory but not a dataset saved with save_to_disk: {e}") from None
    name = split
    if isinstance(ds, datasets.DatasetDict):
        wanted = ["train"] if split == "train" else ["validation", "test"]
        found = [w for w in wanted if w in ds]
        if not found:
            raise IngestError(
                f"{path}: DatasetDict has splits {sorted(ds)}, none of {wanted} (needed for the {split} files)"
            )
        name, ds = found[0], ds[found[0]]
    return f"{path} [split {name}]", ((i, row) for i, row in enumerate(ds))


def read_conversations(
    path: str | Path, on_bad_row: str = "error", *, split: str = "train", report: Optional[IngestReport] = None,
    require_assistant: bool = True, max_row_bytes: Optional[int] = None,
) -> Iterator[tuple[str, int, list[dict[str, str]]]]:
    """Yield (source, line or row index, normalised messages) for each good row of one input.

    `split` picks the DatasetDict split for dataset directories. Bad rows raise IngestError
    (on_bad_row="error") or are counted in `report.skipped` (on_bad_row="skip"); see normalise_messages.
    `max_row_bytes` (`row_byte_cap(data.max_length)`): larger rows are bad rows (see the module contract).
    """
    path = Path(path)
    report = report if report is not None else IngestReport()
    if not path.exists():
        raise IngestError(f"data file {path} does not exist (check data.train_files / data.validation_files)")
    if path.is_dir():
        source, rows = _iter_dataset(path, split)
    else:
        source, rows = str(path), _iter_jsonl(path, max_row_bytes)
    seen = 0
    for line_no, row in rows:
        seen += 1
        report.rows_read += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            messages = normalise_messages(row, require_assistant)
            chars = sum(len(m["content"]) for m in messages)
            if max_row_bytes and chars > max_row_bytes:  # a datasets row (a JSONL line over the cap is not parsed)
                raise _oversized(f"the row holds {chars:,} characters", max_row_bytes)
        except _BadRow as bad:
            if on_bad_row != "skip":
                raise IngestError(f"{_location(source, line_no)}: {bad.detail}; {FIX_HINT}") from None
            report.skipped[bad.reason] += 1
            continue
        yield source, line_no, messages
    if seen == 0:
        if on_bad_row != "skip":
            raise IngestError(f"{source}: the file is empty (no rows); remove it from the data files or {FIX_HINT}")
        report.skipped["empty file"] += 1


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool, enable_thinking: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=enable_thinking
        )
    except Exception as e:  # noqa: BLE001 - jinja raises many types (raise_exception, undefined, ...)
        raise ChatTemplateError(f"the chat template failed on {len(messages)} messages: {e}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
    return text


