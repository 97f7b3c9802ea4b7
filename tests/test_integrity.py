"""Nothing lost, nothing silently wrong (issue #23), on a small store built once per module: damaged or deleted
chunks of every array stop the training loader and are named by verify; checksums of the provenance, the
progress records and the frozen head; one writer per shard (refusal naming host and pid, stale-lock
takeover, a takeover race, a writer that lost its lock never shrinks the shard); stale *.partial files;
CLI counts and --gpus; train compares the target's fingerprint, not its name."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from data.store_dataset import StoreDataset, worker_init
from pipeline import store as st
from pipeline.encoding import encode
from pipeline.store_reader import StoreReader, chunk_key
from pipeline.store_writer import ShardWriter
from pipeline.provenance import (check_frozen_head, create_or_open_store, load_frozen_head,
                                 start_frozen_head_check, target_differences, write_frozen_head)
from pipeline.procinfo import machine_id
from pipeline.store_lock import ShardLock, ShardLockedError, lock_path
from stages.verify import verify_store

from helpers_cli import HANG_S  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
VOCAB, HIDDEN, LAYERS = 100, 64, [1, 3]
ARRAYS = (*st.token_arrays("int5"), *st.SAMPLE_ARRAYS)


def _prov(num_shards: int = 1) -> dict:
    return {"schema_version": st.SCHEMA_VERSION, "target": {"name": "t", "hidden_size": HIDDEN, "vocab_size": VOCAB,
            "num_hidden_layers": 8, "tie_word_embeddings": False}, "layer_ids": LAYERS, "hidden_size": HIDDEN,
            "encoding": "int5", "chunk_tokens": 8, "clevel": 1, "num_shards": num_shards,
            "dataset": {"fingerprint": "t", "validation_samples": 0}, "max_length": 512}


def _batch(g: torch.Generator, n: int, sid: int, prompt: int = 10):
    """One sample of n tokens as write_batch's arguments; the first `prompt` tokens are unsupervised."""
    parts = {k: v.numpy() for k, v in encode(torch.randn(n, len(LAYERS), HIDDEN, generator=g), "int5").items()}
    mask = np.ones(n, np.uint8)
    mask[:prompt] = 0
    return (np.array([sid], np.uint64), np.zeros(1, np.uint8), np.array([n], np.int32),
            (np.arange(n, dtype=np.int32) * 7 + sid) % VOCAB, mask, parts)


def _head(nan: bool = False) -> bytes:
    from safetensors.torch import save

    g = torch.Generator().manual_seed(1)
    t = {k: torch.randn(VOCAB, HIDDEN, generator=g) for k in ("embed_tokens.weight", "lm_head.weight")}
    t["norm.weight"] = torch.ones(HIDDEN)
    if nan:
        t["lm_head.weight"][3, 5] = float("nan")
    return save(t, metadata={"tie_word_embeddings": "false"})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """12 samples in one shard, all "train" (an all-zero split chunk) and a first sample whose 300-token prompt
    makes loss_mask chunks 0 and 1 all zero: zarr's default leaves such chunks out, and the store must not."""
    path = str(tmp_path_factory.mktemp("integrity") / "s.zarr")
    create_or_open_store(path, _prov())
    g = torch.Generator().manual_seed(0)
    lengths = [320] + [int(n) for n in torch.randint(40, 200, (11,), generator=g)]
    with ShardWriter(path, 0, _prov()) as w:
        w.start("plan", len(lengths), sum(lengths))
        for i, n in enumerate(lengths):
            w.write_batch(*_batch(g, n, i + 1, prompt=300 if i == 0 else 10))
        w.finish()
    write_frozen_head(path, _head())
    return path


@pytest.fixture
def copy(store, tmp_path):
    dst = tmp_path / "c.zarr"
    shutil.copytree(store, dst)
    return str(dst)


def _verify(path: str) -> tuple[int, str]:
    out = io.StringIO()
    return verify_store(path, out=out), out.getvalue()


def _chunk(path: str, name: str, c: int) -> Path:
    arr = StoreReader(path).shards[0][name]
    return Path(path) / st.shard_name(0) / name / chunk_key(arr, c)


def _read_all(path: str) -> None:
    ds = StoreDataset(path, list(range(12)), num_anchors=8, seed=0)
    for i in range(len(ds)):
        ds[i]


def test_all_zero_chunks_are_stored_and_the_store_verifies(store):
    assert _chunk(store, "split", 0).is_file() and _chunk(store, "loss_mask", 0).is_file()
    assert StoreReader(store).read(0)["loss_mask"][:300].sum() == 0
    rc, out = _verify(store)
    assert rc == 0 and "is valid: 12 samples" in out, out
    assert not (Path(store) / "locks" / "shard-00000.lock").exists()  # released at finish


