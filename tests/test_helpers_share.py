"""tests/helpers_share.py, what the suite's pytest-xdist workers share: a session fixture built once for all
workers, and the machine a test may take alone (two Machine objects stand for two workers: flock locks belong
to an open file, so they exclude each other within one process as between two)."""

from __future__ import annotations

import threading

import pytest

from helpers_share import Machine, build_once


class _Factory:
    """A worker's tmp_path_factory as build_once uses it: its base temp under the run's shared directory."""

    def __init__(self, base):
        base.mkdir(parents=True, exist_ok=True)
        self.base = base

    def getbasetemp(self):
        return self.base


def test_a_fixture_is_built_once_for_all_workers_and_again_after_a_failed_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    builds = []

    def build(d):
        builds.append(d)
        (d / "made").write_text(str(len(builds)))

    first = build_once(_Factory(tmp_path / "popen-gw0"), "store", build)
    second = build_once(_Factory(tmp_path / "popen-gw1"), "store", build)
    assert first == second == tmp_path / "shared-store" and len(builds) == 1 and (first / "made").read_text() == "1"

    def broken(d):
        (d / "half").write_text("")
        raise RuntimeError("extraction failed")

    with pytest.raises(RuntimeError):
        build_once(_Factory(tmp_path / "popen-gw0"), "other", broken)
    again = build_once(_Factory(tmp_path / "popen-gw1"), "other", build)
    assert sorted(p.name for p in again.iterdir()) == ["made"]  # rebuilt from an empty directory


def test_alone_waits_for_the_other_workers_test_and_holds_their_next_one(tmp_path):
    a, b = Machine(tmp_path), Machine(tmp_path)
    events: list[str] = []
    b_alone, b_done, a_next = threading.Event(), threading.Event(), threading.Event()

    def worker_b():
        with b.shared():
            b.alone()
            events.append("b alone")
            b_alone.set()
            b_done.wait(30)
            events.append("b shares")
            b.share()

    def worker_a_next_test():
        with a.shared():
            events.append("a next test")
            a_next.set()

    test_of_a = a.shared()
    test_of_a.__enter__()
    t = threading.Thread(target=worker_b)
    t.start()
    assert not b_alone.wait(0.5)  # b waits while a's test runs
    test_of_a.__exit__(None, None, None)
    assert b_alone.wait(30)
    u = threading.Thread(target=worker_a_next_test)
    u.start()
    assert not a_next.wait(0.5)  # a's next test waits while b is alone
    b_done.set()
    assert a_next.wait(30)
    t.join(30)
    u.join(30)
    assert events == ["b alone", "b shares", "a next test"]
    a.close()
    b.close()


def test_the_slowest_first_table_names_files_of_the_suite():
    """conftest.FILE_SECONDS orders the files under xdist; a renamed file would silently lose its place."""
    from pathlib import Path

    from conftest import FILE_SECONDS

    here = Path(__file__).resolve().parent
    assert [n for n in FILE_SECONDS if not (here / n).is_file()] == []
    assert list(FILE_SECONDS.values()) == sorted(FILE_SECONDS.values(), reverse=True)
