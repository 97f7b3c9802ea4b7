"""`dflash prepare-data`: the formats users have -> the recipe's prompt files, with their train/validation split.

Contract:
- Reads every input with data/prepare.py (JSON/JSONL ShareGPT or OpenAI `messages`, a saved Hugging Face
  dataset, parquet, instruction/response columns by name) and writes, in OUT (default `data/prompts`):
  - `train.jsonl` and `validation.jsonl`: one `{"messages": [...]}` row per conversation, in input order. These
    are the files the 27B configs and the README name: `dflash regenerate --prompts OUT/train.jsonl,
    OUT/validation.jsonl --out data/regen` answers them, and the configs read `data/regen/train.jsonl` and
    `data/regen/validation.jsonl`;
  - `prepare.json`: the inputs, the split rule, the counts per split, bad rows by reason (with the first
    location of each) and duplicates.
- Split: a conversation is validation iff the hash of its prompt turns (`data.ingest.is_validation` of their
  `sample_id_of`) falls under `validation_fraction`, so the split is the same whatever the file order, and a
  prompt never lands in both files. A conversation whose prompt turns were already seen is a duplicate, kept once.
  When no conversation falls under the fraction (a small input), the train conversation nearest the cut moves to
  validation, so neither file is empty (regenerate and ingest refuse an empty file) once there are two.
- Bad rows never stop the run: they are counted by reason, the first location of each reason is printed, and
  the run goes on. An input that cannot be read at all, or no usable row, is one `PrepareError` line (exit 2).
- Outputs are written to `*.partial` files and renamed into place at the end, so an interrupted run leaves the
  previous files whole; an input that is one of the outputs is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from data.ingest import is_validation, sample_id_of
from data.prepare import BadRow, PrepareError, iter_rows, prompt_part, to_messages

OUTPUTS = ("train.jsonl", "validation.jsonl")
REPORT = "prepare.json"
DEFAULT_OUT = "data/prompts"
DEFAULT_VALIDATION_FRACTION = 0.01  # the 27B configs' former data.validation_fraction


@dataclass
class PrepareReport:
    rows_read: int = 0
    kept: Counter = field(default_factory=Counter)  # per split
    skipped: Counter = field(default_factory=Counter)  # bad rows by reason
    first: dict = field(default_factory=dict)  # reason -> "location: detail" of its first row
    duplicates: int = 0
    with_response: int = 0  # conversations that carry at least one non-empty assistant turn
    nearest: tuple = (2.0, -1)  # (hash position, train line) of the train conversation nearest the cut
    moved: bool = False  # that conversation was moved to validation

    def lines(self, inputs: list[str], out: Path) -> list[str]:
        n = sum(self.kept.values())
        lines = [f"prepare-data: {self.rows_read:,} rows read from {len(inputs)} input(s) -> {n:,} conversations "
                 f"({self.kept['train']:,} train, {self.kept['validation']:,} validation; {self.with_response:,} "
                 f"with a response) in {out}"]
        if self.skipped:
            why = ", ".join(f"{r} {c:,}" for r, c in sorted(self.skipped.items()))
            lines.append(f"  skipped {sum(self.skipped.values()):,} bad rows: {why}")
            lines += [f"    first {r}: {self.first[r]}" for r in sorted(self.skipped)]
        if self.duplicates:
            lines.append(f"  {self.duplicates:,} duplicate prompts kept once")
        if self.moved:
            lines.append("  no conversation fell under the validation fraction: the train one nearest the cut "
                         "moved to validation")
        return lines


def _position(key: str) -> float:
    """Where a conversation falls in [0, 1): validation iff under the fraction (= data.ingest.is_validation)."""
    return int(hashlib.sha256(key.encode("ascii")).hexdigest()[:8], 16) / 2**32


def _check_paths(inputs: list[str], out: Path) -> None:
    targets = {(out / name).resolve() for name in OUTPUTS}
    for f in inputs:
        if Path(f).resolve() in targets:
            raise PrepareError(f"input {f} is one of this command's outputs; move it out of {out} or pass another --out")


def _convert(inputs: list[str], writers: dict, fraction: float, splits: Optional[list[str]],
             prompt_col: Optional[str], response_col: Optional[str]) -> PrepareReport:
    report, seen = PrepareReport(), set()
    for path in inputs:
        for where, row in iter_rows(path, splits):
            report.rows_read += 1
            try:
                messages = to_messages(row, prompt_col, response_col)
            except BadRow as bad:
                report.skipped[bad.reason] += 1
                report.first.setdefault(bad.reason, f"{where}: {bad.detail}")
                continue
            key = sample_id_of(prompt_part(messages))
            if key in seen:
                report.duplicates += 1
                continue
            seen.add(key)
            split = "validation" if is_validation(key, fraction) else "train"
            if split == "train":
                report.nearest = min(report.nearest, (_position(key), report.kept["train"]))
            report.kept[split] += 1
            report.with_response += any(m["role"] == "assistant" and m["content"].strip() for m in messages)
            writers[split].write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return report


def _fill_validation(report: PrepareReport, partial: dict) -> None:
    """Move the train conversation nearest the cut to the empty validation file (see the module contract)."""
    if report.kept["validation"] or report.kept["train"] < 2:
        return
    line_no, kept = report.nearest[1], partial["train"].with_suffix(".rest")
    with open(partial["train"], encoding="utf-8") as src, open(kept, "w", encoding="utf-8") as rest, \
            open(partial["validation"], "w", encoding="utf-8") as val:
        for k, line in enumerate(src):
            (val if k == line_no else rest).write(line)
    os.replace(kept, partial["train"])
    report.kept["train"] -= 1
    report.kept["validation"] += 1
    report.moved = True


def run_prepare_data(inputs: list[str], *, out: str = DEFAULT_OUT,
                     validation_fraction: float = DEFAULT_VALIDATION_FRACTION, splits: Optional[list[str]] = None,
                     prompt_col: Optional[str] = None, response_col: Optional[str] = None,
                     command: str = "") -> int:
    """Convert `inputs` into OUT/train.jsonl and OUT/validation.jsonl (see the module contract). Returns 0."""
    if not inputs:
        raise PrepareError("no inputs: pass one or more files or directories, e.g. dflash prepare-data chats.jsonl")
    if not 0.0 < validation_fraction < 1.0:
        raise PrepareError(f"--validation-fraction {validation_fraction} is outside (0, 1); 0.01 is the recipe's")
    if response_col and not prompt_col:
        raise PrepareError("--response-col needs --prompt-col (the column of the user turn)")
    out_dir = Path(out)
    _check_paths(inputs, out_dir)
    for f in inputs:  # all of them before any work, so a typo in the last one costs nothing
        if not Path(f).exists():
            raise PrepareError(f"input {f} does not exist; pass a JSON/JSONL file, a parquet file or directory, or "
                               "a datasets directory written by save_to_disk")
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = {split: out_dir / f"{split}.jsonl.partial" for split in ("train", "validation")}
    writers = {split: open(p, "w", encoding="utf-8") for split, p in partial.items()}
    try:
        report = _convert(inputs, writers, validation_fraction, splits, prompt_col, response_col)
    except BaseException:
        for split, w in writers.items():
            w.close()
            partial[split].unlink(missing_ok=True)
        raise
    for w in writers.values():
        w.close()
    _fill_validation(report, partial)
    lines = report.lines(inputs, out_dir)
    if not sum(report.kept.values()):
        for p in partial.values():
            p.unlink(missing_ok=True)
        raise PrepareError(f"no usable conversation in {', '.join(inputs)} ({'; '.join(x.strip() for x in lines[1:])}"
                           f"); check the layout, or name the columns with --prompt-col/--response-col")
    for split, p in partial.items():
        os.replace(p, out_dir / f"{split}.jsonl")
    record = {"kind": "dflash-prepare-data", "command": command, "inputs": [str(f) for f in inputs],
              "validation_fraction": validation_fraction, "split_rule": "data.ingest.is_validation of the prompt turns",
              "rows_read": report.rows_read, "conversations": dict(report.kept), "with_response": report.with_response,
              "skipped": dict(report.skipped), "first_bad_row": report.first, "duplicates": report.duplicates}
    (out_dir / REPORT).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    for line in lines:
        print(line, file=sys.stderr)
    files = ",".join(str(out_dir / name) for name in OUTPUTS)
    print(f"prepare-data: next, let the target answer them: dflash regenerate --config CONFIG --prompts {files} "
          "--out data/regen", file=sys.stderr)
    return 0
