"""One user-error base (pipeline/errors.py): every error a user can fix subclasses `UserError` and keeps its
older built-in base; the CLI prints it as one `error:` line with exit code 2 and no traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.errors import UserError


def _user_error_classes():
    from data.ingest import ChatTemplateError, IngestError
    from pipeline.checkpoint import CheckpointError
    from pipeline.config import ConfigError
    from pipeline.preflight import PreflightError
    from pipeline.store import StoreDataError, StoreError
    from pipeline.store_lock import ShardLockedError
    from stages.eval_online import EvalError
    from stages.extract import ExtractError
    from stages.regen_records import RegenError
    from stages.run import RunError
    from stages.train import TrainError

    return [(ConfigError, ValueError), (CheckpointError, ValueError), (PreflightError, RuntimeError),
            (StoreError, RuntimeError), (StoreDataError, RuntimeError), (ShardLockedError, RuntimeError),
            (ExtractError, RuntimeError), (EvalError, RuntimeError), (RegenError, RuntimeError),
            (RunError, RuntimeError), (TrainError, RuntimeError), (IngestError, ValueError),
            (ChatTemplateError, ValueError)]


@pytest.mark.parametrize("cls,old", _user_error_classes(), ids=lambda c: getattr(c, "__name__", str(c)))
def test_every_user_error_has_the_one_base_and_keeps_its_old_one(cls, old):
    assert issubclass(cls, UserError) and issubclass(cls, old)


@pytest.mark.parametrize("cls", [c for c, _ in _user_error_classes()], ids=lambda c: c.__name__)
def test_the_cli_prints_one_line_and_exits_2(cls, monkeypatch):
    import click

    from stages import cli

    @click.command()
    def boom():
        cli._run(lambda: (_ for _ in ()).throw(cls("what is wrong; what to do")))

    r = CliRunner().invoke(boom)
    assert r.exit_code == 2 and r.output.strip() == "error: what is wrong; what to do", r.output


def test_a_bug_keeps_its_traceback():
    import click

    from stages import cli

    @click.command()
    def boom():
        cli._run(lambda: 1 / 0)

    r = CliRunner().invoke(boom)
    assert r.exit_code == 1 and isinstance(r.exception, ZeroDivisionError)
