"""Store facts with one owner (issue 29 item 1): the sharding rule `shard_rows` and the checked read of every
shard's commit record `read_all_progress`, on a small three-shard store (one finished, one part-written, one not
started) built once per module."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import store as st
from pipeline.encoding import encode
from pipeline.provenance import create_or_open_store
from pipeline.store_reader import StoreReader
from pipeline.store_writer import ShardWriter

HIDDEN, LAYERS = 64, [1, 3]
PROV = {"schema_version": st.SCHEMA_VERSION, "target": {"name": "t", "hidden_size": HIDDEN, "vocab_size": 100,
        "num_hidden_layers": 8, "tie_word_embeddings": False}, "layer_ids": LAYERS, "hidden_size": HIDDEN,
        "encoding": "int5", "chunk_tokens": 8, "clevel": 1, "num_shards": 3,
        "dataset": {"fingerprint": "t", "validation_samples": 0}, "max_length": 64}


# ----------------------------------------------------------------------------------------------------------
# shard_rows: the one sharding rule
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 11])
def test_shard_rows_is_the_slice_rule_for_every_kind_of_rows(num_shards):
    items = [f"s{k}" for k in range(10)]
    parts = []
    for i in range(num_shards):
        mine = st.shard_rows(items, i, num_shards)
        assert mine == items[i::num_shards]
        assert st.shard_rows(tuple(items), i, num_shards) == tuple(items)[i::num_shards]
        assert st.shard_rows(range(10), i, num_shards) == range(10)[i::num_shards]
        assert st.shard_rows(np.arange(10), i, num_shards).tolist() == list(range(10))[i::num_shards]
        lines = io.StringIO("".join(f"{x}\n" for x in items))  # an iterable that cannot be sliced: a file
        assert st.shard_rows(lines, i, num_shards) == [f"{x}\n" for x in items[i::num_shards]]
        parts += mine
    assert sorted(parts) == sorted(items)  # every row in exactly one shard


@pytest.mark.parametrize("shard, num_shards, match", [
    (2, 2, r"shard index 2 is out of range for 2 shard\(s\): shards are numbered 0\.\.1"),
    (-1, 3, r"shard index -1 is out of range for 3 shard\(s\)"),
    (True, 2, "shard index True"),
    (1.0, 2, "shard index 1.0"),
    (0, 0, "the number of shards must be a whole number of at least 1, got 0"),
    (0, "2", "the number of shards must be a whole number"),
])
def test_shard_rows_refuses_a_shard_that_does_not_exist(shard, num_shards, match):
    with pytest.raises(st.StoreError, match=match):
        st.shard_rows(list(range(6)), shard, num_shards)


def test_shard_rows_takes_numpy_integers():
    assert st.shard_rows(list(range(6)), np.int64(1), np.int64(2)) == [1, 3, 5]


# ----------------------------------------------------------------------------------------------------------
# read_all_progress: every shard's commit record, checked
# ----------------------------------------------------------------------------------------------------------


def _write(path: str, shard: int, lengths: list[int], finish: bool) -> None:
    g = torch.Generator().manual_seed(shard)
    with ShardWriter(path, shard, PROV) as w:
        w.start("plan", len(lengths) + (0 if finish else 1), sum(lengths))
        for k, n in enumerate(lengths):
            parts = {key: v.numpy() for key, v in encode(torch.randn(n, len(LAYERS), HIDDEN, generator=g), "int5").items()}
            w.write_batch(np.array([shard * 100 + k + 1], np.uint64), np.zeros(1, np.uint8), np.array([n], np.int32),
                          np.arange(n, dtype=np.int32) % 100, np.ones(n, np.uint8), parts)
        if finish:
            w.finish()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("rules") / "s.zarr")
    create_or_open_store(path, PROV)
    _write(path, 0, [12, 20], finish=True)
    _write(path, 1, [9], finish=False)
    return path  # shard 2 never started


@pytest.fixture
def copy(store, tmp_path) -> str:
    dst = tmp_path / "c.zarr"
    shutil.copytree(store, dst)
    return str(dst)


def test_read_all_progress_gives_every_shard_in_order(store):
    states = st.read_all_progress(store)
    assert [s.index for s in states] == [0, 1, 2]
    assert [s.started for s in states] == [True, True, False]
    assert [s.done for s in states] == [True, False, False]
    assert [s.problem for s in states] == [None, None, None]
    assert states[2].progress is None and states[2].group is None
    for s in states[:2]:
        assert s.progress == st.shard_progress(store, s.index)  # the same record as the one-shard read
    assert (states[0].progress.committed_samples, states[0].progress.committed_tokens) == (2, 32)
    assert (states[1].progress.committed_samples, states[1].progress.committed_tokens) == (1, 9)
    assert states[1].group["tokens"].shape[0] >= 9  # the group, for a caller that reads its arrays


def _damage_progress(path: str, shard: int) -> None:
    meta = Path(path) / st.shard_name(shard) / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["progress"]["committed_tokens"] += 4  # edited without its checksum
    meta.write_text(json.dumps(doc))


def test_a_record_that_fails_its_checksum_raises_as_read_progress_does(copy):
    _damage_progress(copy, 1)
    with pytest.raises(st.StoreDataError) as one:
        st.shard_progress(copy, 1)  # the one-shard read (read_progress)
    with pytest.raises(st.StoreDataError) as every:
        st.read_all_progress(copy)
    assert str(every.value) == str(one.value)
    assert "progress record of shard 1 of" in str(every.value) and "does not match its checksum" in str(every.value)
    with pytest.raises(st.StoreDataError, match="progress record of shard 1 .* does not match its checksum"):
        StoreReader(copy, require_complete=False)  # the reader's open reads them the same way
    from stages.inspect import store_summary

    with pytest.raises(st.StoreDataError, match="progress record of shard 1"):
        store_summary(copy)  # inspect and status no longer show an unchecked record


def test_report_hands_a_failing_record_back_with_its_problem(copy):
    _damage_progress(copy, 1)
    states = st.read_all_progress(copy, report=True)
    bad = states[1]
    meta = json.loads((Path(copy) / st.shard_name(1) / "zarr.json").read_text())["attributes"]
    assert bad.problem == st.progress_problem(copy, 1, meta, integrity=True)
    assert bad.progress is None and not bad.done and bad.started
    assert states[0].progress == st.shard_progress(copy, 0) and states[0].problem is None  # the others as read
    assert states[2].progress is None and states[2].problem is None and not states[2].started


def test_read_all_progress_of_no_store(tmp_path):
    with pytest.raises(st.StoreError, match="no store at"):
        st.read_all_progress(str(tmp_path / "absent.zarr"))
