"""pipeline/tau_record.py: context buckets, the record's validation on write and read, atomic replace."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import UserError
from pipeline.tau_record import TAU_FILE, TauRecordError, context_bucket, read_tau, write_tau

GOOD = {"schema": 1, "evaluated": True, "reason": None, "tau_offline": 4.5, "tau_online": 4.25,
        "tokens_per_target_forward": 4.0, "block_size": 16, "temperature": 0.0, "prompt_fingerprint": "p" * 64,
        "target_fingerprint": None, "by_context": {"<512": {"tau_offline": 4.5, "tau_online": None, "n": 3}}}


def test_context_bucket_edges():
    assert [context_bucket(n) for n in (0, 511, 512, 2047, 2048, 8191, 8192, 10**6)] == [
        "<512", "<512", "512-2K", "512-2K", "2K-8K", "2K-8K", ">8K", ">8K"]
    with pytest.raises(ValueError):
        context_bucket(-1)


def test_write_then_read_round_trips_and_leaves_no_temporary(tmp_path):
    assert read_tau(tmp_path) is None  # absent: None, not an error
    path = write_tau(tmp_path, GOOD)
    assert path == tmp_path / TAU_FILE and read_tau(tmp_path) == GOOD
    write_tau(tmp_path, {**GOOD, "tau_online": 2.0})  # replaces
    assert read_tau(tmp_path)["tau_online"] == 2.0 and sorted(p.name for p in tmp_path.iterdir()) == [TAU_FILE]


@pytest.mark.parametrize("change, words", [
    ({"block_size": 0}, "block_size is 0, not a positive integer"),
    ({"evaluated": False}, "evaluated is false but no reason"),
    ({"extra": 1}, "unknown keys ['extra']"),
    ({"schema": 2}, "schema 2"),
    ({"by_context": {"1K": {"tau_offline": 1.0, "tau_online": 1.0, "n": 1}}}, "bucket '1K'"),
    ({"tau_online": "high"}, "tau_online is 'high'"),
])
def test_malformed_records_are_refused_in_one_line(tmp_path, change, words):
    with pytest.raises(TauRecordError, match="refusing to write") as e:
        write_tau(tmp_path, {**GOOD, **change})
    assert words in str(e.value) and not (tmp_path / TAU_FILE).exists()
    (tmp_path / TAU_FILE).write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(UserError) as e:
        read_tau(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and words in msg and str(tmp_path / TAU_FILE) in msg and "dflash eval" in msg


def test_unreadable_json_names_the_file(tmp_path):
    (tmp_path / TAU_FILE).write_text("{not json")
    with pytest.raises(TauRecordError, match="is not readable JSON"):
        read_tau(tmp_path)
    without = dict(GOOD)
    del without["by_context"]
    (tmp_path / TAU_FILE).write_text(json.dumps(without))
    with pytest.raises(TauRecordError, match=r"missing keys \['by_context'\]"):
        read_tau(tmp_path)
