"""Conversation ingest: the input of stage one (chat data -> token ids + assistant loss mask).

Contract:
- Inputs (`DataConfig.train_files` / `validation_files`): JSONL files whose rows are
  `{"messages": [{"role", "content"}, ...]}` or ShareGPT `{"conversations": [{"from", "value"}, ...]}`
  (roles human/user -> user, gpt/assistant -> assistant, system -> system), or directories written by
  `datasets`' `save_to_disk` (a Dataset, or a DatasetDict: "train" for train files, "validation" or
  "test" for validation files) whose rows have the same two shapes. Messages are normalised to
  `[{"role": "system"|"user"|"assistant", "content": str}]`.
- Tokenisation uses the tokenizer's own chat template (`enable_thinking` is passed as a template
  variable, so it must match serving). The loss mask is 1 exactly on the tokens of every assistant turn:
  its content and its end-of-turn token(s) (plus anything the template renders inside the turn, e.g. a
  think block it adds there); never on the role header / generation prompt, and not on whitespace that
  the template puts after the end-of-turn token. Spans are found by rendering prefixes of the conversation
  as text: a turn spans from the end of render(messages[:i], generation prompt) to the end of
  render(messages[:i+1]). Templates that render history differently from a fresh turn (Qwen3 drops the
  empty think block of earlier turns, so that prefix property breaks) fall back to rendering the whole
  conversation with the turn's content replaced by a sentinel, which pins where the content and its
  end-of-turn text sit in the full render; when neither works (the template rewrites the content of
  earlier turns, e.g. strips their reasoning) the row fails with a chat-template error. The full text is
  tokenised once (`add_special_tokens=False`); a token is supervised when its characters overlap a span.
- Sequences are truncated to `max_length`; samples without two consecutive supervised tokens (no DFlash
  anchor) are dropped and counted.
- `sample_id` = first 16 hex chars of sha256 of the canonical JSON of the normalised messages. Duplicate
  ids are kept once (a validation copy wins over a train copy). Samples are ordered by sample_id, so
  reruns and resumes see the same samples whatever the file order; `max_samples` caps after ordering
  (rows past the cap are not tokenised). Split: rows of validation_files are "validation"; without
  validation_files a sample is "validation" iff int(sha256(sample_id)[:8], 16) / 2**32 < fraction.
- Bad rows (invalid JSON, JSON nested too deep for the parser, missing messages/conversations, unknown role,
  empty or non-string content, text with a lone surrogate such as "\\ud800", no assistant turn, an oversized
  row, empty file, chat-template failure): with on_bad_row="error" the first one raises `IngestError` naming
  file, line (1-based; row index for datasets), reason and the fix; with "skip" they are counted by reason in
  `IngestReport.skipped`. Ingest that yields no sample raises `IngestError`.
- Oversized rows: a JSONL line of more than `row_byte_cap(max_length)` bytes (64 bytes per token of
  data.max_length, at least 1 MiB; a row that long keeps under 1/16 of itself after truncation) is a bad row,
  read in bounded pieces and never parsed or tokenised; a datasets row whose contents exceed that many
  characters is one too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from pipeline.errors import UserError

FIX_HINT = "fix the row or rerun with --set data.on_bad_row=skip"
_SENTINEL = "\u27e6dflash-ingest-sentinel\u27e7"  # stands in for one turn's content in the fallback
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
class Sample:
    sample_id: str
    input_ids: np.ndarray  # int32 [S]
    loss_mask: np.ndarray  # uint8 [S], 1 on assistant tokens only
    split: str  # "train" | "validation"


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


def sample_id_of(messages: list[dict[str, str]]) -> str:
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def is_validation(sample_id: str, validation_fraction: float) -> bool:
    return int(hashlib.sha256(sample_id.encode("ascii")).hexdigest()[:8], 16) / 2**32 < validation_fraction


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


def _assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], enable_thinking: bool
) -> tuple[str, list[tuple[int, int]]]:
    """The full render and the [start, end) character span of every assistant turn in it."""
    full = _render(tokenizer, messages, False, enable_thinking)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        located = None
        if i:  # a conversation cannot be empty: a leading assistant turn goes straight to the fallback
            prompt = _render(tokenizer, messages[:i], True, enable_thinking)
            through = _render(tokenizer, messages[: i + 1], False, enable_thinking)
            if through.startswith(prompt) and full.startswith(through) and len(prompt) >= cursor:
                located = len(prompt), len(through)
        start, end = located or _locate_in_history(tokenizer, messages, i, full, cursor, enable_thinking)
        while end > start and full[end - 1].isspace():
            end -= 1  # whitespace after the end-of-turn token is never generated
        spans.append((start, end))
        cursor = end
    return full, spans


def _locate_in_history(
    tokenizer: Any, messages: list[dict[str, str]], i: int, full: str, cursor: int, enable_thinking: bool
) -> tuple[int, int]:
    """Fallback for templates whose history differs from a fresh turn (Qwen3 drops empty think blocks).

    Renders the conversation with turn i's content replaced by a sentinel: the text before the sentinel
    must equal the full render's, the content must follow verbatim, and the end-of-turn text is what
    follows the content both when the turn is last and when it is in the full conversation.
    """
    content = messages[i]["content"]
    with_sentinel = [*messages[:i], {"role": "assistant", "content": _SENTINEL}]
    full_s = _render(tokenizer, with_sentinel + messages[i + 1:], False, enable_thinking)
    last_s = _render(tokenizer, with_sentinel, False, enable_thinking)
    pos = full_s.find(_SENTINEL)
    if (
        pos >= cursor
        and full_s.count(_SENTINEL) == 1
        and last_s.count(_SENTINEL) == 1
        and full_s[:pos] == full[:pos]
        and full.startswith(content, pos)
    ):
        tail = os.path.commonprefix(
            [last_s[last_s.index(_SENTINEL) + len(_SENTINEL):], full_s[pos + len(_SENTINEL):]]
        )
        if full.startswith(tail, pos + len(content)):
            return pos, pos + len(content) + len(tail)
    hint = ""
    if "</think>" in content:
        hint = (" The turn holds a <think> block, which templates like Qwen3's strip from earlier turns and render"
                " unlike the generation prompt; drop reasoning from the data or check data.enable_thinking.")
    raise ChatTemplateError(
        f"cannot locate assistant turn {i} in the chat template's render: rendering messages[:{i}] with the "
        f"generation prompt and messages[:{i + 1}] gives text that is not a prefix of the full conversation, "
        "and the turn's content does not appear verbatim where the template puts it (the template rewrites "
        f"earlier turns).{hint}"
    )


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], max_length: int, enable_thinking: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and loss mask (uint8, 1 on assistant tokens), truncated to max_length."""
    input_ids, loss_mask = _tokenize_full(tokenizer, messages, enable_thinking)
    return input_ids[:max_length], loss_mask[:max_length]