@pytest.mark.parametrize("kind", ["deleted", "flipped"])
@pytest.mark.parametrize("name", ARRAYS)
def test_damaged_chunk_stops_the_loader_and_verify_names_it(copy, name, kind):
    c = 0 if name in st.SAMPLE_ARRAYS else 1
    f = _chunk(copy, name, c)
    if kind == "deleted":
        f.unlink()
    else:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    with pytest.raises(st.StoreDataError) as e:
        _read_all(copy)
    msg = str(e.value)
    assert f"damaged store {copy}: shard 0, array {name}, chunk {c} " in msg
    assert ("is missing" if kind == "deleted" else "checksum does not match") in msg
    assert ("shard positions 0..11" if name == "sample_id" else "sample ids") in msg and f"dflash verify {copy}" in msg
    rc, out = _verify(copy)
    assert rc == 1 and f"shard 0: array {name}, chunk {c} " in out, out


def test_verify_names_the_chunk_of_values_that_cannot_be_right(copy):
    """Chunks that decode fine but hold impossible values (written with a valid checksum)."""
    import zarr

    g = zarr.open_group(copy, mode="a")[st.shard_name(0)]
    g["tokens"][130] = VOCAB + 3  # tokens chunk 1 (128 rows per chunk)
    g["scales"][70] = np.float16("nan")  # features chunk 8 (8 rows per chunk) decodes to NaN
    g["sample_id"][7] = g["sample_id"][2]
    g["sample_length"][4] += 1
    rc, out = _verify(copy)
    assert rc == 1, out
    assert f"shard 0: array tokens, chunk 1 (rows 128..255) holds token ids outside the vocabulary [0, {VOCAB})" in out
    assert "shard 0: array features, chunk 8 (rows 64..71) decodes to non-finite values (first at row 70" in out
    assert "shard 0: array sample_id, chunk 0 (rows 0..8191) repeats sample id 0000000000000003 (at sample position 7)" in out
    assert "shard 0: array sample_start, chunk 0 (rows 0..8191) holds offsets that are not contiguous" in out


@pytest.mark.slow  # a spawned loader worker process (its shutdown after the error takes ~5 s more)
def test_a_damaged_chunk_read_in_a_loader_worker_is_one_clear_error(copy):
    _chunk(copy, "features", 2).unlink()
    ds = StoreDataset(copy, list(range(12)), num_anchors=8, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn",
                                     worker_init_fn=worker_init)
    with pytest.raises(st.StoreDataError) as e:
        list(dl)
    msg = str(e.value)
    assert msg.startswith(f"damaged store {copy}: shard 0, array features, chunk 2 ")
    assert "Traceback" not in msg and "DataLoader worker" not in msg


def test_edited_provenance_fails_read_and_verify(copy):
    meta = Path(copy) / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["dflash"]["layer_ids"] = [1, 4]
    meta.write_text(json.dumps(doc))
    with pytest.raises(st.StoreDataError, match="provenance .* does not match its recorded checksum"):
        StoreReader(copy)
    rc, out = _verify(copy)
    assert rc == 1 and "provenance" in out and "checksum" in out


def test_edited_progress_record_fails_read_and_verify(copy):
    meta = Path(copy) / st.shard_name(0) / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["progress"]["committed_tokens"] -= 100
    meta.write_text(json.dumps(doc))
    with pytest.raises(st.StoreDataError, match="progress record of shard 0 .* does not match its checksum"):
        StoreReader(copy)
    rc, out = _verify(copy)
    assert rc == 1 and "shard 0: the progress record" in out


def test_frozen_head_checksum_catches_a_flipped_byte_and_a_nan(copy):
    head = Path(st.frozen_head_path(copy))
    check_frozen_head(copy)
    good = head.read_bytes()
    data = bytearray(good)
    data[-7] ^= 0x10
    head.write_bytes(bytes(data))
    with pytest.raises(st.StoreDataError, match="does not match its recorded checksum"):
        check_frozen_head(copy)
    rc, out = _verify(copy)
    assert rc == 1 and "frozen head:" in out and "checksum" in out
    head.write_bytes(_head(nan=True))  # a NaN written over it: the old checksum no longer matches
    with pytest.raises(st.StoreDataError, match="does not match its recorded checksum"):
        check_frozen_head(copy)
    write_frozen_head(copy, _head(nan=True))  # a NaN with a fresh checksum: verify still reads the values
    check_frozen_head(copy)
    rc, out = _verify(copy)
    assert rc == 1 and "lm_head.weight holds non-finite values" in out
    Path(str(head) + ".sha256").unlink()
    head.write_bytes(good)
    with pytest.raises(st.StoreDataError, match="sha256 is missing"):
        check_frozen_head(copy)


