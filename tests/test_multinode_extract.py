"""Extraction across nodes (issue 32): one `dflash extract` call per node runs a set of shards
(`--shard-index 0,2` and `--shard-index 1` of the same `--shards 3`), both at once into one store; the result
equals a one-node extraction. `dflash status STORE` names each shard's host, rate and ETA while nodes write;
shard sets are parsed and the ambiguous combinations refused with one line."""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from helpers_cli import TINY, dflash, dflash_all, dflash_each  # side by side / refusals in one subprocess
from pipeline import store as st
from pipeline.provenance import create_or_open_store
from pipeline.store_writer import ShardWriter

# 60 samples (20 a shard, ~1,100 tokens: two or more batches each at this token budget); the equality with one node
# needs no more (it ran with the session tiny store's options before: 240 samples at 4,096 tokens). Three shards: one
# node takes a set with a gap (0,2), the other the shard between (it was 0,3 and 1-2 of four: two worker processes
# more, and the shard-set syntax has its own test below)
OPTS = ["--set", "data.max_samples=60", "--set", "extract.token_budget=1024"]


def _content(path: str) -> dict:
    """Every shard's arrays and commit record, the frozen head's bytes, the provenance without who/when."""
    root = zarr.open_group(path, mode="r")
    attrs = st.read_root_attrs(path)
    out = {"provenance": {k: v for k, v in attrs.items() if k not in ("created_by", "created_at")},
           "head": Path(st.frozen_head_path(path)).read_bytes()}
    for i in range(attrs["num_shards"]):
        g = root[st.shard_name(i)]
        out[i] = {"progress": dict(g.attrs)["progress"], **{name: g[name][:].tobytes() for name in sorted(g.array_keys())}}
    return out


@pytest.mark.slow
def test_two_nodes_extract_disjoint_shard_sets_into_one_store_equal_to_one_node(tmp_path):
    ref, store = str(tmp_path / "one-node.zarr"), str(tmp_path / "two-nodes.zarr")
    # the one-node reference and the two nodes' calls, all at once (each exits 0, or the test fails with its output)
    _, *nodes = dflash_all(["extract", "--config", TINY, "--shards", "3", "--store", ref, *OPTS],
                           *[["extract", "--config", TINY, "--shards", "3", "--shard-index", shards, "--store", store,
                              *OPTS] for shards in ("0,2", "1")])
    outs = [r.stderr for r in nodes]
    assert "finished shard(s) [0, 2]" in outs[0] and "finished shard(s) [1]" in outs[1]
    assert "complete" in outs[0] + outs[1]  # whichever finished last saw the whole store done
    got, want = _content(store), _content(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k], f"{k} differs from the one-node extraction"
    logs = Path(store) / "logs"
    assert {f.name for f in logs.glob("extract-status*.json")} == {"extract-status-from-00000.json",
                                                                    "extract-status-from-00001.json"}
    r = dflash("status", store)
    assert f"extraction {store}: finished" in r.stdout and all(f"shard {i}: done" in r.stdout for i in range(3))