def _check_tokenizer(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise IngestError("the tokenizer has no chat_template; ingest renders conversations with the target's own")
    if not getattr(tokenizer, "is_fast", False):
        raise IngestError("the tokenizer is not a fast tokenizer; ingest needs character offsets (use_fast=True)")


def _tokenize_full(
    tokenizer: Any, messages: list[dict[str, str]], enable_thinking: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Untruncated token ids and loss mask of one conversation."""
    _check_tokenizer(tokenizer)
    full, spans = _assistant_spans(tokenizer, messages, enable_thinking)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    tok_start = offsets[:, 0]
    tok_end = np.maximum(offsets[:, 1], tok_start + 1)  # offsets trimmed to zero length still belong at start
    supervised = np.zeros(len(input_ids), dtype=bool)
    for start, end in spans:  # a token is supervised when its characters overlap an assistant span
        supervised |= (tok_start < end) & (tok_end > start)
    return input_ids, supervised.astype(np.uint8)


def has_anchor(loss_mask: np.ndarray) -> bool:
    """True when the sample has a DFlash anchor (pipeline.masks.anchor_candidates is not empty)."""
    import torch

    from pipeline.masks import anchor_candidates

    return anchor_candidates(torch.as_tensor(np.asarray(loss_mask))).numel() > 0


def ingest(data_cfg: Any, tokenizer: Any) -> tuple[list[Sample], IngestReport]:
    """Read, validate, deduplicate, order, split and tokenise the configured data (see module docstring)."""
    if not data_cfg.train_files:
        raise IngestError("data.train_files is empty; set it in the config or --set data.train_files=[a.jsonl]")
    _check_tokenizer(tokenizer)
    from data.prompts import check_regenerated  # data written by `dflash regenerate` under another template

    check_regenerated([*data_cfg.validation_files, *data_cfg.train_files], tokenizer, data_cfg.enable_thinking)
    skip = data_cfg.on_bad_row == "skip"
    report = IngestReport(max_length=data_cfg.max_length)
    pending: dict[str, tuple[Optional[str], str, int, list]] = {}
    has_val_files = bool(data_cfg.validation_files)
    # Validation files first, so a conversation present in both splits stays in validation.
    for split, files in (("validation", data_cfg.validation_files), ("train", data_cfg.train_files)):
        for path in files:
            for source, line_no, messages in read_conversations(path, data_cfg.on_bad_row, split=split, report=report,
                                                                max_row_bytes=row_byte_cap(data_cfg.max_length)):
                sid = sample_id_of(messages)
                if sid in pending:
                    report.duplicates += 1
                    continue
                pending[sid] = (split if has_val_files else None, source, line_no, messages)

    samples: list[Sample] = []
    order = sorted(pending)
    for k, sid in enumerate(order):
        if data_cfg.max_samples is not None and len(samples) >= data_cfg.max_samples:
            report.capped = len(order) - k
            break
        split, source, line_no, messages = pending.pop(sid)
        try:
            input_ids, loss_mask = _tokenize_full(tokenizer, messages, data_cfg.enable_thinking)
        except ChatTemplateError as e:
            if not skip:
                raise IngestError(f"{_location(source, line_no)}: {e}; {FIX_HINT}") from None
            report.skipped["chat template"] += 1
            continue
        if len(input_ids) > data_cfg.max_length:
            input_ids, loss_mask = input_ids[: data_cfg.max_length], loss_mask[: data_cfg.max_length]
            truncated = True
        else:
            truncated = False
        if not has_anchor(loss_mask):
            report.dropped += 1
            continue
        if split is None:
            split = "validation" if is_validation(sid, data_cfg.validation_fraction) else "train"
        samples.append(Sample(sid, input_ids, loss_mask, split))
        report.samples[split] += 1
        report.tokens += len(input_ids)
        report.supervised_tokens += int(loss_mask.sum())
        report.truncated += truncated

    if not samples:
        raise IngestError(
            "ingest produced no samples from "
            f"{', '.join(map(str, [*data_cfg.validation_files, *data_cfg.train_files]))}:\n{report.summary()}"
        )
    return samples, report


def dataset_fingerprint(samples: list[Sample]) -> str:
    """sha256 over (sample_id, split, length) of each sample, in order."""
    h = hashlib.sha256()
    for s in samples:
        h.update(f"{s.sample_id}\t{s.split}\t{len(s.input_ids)}\n".encode("ascii"))
    return h.hexdigest()


def save_shard_samples(samples: list[Sample], num_shards: int, shard: int, path: Path) -> None:
    """Shard `shard`'s samples (samples[shard::num_shards], in order) as one .npz, written atomically, with the
    whole dataset's fingerprint: `dflash extract` tokenises once and hands each worker its part."""
    mine = samples[shard::num_shards]
    lengths = np.array([len(s.input_ids) for s in mine], np.int64)
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.partial.npz")
    np.savez(tmp, lengths=lengths,
             input_ids=np.concatenate([s.input_ids for s in mine]).astype(np.int32) if mine else np.zeros(0, np.int32),
             loss_mask=np.concatenate([s.loss_mask for s in mine]).astype(np.uint8) if mine else np.zeros(0, np.uint8),
             sample_id=np.array([s.sample_id for s in mine], dtype=str), split=np.array([s.split for s in mine], dtype=str),
             meta=np.array(json.dumps({"dataset_fingerprint": dataset_fingerprint(samples), "num_shards": num_shards,
                                       "shard": shard})))
    os.replace(tmp, path)


def load_shard_samples(path: Path) -> tuple[list[Sample], dict]:
    """(the shard's samples, meta {dataset_fingerprint, num_shards, shard}) as `save_shard_samples` wrote them."""
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        ends = np.cumsum(z["lengths"])
        ids, mask = np.split(z["input_ids"], ends[:-1]), np.split(z["loss_mask"], ends[:-1])
        samples = [Sample(str(i), x, m, str(sp)) for i, x, m, sp in zip(z["sample_id"], ids, mask, z["split"])]
    return samples, meta