def test_the_background_head_check_raises_the_same_error_in_the_caller(copy):
    """Training checks the head's checksum in a thread (overlapped with its set-up); wait() re-raises."""
    start_frozen_head_check(copy)()  # intact: returns
    head = Path(st.frozen_head_path(copy))
    data = bytearray(head.read_bytes())
    data[len(data) // 3] ^= 0x04
    head.write_bytes(bytes(data))
    wait = start_frozen_head_check(copy)
    with pytest.raises(st.StoreDataError, match="does not match its recorded checksum"):
        wait()
    Path(str(head) + ".sha256").unlink()
    with pytest.raises(st.StoreDataError, match="sha256 is missing"):
        start_frozen_head_check(copy)()


def test_the_head_check_loads_a_checked_head_ahead_once_and_never_a_damaged_one(copy):
    """Issue 46: given `to=(device, dtype)` the check's thread also loads the head; the fit's load_frozen_head takes
    those very tensors once (a second load reads the file again, same values), and a head that fails its check is
    never loaded ahead."""
    from pipeline import provenance

    head_file = st.frozen_head_path(copy)
    start_frozen_head_check(copy, to=(torch.device("cpu"), torch.float32))()
    ahead = provenance._PRELOADED[head_file]
    embed, head = load_frozen_head(head_file, torch.device("cpu"), torch.float32)
    assert embed is ahead[0] and head is ahead[1] and embed.dtype == torch.float32
    again = load_frozen_head(head_file, torch.device("cpu"), torch.float32)  # taken once: read from the file now
    assert again[0] is not embed and torch.equal(again[0], embed) and torch.equal(again[1], head)
    half = start_frozen_head_check(copy, to=(torch.device("cpu"), torch.bfloat16))
    half()
    assert load_frozen_head(head_file, torch.device("cpu"), torch.float32)[0].dtype == torch.float32  # converted
    data = bytearray(Path(head_file).read_bytes())
    data[len(data) // 3] ^= 0x04
    Path(head_file).write_bytes(bytes(data))
    with pytest.raises(st.StoreDataError, match="does not match its recorded checksum"):
        start_frozen_head_check(copy, to=(torch.device("cpu"), torch.float32))()
    assert head_file not in provenance._PRELOADED


def test_a_store_from_before_the_checksums_stays_readable(copy):
    """schema_version 1 as the previous dflash wrote it: no checksums, and all-zero chunks not stored."""
    root, shard = Path(copy) / "zarr.json", Path(copy) / st.shard_name(0) / "zarr.json"
    doc = json.loads(root.read_text())
    del doc["attributes"][st.INTEGRITY_ATTR]
    root.write_text(json.dumps(doc))
    doc = json.loads(shard.read_text())
    del doc["attributes"][st.PROGRESS_SHA], doc["attributes"]["progress"]["every_chunk"]
    shard.write_text(json.dumps(doc))
    Path(st.frozen_head_path(copy) + ".sha256").unlink()
    _chunk(copy, "split", 0).unlink()  # all "train": the old writer did not store it
    _chunk(copy, "loss_mask", 0).unlink()  # the 300-token prompt: all zero
    _read_all(copy)
    assert StoreReader(copy).read(0)["loss_mask"].sum() == 20
    check_frozen_head(copy)
    rc, out = _verify(copy)
    assert rc == 0 and "written before dflash recorded checksums" in out
    assert "2 chunk(s) of ['loss_mask', 'split'] not stored" in out
    _chunk(copy, "features", 1).unlink()  # an array that is never all zero: damage, even in an old store
    with pytest.raises(st.StoreDataError, match="array features, chunk 1 .* is missing"):
        _read_all(copy)


def test_stale_partial_files_are_reported_and_removed_on_resume(tmp_path):
    path = str(tmp_path / "p.zarr")
    create_or_open_store(path, _prov())
    g = torch.Generator().manual_seed(0)
    with ShardWriter(path, 0, _prov()) as w:
        w.start("plan", 3, 300)
        w.write_batch(*_batch(g, 100, 1))
    stale = Path(path) / st.shard_name(0) / "features" / "c" / "3" / "0" / "0.5f3c.partial"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half a chunk")
    rc, out = _verify(path)
    assert "1 temporary *.partial file(s)" in out and "features/c/3/0/0.5f3c.partial" in out
    with ShardWriter(path, 0, _prov()) as w:
        assert w.removed_partials == 1 and not stale.exists()


# ----------------------------------------------------------------------------------------------------------
# One writer per shard
# ----------------------------------------------------------------------------------------------------------


def _fresh(tmp_path, name="w.zarr") -> str:
    path = str(tmp_path / name)
    create_or_open_store(path, _prov())
    return path


def _write_lock(path: str, **rec) -> None:
    full = {"token": "t0ken", "host": "gpu-node-7", "machine": "other-machine", "pids": [[4242, None]],
            "command": "dflash extract", "started": "2026-11-30T00:00:00+00:00", "heartbeat": time.time(),
            "ttl": 120.0, **rec}
    p = Path(lock_path(path, 0))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(full))


def test_a_second_writer_is_refused_naming_host_and_pid(tmp_path):
    path = _fresh(tmp_path)
    with ShardWriter(path, 0, _prov()):
        code = f"import json\nfrom pipeline.store_writer import ShardWriter\nShardWriter({path!r}, 0, json.loads({json.dumps(_prov())!r}))"
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
        assert r.returncode == 1 and "ShardLockedError" in r.stderr
        msg = r.stderr.strip().splitlines()[-1]
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and "shard 0" in msg
        assert "Wait for that run to finish" in msg and f"dflash status {path}" in msg
    with ShardWriter(path, 0, _prov()):  # released: the next writer gets it
        pass


def test_a_dead_process_lock_is_taken_over(tmp_path):
    path = _fresh(tmp_path)
    p = subprocess.Popen(["true"])
    p.wait()  # a pid that was alive and is not any more (kill -9 leaves exactly this)
    _write_lock(path, machine=machine_id(), host=socket.gethostname(), pids=[[p.pid, None]])
    with ShardWriter(path, 0, _prov()) as w:
        assert w.lock.holds() and w.lock.token != "t0ken"


def test_another_hosts_lock_is_live_until_its_heartbeat_expires(tmp_path):
    path = _fresh(tmp_path)
    _write_lock(path, heartbeat=time.time() - 60)
    with pytest.raises(ShardLockedError, match="pid 4242 on host gpu-node-7 .* heartbeat 60 s ago"):
        ShardWriter(path, 0, _prov())
    _write_lock(path, heartbeat=time.time() - 121)
    with ShardWriter(path, 0, _prov()) as w:
        assert w.lock.holds()


def _race(path: str, start, hold, results) -> None:
    start.wait()
    try:
        lock = ShardLock.acquire(path, 0, "race", heartbeat=False)
        results.put(("won", os.getpid()))
        hold.wait()
        lock.release()
    except ShardLockedError as e:
        results.put(("refused", str(e)))


def test_only_one_of_many_takes_a_stale_lock_over(tmp_path):
    path = _fresh(tmp_path)
    _write_lock(path, heartbeat=0.0)  # another host's, long expired
    ctx = multiprocessing.get_context("fork")
    start, hold, results = ctx.Barrier(6), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(path, start, hold, results)) for _ in range(6)]
    for p in procs:
        p.start()
    got = [results.get(timeout=HANG_S) for _ in procs]
    hold.set()
    for p in procs:
        p.join(timeout=HANG_S)
    winners = [pid for kind, pid in got if kind == "won"]
    assert len(winners) == 1, got
    assert all(f"pid {winners[0]} " in text for kind, text in got if kind == "refused")


