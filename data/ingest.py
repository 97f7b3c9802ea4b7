"""Conversation ingest: the input of stage one (chat data -> token ids + assistant loss mask). Rows are read,
checked and rendered by data/conversations.py (shared with regeneration's prompts); this module tokenises them.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from data.conversations import (FIX_HINT, ROLE_ALIASES, ChatTemplateError, IngestError,  # noqa: F401 (re-exported)
                                IngestReport, _location, _render, normalise_messages, read_conversations,
                                row_byte_cap)
from data.prompts import check_regenerated  # data written by `dflash regenerate` under another template

_SENTINEL = "\u27e6dflash-ingest-sentinel\u27e7"  # stands in for one turn's content in the fallback


@dataclass
class Sample:
    sample_id: str
    input_ids: np.ndarray  # int32 [S]
    loss_mask: np.ndarray  # uint8 [S], 1 on assistant tokens only
    split: str  # "train" | "validation"


def sample_id_of(messages: list[dict[str, str]]) -> str:
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def is_validation(sample_id: str, validation_fraction: float) -> bool:
    return int(hashlib.sha256(sample_id.encode("ascii")).hexdigest()[:8], 16) / 2**32 < validation_fraction


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
    """Shard `shard`'s samples (pipeline.store.shard_rows: samples[shard::num_shards], in order) as one .npz,
    written atomically, with the whole dataset's fingerprint: `dflash extract` tokenises once and hands each
    worker its part."""
    from pipeline.store import shard_rows  # here, not at the top: ingest alone needs no torch (store does)

    mine = shard_rows(samples, shard, num_shards)
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
