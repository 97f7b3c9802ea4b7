"""Reading the chat data formats users have, row by row, into the one row shape the recipe's files use.

`dflash prepare-data` (stages/prepare_data.py) calls this module; it writes what `rows_of` yields.

Contract:
- Inputs (`iter_rows`), chosen by what the path is:
  - a JSONL file (one object per line; `.jsonl`, or `.json` whose first character is not `[`), or a JSON file
    holding one array of objects (ShareGPT dumps);
  - a directory written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict: `splits` picks splits, else
    "train" when present, else every split), which needs the `datasets` package;
  - a `.parquet` file, or a directory holding `*.parquet` files (a Hugging Face dataset snapshot), read with
    pyarrow; without pyarrow it is one `UserError` line naming `pip install pyarrow`.
- Row layouts (`to_messages`), in this order of precedence:
  - `prompt_col` given: that column is the user turn (`response_col`, when given, the assistant turn);
  - `messages`: OpenAI chat (also Nemotron post-training and UltraChat 200k), `{"role", "content"}` turns whose
    content is a string or a list of `{"type": "text", "text"}` parts;
  - `conversations`: ShareGPT, `{"from", "value"}` turns (human/gpt/system; role/content also read);
  - `input` as a list of turns plus `output` as a string (Llama-Nemotron post-training);
  - `data` as a list of strings, user and assistant in turn (the original UltraChat);
  - instruction/response pairs found by name: `instruction`/`output` (Evol-CodeAlpaca, Alpaca: a non-empty
    `input` column is appended to the instruction), `prompt`/`response`, `prompt`/`completion`,
    `question`/`answer`.
- Output turns are `{"role": "system"|"user"|"assistant", "content": str}`. Assistant turns are kept where the
  source has them (`dflash regenerate` answers at their positions and drops their text); an empty or missing
  assistant turn at the end is dropped, one in the middle is kept empty as a placeholder.
- Bad rows raise `BadRow(reason, detail)`, never anything else: invalid JSON, an oversized line, a row that is
  not an object, a layout not recognised, a tool turn, an unknown role, non-text or empty content, a lone
  surrogate, no user turn. The caller counts them by reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional

from data.conversations import _LONE_SURROGATE, _BadRow, _iter_jsonl
from pipeline.errors import UserError

MAX_LINE_BYTES = 64 << 20  # a JSONL line longer than this is a bad row, read in pieces and never parsed
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "chatgpt": "assistant"}
TOOL_ROLES = ("tool", "function", "ipython", "observation")
PAIRS = (("instruction", "output"), ("prompt", "response"), ("prompt", "completion"), ("question", "answer"))
BadRow = _BadRow


class PrepareError(UserError, ValueError):
    """An input that cannot be read at all (not a single bad row); the message names it and the fix."""


def _is_dataset_dir(path: Path) -> bool:
    return any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))


def iter_rows(path: str | Path, splits: Optional[list[str]] = None) -> Iterator[tuple[str, Any]]:
    """(location, row or BadRow) for every row of one input, in order (see the module contract)."""
    path = Path(path)
    if not path.exists():
        raise PrepareError(f"input {path} does not exist; pass a JSON/JSONL file, a parquet file or directory, or a "
                           "datasets directory written by save_to_disk")
    if path.is_dir() and _is_dataset_dir(path):
        yield from _dataset_rows(path, splits)
    elif path.is_dir() or path.suffix == ".parquet":
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise PrepareError(f"{path} is a directory with neither a saved dataset nor *.parquet files in it")
        for f in files:
            yield from _parquet_rows(f)
    elif path.suffix == ".json" and _starts_with_array(path):
        yield from _json_array_rows(path)
    else:
        for line_no, row in _iter_jsonl(path, MAX_LINE_BYTES):
            yield f"{path}, line {line_no}", row


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _json_array_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise PrepareError(f"{path} starts with '[' but is not one valid JSON array ({str(e)[:120]}); "
                           "fix it or convert it to JSONL, one object per line") from None
    for k, row in enumerate(rows if isinstance(rows, list) else [rows]):
        yield f"{path}, item {k}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
                           "(or pip install 'dflash[hf]'), or convert the data to JSONL") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise PrepareError(f"{path} is not a readable parquet file ({str(e)[:160]})") from None
    k = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{path}, row {k}", row
            k += 1


def _dataset_rows(path: Path, splits: Optional[list[str]]) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"{path} is a saved Hugging Face dataset but `datasets` is not installed: "
                           "pip install 'dflash[hf]' (or point at its parquet files)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - load_from_disk raises several types
        raise PrepareError(f"{path} looks like a saved dataset but does not load: {str(e)[:160]}") from None
    if not isinstance(ds, datasets.DatasetDict):
        parts = [("", ds)]
    else:
        names = splits or (["train"] if "train" in ds else sorted(ds))
        missing = [n for n in names if n not in ds]
        if missing:
            raise PrepareError(f"{path}: no split {', '.join(missing)} (it has {', '.join(sorted(ds))}); "
                               "pass --split with one of those")
        parts = [(f" [split {n}]", ds[n]) for n in names]
    for tag, part in parts:
        for k, row in enumerate(part):
            yield f"{path}{tag}, row {k}", row


def _text(content: Any, k: int) -> Optional[str]:
    """A turn's text: a string, or the text parts of an OpenAI content list joined; None when absent."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow("non-text content", f"turn {k} has a {kind!r} content part; only text is trained on")
        return "".join(texts)
    raise BadRow("non-text content", f"turn {k} content is {type(content).__name__}, not text")