def test_a_writer_that_lost_its_lock_never_shrinks_the_shard(tmp_path):
    """The issue's corruption: a writer behind another one resized the arrays to its own position, deleting the
    other's newer chunks (and a late one turned a finished shard back into unfinished)."""
    path = _fresh(tmp_path)
    g = torch.Generator().manual_seed(0)
    behind = ShardWriter(path, 0, _prov())
    behind.start("plan", 6, 600)
    behind.write_batch(*_batch(g, 100, 1))
    Path(lock_path(path, 0)).unlink()  # as a takeover does when `behind` looked dead
    with ShardWriter(path, 0, _prov()) as ahead:
        ahead.start("plan", 6, 600)
        for sid in range(2, 6):
            ahead.write_batch(*_batch(g, 100, sid))
        ahead.finish()
    chunks = sorted(p.name for p in (Path(path) / st.shard_name(0) / "features" / "c").iterdir())
    with pytest.raises(st.StoreError, match="lost the lock on shard 0"):
        behind.write_batch(*_batch(g, 100, 9))
    with pytest.raises(st.StoreError, match="lost the lock on shard 0"):
        behind.finish()
    assert sorted(p.name for p in (Path(path) / st.shard_name(0) / "features" / "c").iterdir()) == chunks
    reader = StoreReader(path)
    assert reader.progress[0].done and len(reader.samples) == 5
    assert [reader.read(i)["tokens"].shape[0] for i in range(5)] == [100] * 5
    write_frozen_head(path, _head())
    assert _verify(path)[0] == 0


