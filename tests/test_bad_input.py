"""Bad input gets one clear line before anything runs (issue 27, item 6): the CLI's count options, and JSON rows
that are deeply nested, hold a lone surrogate or are oversized (data/ingest.py, data/prompts.py)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main


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
