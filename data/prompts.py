"""Prompts for `dflash regenerate`: conversations read like training data, with their assistant turns dropped.

Contract:
- Inputs are anything `data.ingest.read_conversations` reads (JSONL `messages`, ShareGPT `conversations`,
  `datasets` directories). Assistant turns may be missing or empty; their content is never used.
- A conversation becomes `segments`: the non-assistant messages before each response to generate. A
  response is generated where the input had an assistant turn after a user turn, and at the end when the
  conversation ends with a user turn; an assistant turn before any user turn (a greeting) is dropped, and so
  are non-user messages after the last response. Turn k is generated from segments[0], response 0, ...,
  segments[k], so each turn is conditioned on the target's own earlier answers.
- Every prompt is rendered through ingest's own renderer (`render_prompt_ids`: the target's chat template
  with `data.enable_thinking`, generation prompt, no added special tokens), so a response continues exactly
  the text that extraction tokenises. `check_renders` renders every conversation before any model work (later
  turns with a placeholder answer): a template failure or a row without a user turn raises `IngestError` naming
  file and line (or is counted and skipped with data.on_bad_row=skip).
- Conversation `index` is the position in input order over all files; output file k holds the responses to
  input file k (`output_names`).
- `check_regenerated` (called by ingest) refuses training data whose regeneration manifest says it was written
  with another chat template or thinking mode than the config renders it with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data.conversations import (FIX_HINT, ChatTemplateError, IngestError, IngestReport, _location, _render,
                                read_conversations)

MANIFEST = "manifest.json"
MANIFEST_KIND = "dflash-regenerate"
PLACEHOLDER = "\u2026"  # stands in for an earlier response when a later turn is rendered to check the template


@dataclass
class Conversation:
    index: int  # position among all prompts, input order
    file: int  # which input (and output) file
    source: str  # "FILE, line N" for messages
    segments: list  # list[list[{"role", "content"}]]: the messages before each response
    length: int = 0  # tokens of the first turn's rendered prompt

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @staticmethod
    def from_json(line: str) -> "Conversation":
        return Conversation(**json.loads(line))


def split_segments(messages: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """The non-assistant messages before each response to generate (see the module contract)."""
    segments, current = [], []
    for m in messages:
        if m["role"] != "assistant":
            current.append(m)
        elif any(x["role"] == "user" for x in current):
            segments.append(current)
            current = []
    if any(x["role"] == "user" for x in current):
        segments.append(current)
    return segments


def read_prompts(files: list[str], on_bad_row: str = "error", report: IngestReport | None = None,
                 max_row_bytes: int | None = None) -> list[Conversation]:
    """Every conversation of `files` as segments, in input order; bad rows raise IngestError (file, line).
    Rows over `max_row_bytes` are bad rows (ingest's `row_byte_cap`)."""
    report = report if report is not None else IngestReport()
    if not files:
        raise IngestError("no prompt files: pass --prompts FILE (JSONL messages/conversations or a datasets dir)")
    out: list[Conversation] = []
    for k, path in enumerate(files):
        for source, line_no, messages in read_conversations(path, on_bad_row, report=report, require_assistant=False,
                                                            max_row_bytes=max_row_bytes):
            segments = split_segments(messages)
            where = _location(source, line_no)
            if not segments:
                if on_bad_row != "skip":
                    raise IngestError(f"{where}: the conversation has no user turn to answer; {FIX_HINT}")
                report.skipped["no user turn"] += 1
                continue
            out.append(Conversation(len(out), k, where, segments))
    if not out:
        raise IngestError(f"no prompts in {', '.join(map(str, files))}")
    return out


def render_prompt_ids(tokenizer: Any, messages: list[dict[str, str]], enable_thinking: bool) -> list[int]:
    """Token ids of `messages` plus the generation prompt, rendered (ingest's `_render`) and tokenised exactly as
    ingest tokenises training conversations, so a response continues the text that extraction will see."""
    return list(tokenizer(_render(tokenizer, messages, True, enable_thinking), add_special_tokens=False)["input_ids"])


def history_for(conv: Conversation, turn: int, responses: list[str]) -> list[dict[str, str]]:
    """The messages before response `turn`: segments interleaved with the responses given so far."""
    messages: list[dict[str, str]] = []
    for k in range(turn + 1):
        messages += conv.segments[k]
        if k < turn:
            messages.append({"role": "assistant", "content": responses[k]})
    return messages


def check_renders(tokenizer: Any, convs: list[Conversation], enable_thinking: bool, on_bad_row: str = "error",
                  report: IngestReport | None = None) -> list[Conversation]:
    """Render every conversation (sets `length`); template failures raise IngestError naming file and line,
    or are counted in report.skipped with on_bad_row=skip. Returns the conversations that render."""
    if not getattr(tokenizer, "chat_template", None):
        raise IngestError("the tokenizer has no chat_template; regenerate renders prompts with the target's own")
    kept = []
    for conv in convs:
        try:
            conv.length = len(render_prompt_ids(tokenizer, history_for(conv, 0, []), enable_thinking))
            last = len(conv.segments) - 1
            if last:
                render_prompt_ids(tokenizer, history_for(conv, last, [PLACEHOLDER] * last), enable_thinking)
        except ChatTemplateError as e:
            if on_bad_row != "skip":
                raise IngestError(f"{conv.source}: {e}; {FIX_HINT}") from None
            if report is not None:
                report.skipped["chat template"] += 1
            continue
        kept.append(conv)
    return kept


def prompts_fingerprint(convs: list[Conversation]) -> str:
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.file, c.segments], sort_keys=True, ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def output_names(files: list[str]) -> list[str]:
    """One output JSONL name per input: its stem (a datasets dir: its name), numbered when stems collide."""
    stems = [Path(f).stem if Path(f).suffix in (".jsonl", ".json") else Path(f).name for f in files]
    names = []
    for k, stem in enumerate(stems):
        names.append(f"{stem}.jsonl" if stems.count(stem) == 1 else f"{stem}-{k}.jsonl")
    return names


def check_regenerated(files: list[str], tokenizer: Any, enable_thinking: bool) -> None:
    """Refuse data that `dflash regenerate` wrote with another chat template or thinking mode than the config's."""
    from pipeline.target import tokenizer_fingerprint

    template = None
    for f in files:
        path = Path(f)
        manifest_path = path.parent / MANIFEST
        if path.is_dir() or not manifest_path.exists():
            continue
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if manifest.get("kind") != MANIFEST_KIND or path.name not in manifest.get("outputs", {}):
            continue
        made = manifest.get("tokenizer", {})
        if made.get("enable_thinking") != enable_thinking:
            raise IngestError(
                f"{f} was regenerated with enable_thinking={made.get('enable_thinking')} ({manifest_path}) but "
                f"data.enable_thinking is {enable_thinking}: the drafter would learn a template the target never "
                f"answered in; set data.enable_thinking={str(made.get('enable_thinking')).lower()} or regenerate")
        template = template or tokenizer_fingerprint(tokenizer)["chat_template_sha256"]
        if made.get("chat_template_sha256") not in (None, template):
            raise IngestError(
                f"{f} was regenerated with another chat template (sha256 {made.get('chat_template_sha256', '')[:12]}, "
                f"{manifest_path}) than the target tokenizer's ({template[:12]}); use the same target or regenerate")