def _turns(turns: Any, role_key: str, content_key: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise BadRow("unknown layout", f"'{role_key}' turns must be a non-empty list")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow("unknown layout", f"turn {k} is a {type(turn).__name__}, not an object")
        role = turn.get(role_key, turn.get("role"))
        content = turn.get(content_key, turn.get("content"))
        if isinstance(role, str) and role.lower() in TOOL_ROLES or (turn.get("tool_calls") and not content):
            raise BadRow("tool turn", f"turn {k} is a tool call or result, which a chat drafter is not trained on")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise BadRow("unknown role", f"turn {k} has role {role!r} (expected one of {', '.join(ROLES)})")
        out.append({"role": ROLES[role.lower()], "content": _text(content, k)})
    return out


def _pair(row: dict, prompt_col: str, response_col: Optional[str]) -> list[dict[str, Any]]:
    if prompt_col not in row:
        raise BadRow("missing column", f"no column {prompt_col!r} (columns: {', '.join(map(str, sorted(row)))})")
    prompt = row[prompt_col]
    extra = row.get("input") if prompt_col == "instruction" else None
    if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    turns = [{"role": "user", "content": _text(prompt, 0)}]
    if response_col is not None:
        if response_col not in row:
            raise BadRow("missing column", f"no column {response_col!r} (columns: {', '.join(map(str, sorted(row)))})")
        turns.append({"role": "assistant", "content": _text(row[response_col], 1)})
    return turns


def _layout(row: dict, prompt_col: Optional[str], response_col: Optional[str]) -> list[dict[str, Any]]:
    if prompt_col:
        return _pair(row, prompt_col, response_col)
    if row.get("messages") is not None:
        return _turns(row["messages"], "role", "content")
    if row.get("conversations") is not None:
        return _turns(row["conversations"], "from", "value")
    if isinstance(row.get("input"), list) and "output" in row:
        return _turns(row["input"], "role", "content") + [{"role": "assistant", "content": _text(row["output"], -1)}]
    if isinstance(row.get("data"), list) and all(isinstance(t, str) for t in row["data"]):
        return [{"role": ("user", "assistant")[k % 2], "content": t} for k, t in enumerate(row["data"])]
    for p, r in PAIRS:
        if p in row and r in row:
            return _pair(row, p, r)
    keys = ", ".join(map(str, sorted(row)))
    raise BadRow("unknown layout", f"no messages, conversations or known prompt/response columns (columns: {keys}); "
                 "name them with --prompt-col/--response-col")


def to_messages(row: Any, prompt_col: Optional[str] = None, response_col: Optional[str] = None) -> list[dict]:
    """One row as normalised turns (see the module contract); raises BadRow."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow("not an object", f"the row is a JSON {type(row).__name__}, not an object")
    turns = _layout(row, prompt_col, response_col)
    while turns and turns[-1]["role"] == "assistant" and not (turns[-1]["content"] or "").strip():
        turns.pop()
    for k, t in enumerate(turns):
        if t["content"] is None:
            t["content"] = ""
        if t["role"] != "assistant" and not t["content"].strip():
            raise BadRow("empty content", f"turn {k} ({t['role']}) has no text")
        bad = _LONE_SURROGATE.search(t["content"])
        if bad:
            raise BadRow("invalid text", f"turn {k} holds a lone surrogate {bad.group()!r} (not encodable text)")
    if not any(t["role"] == "user" for t in turns):
        raise BadRow("no user turn", "the conversation has no user turn to answer")
    return turns


def prompt_part(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The non-assistant turns: what `dflash regenerate` reads, and what the split and duplicates are keyed on."""
    return [m for m in messages if m["role"] != "assistant"]