def test_status_names_each_shards_host_rate_and_eta_while_nodes_write(tmp_path):
    """Two shards half written by live writers (their locks heartbeat) and two nodes' status records."""
    from stages.status import show_status

    path = str(tmp_path / "s.zarr")
    prov = {"schema_version": st.SCHEMA_VERSION, "target": {"name": "t", "hidden_size": 8, "vocab_size": 100,
            "num_hidden_layers": 2, "tie_word_embeddings": False}, "layer_ids": [1], "hidden_size": 8,
            "encoding": "bf16", "chunk_tokens": 64, "clevel": 1, "num_shards": 2,
            "dataset": {"fingerprint": "t", "validation_samples": 0}, "max_length": 64}
    create_or_open_store(path, prov)
    writers = []
    for i in range(2):
        w = ShardWriter(path, i, prov)
        w.start("plan", 4, 40)
        w.write_batch(np.array([i + 1], np.uint64), np.zeros(1, np.uint8), np.array([10], np.int32),
                      np.arange(10, dtype=np.int32), np.ones(10, np.uint8),
                      {"features": np.zeros((10, 1, 8), np.uint16)})
        writers.append(w)
    logs = Path(path) / "logs"
    logs.mkdir()
    now = time.time()
    for i, host in enumerate(("node-a", "node-b")):
        (logs / f"extract-status-from-{i:05d}.json").write_text(json.dumps(
            {"state": "running", "line": f"extract: node {i}", "pid": 1, "time": now, "host": host, "error": "",
             "shards": {str(i): {"tokens": 10, "planned_tokens": 40, "rate_tok_s": 5.0 + i, "eta_s": 30.0 / (5 + i)}}}))
    try:
        out = io.StringIO()
        assert show_status(path, out=out) == 0
        text = out.getvalue()
    finally:
        for w in writers:
            w.lock.release()
    me = socket.gethostname()
    assert f"extraction {path}: running (2 of 2 extraction calls)" in text, text
    assert "extract: node 0  (node-a)" in text and "extract: node 1  (node-b)" in text, text
    assert f"shard 0: not done, 1 samples, 10 tokens committed (25%), on {me} (heartbeat 0s ago), 5 tok/s, ETA 0m06s" \
        in text, text
    assert f"shard 1: not done, 1 samples, 10 tokens committed (25%), on {me} (heartbeat 0s ago), 6 tok/s, ETA 0m05s" \
        in text, text


def test_shard_sets_parse_and_ambiguous_combinations_are_refused():
    from stages.extract import ExtractError, parse_shard_set, shard_gpus

    assert parse_shard_set("0-4", 8) == [0, 1, 2, 3, 4]
    assert parse_shard_set("4,0,2", 8) == [0, 2, 4]
    assert parse_shard_set("0-1,5", 8) == [0, 1, 5]
    assert parse_shard_set(3, 8) == [3] and parse_shard_set(None, 8) is None
    for bad, msg in [("0-9", r"shard\(s\) \[8, 9\] out of range for --shards 8"), ("2,2", "names a shard twice"),
                     ("0,1-2,2", "names a shard twice"), ("4-2", "runs backwards; write 2-4"), ("a", "expected shard"),
                     ("1-", "expected shard")]:
        with pytest.raises(ExtractError, match=msg):
            parse_shard_set(bad, 8)
    # a node's set: the j-th shard on the j-th GPU, or on --gpus' j-th entry; any other --gpus length is refused
    assert shard_gpus(None, 8, "4-7", 4) == {4: 0, 5: 1, 6: 2, 7: 3}
    assert shard_gpus([3, 1], 8, "2,6", 4) == {2: 3, 6: 1}
    with pytest.raises(ExtractError, match="runs 3 shards here: give --gpus 3 GPUs"):
        shard_gpus([0, 1, 2, 3, 4, 5, 6, 7], 8, "0-2", 8)
    assert shard_gpus(None, 8, 5, 4) == {5: 0}  # one shard, as before


BAD_SETS = [("0-9", "error: --shard-index 0-9: shard(s) [4, 5, 6, 7, 8, 9] out of range for --shards 4"),
            ("1,1", "names a shard twice"), ("x", "'x': expected shard indices such as 3, 0-4")]


@pytest.mark.slow  # the three refusals: three commands, one subprocess (helpers_cli.dflash_each)
def test_cli_refuses_a_bad_shard_set_before_writing(tmp_path):
    stores = [tmp_path / f"s{i}.zarr" for i in range(len(BAD_SETS))]
    runs = dflash_each(*[["extract", "--config", TINY, "--shards", "4", "--shard-index", value, "--store", str(store)]
                         for (value, _), store in zip(BAD_SETS, stores)])
    for (value, text), store, r in zip(BAD_SETS, stores, runs):
        assert r.returncode == 2 and text in r.stderr, (value, r.stderr)
        errors = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("extract: config ")]  # start-up line
        assert value == "x" or len(errors) == 1, r.stderr  # (click's own usage error: 3 lines)
        assert not store.exists(), value