def test_a_writer_stops_when_the_shard_moved_on_under_its_lock(tmp_path):
    """Defence in depth: even holding the lock, a writer whose last commit is not the shard's stops."""
    path = _fresh(tmp_path)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(path, 0, _prov()) as a:
        a.start("plan", 4, 400)
        a.write_batch(*_batch(g, 100, 1))
        b = ShardWriter(path, 0, _prov(), lock_token=a.lock.token)  # e.g. an older dflash without locks
        b.write_batch(*_batch(g, 100, 2))
        with pytest.raises(st.StoreError, match="changed by another writer.* 2 batches"):
            a.write_batch(*_batch(g, 100, 3))
    assert StoreReader(path, require_complete=False).progress[0].committed_batches == 2


# ----------------------------------------------------------------------------------------------------------
# Arguments and identity
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, text", [
    (["extract", "--shards", "-1"], "-1 is not in the range x>=1"),
    (["extract", "--shards", "0"], "0 is not in the range x>=1"),
    (["extract", "--shard-index", "-1"], "-1 is not in the range x>=0"),
    (["train", "--devices", "-1"], "-1 is not in the range x>=1"),
    (["train", "--devices", "0"], "0 is not in the range x>=1"),
    (["extract", "--gpus", "0"], "no usable CUDA GPU"),
    (["train", "--gpus", "0,1"], "no usable CUDA GPU"),
    (["train", "--gpus", "-1"], "expected GPU indices such as 0-4"),
    (["train", "--gpus", "0-7"], "no usable CUDA GPU"),  # a range is a GPU list, as for `dflash run`
    (["train", "--gpus", "0,0"], "names a GPU twice"),
])
def test_cli_refuses_bad_counts_and_absent_gpus(tmp_path, monkeypatch, args, text):
    from click.testing import CliRunner

    from stages.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    store = tmp_path / "s.zarr"
    r = CliRunner().invoke(main, [*args, "--config", TINY, "--store", str(store)])
    assert r.exit_code == 2 and text in r.output, r.output
    assert not store.exists()


def test_extract_refuses_zero_shards_without_the_cli():
    from pipeline.config import load_config
    from stages.extract import ExtractError, run_extract, shard_gpus

    with pytest.raises(ExtractError, match="--shards 0"):
        run_extract(load_config(TINY), shards=0, store="/nonexistent", command="test")
    with pytest.raises(ExtractError, match="--gpus 0: this process sees no CUDA GPU"):
        shard_gpus([0], 2, None, 0)


def test_train_compares_the_targets_fingerprint_not_its_name(tmp_path, capsys):
    from pipeline.config import load_config
    from pipeline.target import target_fingerprint
    from stages.train import TrainError, check_store_matches

    cfg = load_config(TINY)
    tiny = Path(cfg.target.path)
    attrs = {"target": {"name": cfg.target.name, "path": str(tiny), **target_fingerprint(str(tiny))},
             "layer_ids": [1, 3, 5], "hidden_size": cfg.drafter.hidden_size,
             "tokenizer": {"enable_thinking": cfg.data.enable_thinking}}
    same = tmp_path / "moved-copy"
    shutil.copytree(tiny, same)
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    c = json.loads((other / "config.json").read_text())
    c["rope_theta"] = float(c.get("rope_theta") or 10000.0) * 2
    (other / "config.json").write_text(json.dumps(c))

    def check(path):
        return check_store_matches(load_config(TINY, [f"target.path={path}", "target.layer_ids=[1,3,5]"]), attrs)

    assert check(same) == [1, 3, 5]  # moved: same fingerprint
    with pytest.raises(TrainError, match="target.config_sha256: the store was extracted from a checkpoint with"):
        check(other)  # same target.name, different checkpoint
    assert check("/nonexistent/ckpt") == [1, 3, 5]  # training needs no target: skipped, said in one line
    assert "'/nonexistent/ckpt' is not a readable local checkpoint here" in capsys.readouterr().err
    assert target_differences(str(other), attrs["target"], out=io.StringIO())
