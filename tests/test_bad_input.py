"""Bad input gets one clear line before anything runs (issue 27, item 6): the CLI's count options, and JSON rows
that are deeply nested, hold a lone surrogate or are oversized (data/ingest.py, data/prompts.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import TINY  # noqa: E402
from stages.cli import main  # noqa: E402


def _refuse_stage(monkeypatch):
    """Any stage the CLI would call fails the test: a bad count must be refused while parsing."""
    import stages.regenerate
    import stages.run

    def called(*_a, **_k):
        raise AssertionError("the stage ran: the bad count was not refused at parse time")

    monkeypatch.setattr(stages.run, "run_node", called)
    monkeypatch.setattr(stages.regenerate, "run_regenerate", called)


@pytest.mark.parametrize("args,option", [
    (["run", "--devices", "0"], "--devices"),
    (["run", "--devices", "-1"], "--devices"),
    (["regenerate", "--prompts", "p.jsonl", "--out", "o", "--shards", "0"], "--shards"),
    (["regenerate", "--prompts", "p.jsonl", "--out", "o", "--shards", "-1"], "--shards"),
    (["extract", "--shards", "0"], "--shards"),
    (["train", "--devices", "-1"], "--devices"),
])
def test_count_options_are_refused_at_parse_time(args, option, monkeypatch, tmp_path):
    _refuse_stage(monkeypatch)
    r = CliRunner().invoke(main, [*args, "--set", f"store.path={tmp_path / 's.zarr'}"])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.output and ">=1" in r.output
    assert not (tmp_path / "s.zarr").exists() and list(tmp_path.iterdir()) == []


def test_every_integer_option_of_the_cli_has_a_range():
    """A plain `type=int` option takes 0 and negatives: every integer option says what it accepts."""
    plain = []
    for name, cmd in main.commands.items():
        for p in cmd.params:
            if isinstance(p, click.Option) and p.type is click.INT:
                plain.append(f"{name} {p.opts[0]}")
    assert plain == []


# --- JSON rows (data/ingest.py): deeply nested, lone surrogate, oversized --------------------------------------

NESTED = '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}"  # RecursionError inside json.loads
LONG_INT = '{"messages": [], "n": 1' + "0" * 5000 + "}"  # ValueError: over Python's 4300-digit int limit
LIST_ROLE = '{"messages": [{"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "ok"}]}'
SURROGATE = '{"messages": [{"role": "user", "content": "hi \\ud800 there"}, {"role": "assistant", "content": "ok"}]}'


def _good_rows(n: int) -> list[str]:
    from regen_helpers import TINY_TRAIN

    return TINY_TRAIN.read_text().splitlines()[:n]


def _big_row(n_bytes: int) -> str:
    """A valid row of about n_bytes: one long assistant turn."""
    text = ("the cat sat on the mat. " * (n_bytes // 24 + 1))[:n_bytes]
    return json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]})


@pytest.mark.parametrize("row,reason", [
    (NESTED, r"line 2: invalid JSON \(nested deeper than the JSON parser allows\)"),
    (LONG_INT, r"line 2: invalid JSON \(Exceeds the limit \(4300 digits\)"),
    (LIST_ROLE, r"line 2: turn 0 has role \['user'\] \(expected one of"),
    (SURROGATE, r"line 2: turn 0 content holds a lone surrogate '\\ud800' at character 3"),
    (_big_row(3 << 20), r"line 2: the row is 3,145,\d+ bytes, over the cap of 1,048,576 \(64 per token of "
                        r"data\.max_length, at least 1 MiB\).*raise data\.max_length"),
])
def test_a_bad_json_row_is_one_line_naming_file_and_line(row, reason, tmp_path):
    from data.ingest import IngestError, read_conversations, row_byte_cap

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([_good_rows(1)[0], row, _good_rows(2)[1]]) + "\n")
    with pytest.raises(IngestError, match=re.escape(str(path)) + ", " + reason) as e:
        list(read_conversations(path, "error", max_row_bytes=row_byte_cap(256)))
    assert "\n" not in str(e.value) and "on_bad_row=skip" in str(e.value)


def test_on_bad_row_skip_skips_and_counts_every_malformed_row(tmp_path):
    """Through ingest (the cap follows data.max_length): the good rows become samples, each bad one is counted."""
    from data.ingest import ingest
    from pipeline.config import load_config
    from pipeline.target import load_tokenizer
    from regen_helpers import TINY_TARGET

    good = _good_rows(3)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([good[0], NESTED, SURROGATE, good[1], _big_row(3 << 19), "{not json", LONG_INT,
                               LIST_ROLE, good[2]]) + "\n")
    tok = load_tokenizer(str(TINY_TARGET))
    cfg = load_config(TINY, [f"data.train_files=[{path}]", "data.on_bad_row=skip", "data.validation_files=[]",
                             "data.validation_fraction=0"])
    samples, report = ingest(cfg.data, tok)
    assert len(samples) == 3 and report.rows_read == 9
    assert dict(report.skipped) == {"invalid JSON": 3, "invalid text": 1, "oversized row": 1, "unknown role": 1}
    # a longer data.max_length raises the cap (64 bytes per token): the 1.5 MiB row is then read, and kept
    cfg = load_config(TINY, [f"data.train_files=[{path}]", "data.on_bad_row=skip", "data.validation_files=[]",
                             "data.validation_fraction=0",
                             "data.max_length=30000", "drafter.max_position_embeddings=30000"])
    samples, report = ingest(cfg.data, tok)
    assert len(samples) == 4 and "oversized row" not in report.skipped
    assert max(len(s.input_ids) for s in samples) == 30000  # truncated to max_length as before


def test_an_oversized_line_is_never_held_whole(tmp_path):
    """A 50 MB line (issue 27: 49 s and 5.6 GB, tokenised whole) is skipped in bounded pieces: peak Python memory
    stays near the 1 MiB cap, and the rows after it keep their line numbers."""
    import tracemalloc

    from data.ingest import IngestReport, read_conversations, row_byte_cap

    path = tmp_path / "big.jsonl"
    good = _good_rows(2)
    with open(path, "w") as f:
        f.write(good[0] + "\n" + _big_row(50_000_000) + "\n" + good[1] + "\n")
    report = IngestReport()
    tracemalloc.start()
    try:
        rows = [(line, m) for _s, line, m in read_conversations(path, "skip", report=report,
                                                                max_row_bytes=row_byte_cap(256))]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [line for line, _ in rows] == [1, 3] and dict(report.skipped) == {"oversized row": 1}
    assert peak < 8 << 20, f"peak {peak:,} bytes"
