"""Issue #23 end to end on the tiny target (CPU, several processes): two `dflash extract` runs on one store (one
refused at once, naming host and pid; the other killed -9 mid-way and resumed with no cleanup gives every
sample intact), and `dflash train` stopping with one clear error on a damaged chunk, a changed frozen head or
another checkpoint under the same target name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from pipeline import store as st
from pipeline.provenance import create_or_open_store
from pipeline.store_reader import StoreReader

from helpers_cli import HANG_S, dflash  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
OPTS = ["--set", "data.max_samples=150", "--set", "extract.token_budget=512"]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _extract(store, *extra):
    return subprocess.Popen([sys.executable, "-m", "stages.cli", "extract", "--config", TINY, "--shards", "2",
                             "--store", store, *OPTS, *extra], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _committed(store, shard) -> int:
    try:
        return dict(zarr.open_group(store, mode="r")[st.shard_name(shard)].attrs)["progress"]["committed_batches"]
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def _wait(condition, timeout=HANG_S):  # a hang guard only: correctness never depends on speed
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def _create_at_once(path, prov, barrier, results):
    barrier.wait()  # every process calls create_or_open_store at the same moment
    try:
        results.put(("ok", create_or_open_store(path, prov)["dataset"]["fingerprint"]))
    except st.StoreError as e:
        results.put(("refused", str(e)))
    except Exception as e:  # noqa: BLE001 - what the race used to raise (zarr's ContainsGroupError)
        results.put(("crashed", f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("same", [True, False], ids=["same-run", "different-runs"])
def test_runs_that_create_one_new_store_at_once_do_not_collide(tmp_path, same):
    """CI caught two `dflash extract` runs (or nodes) starting on one new store: zarr's create is not atomic and
    the second creator died with ContainsGroupError. Now one creates the root and the others open it: the same
    run's processes all continue, a different run's are refused by name; the root holds one run's record."""
    import multiprocessing as mp

    from helpers_store import synthetic_provenance

    ctx = mp.get_context("fork")
    n, path = 6, str(tmp_path / "s.zarr")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    provs = [synthetic_provenance(fingerprint="run" if same else f"run{i}") for i in range(n)]
    procs = [ctx.Process(target=_create_at_once, args=(path, provs[i], barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=HANG_S) for _ in procs]
    for p in procs:
        p.join(timeout=HANG_S)
    assert not [g for g in got if g[0] == "crashed"], got
    ok = [g[1] for g in got if g[0] == "ok"]
    stored = st.read_root_attrs(path)["dataset"]["fingerprint"]
    if same:
        assert ok == ["run"] * n and stored == "run"
    else:
        assert ok == [stored], got  # exactly one created it; every other run was told why it cannot continue
        assert all("made by a different run" in g[1] for g in got if g[0] == "refused")
    assert sorted(os.listdir(Path(path) / "locks")) == []  # the creation lock is given back


@pytest.mark.slow
def test_two_extractions_one_refused_the_other_killed_and_resumed_intact(tmp_path):
    store = str(tmp_path / "s.zarr")
    a, b = _extract(store), _extract(store)  # the same command twice at once (a second shell, a retry)
    assert _wait(lambda: a.poll() is not None or b.poll() is not None), "neither run ended or was refused"
    loser, winner = (a, b) if a.poll() is not None else (b, a)
    err = loser.stderr.read()
    assert loser.returncode == 2, err
    assert f"is being written by another process: pid {winner.pid}" in err and f"on host {socket.gethostname()}" in err
    # kill -9 the worker of shard 0 mid-way: the run fails, committed work stays, its lock is released
    assert _wait(lambda: _committed(store, 0) >= 2), "extraction made no progress"
    pids = subprocess.run(["pgrep", "-f", f"extract_worker.*--shard-index 0 .*{store}"], capture_output=True,
                          text=True).stdout.split()
    assert pids, "shard 0's worker is gone before it could be killed"
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    assert winner.wait(timeout=HANG_S) == 1
    # the same command again resumes (no cleanup by hand) and the store holds every sample, intact
    r = dflash("extract", "--config", TINY, "--shards", "2", "--store", store, *OPTS)
    assert "complete" in r.stderr
    assert dflash("verify", store).returncode == 0
    _assert_every_sample_intact(store)


@pytest.mark.slow
def test_a_shard_held_on_another_node_is_refused_by_shard_index(tmp_path):
    """`--shard-index 1` while another host holds shard 1 (fresh heartbeat): refused before any worker starts,
    naming that host and pid; shard 0's lock, taken first, is given back."""
    from data.ingest import ingest
    from pipeline.config import load_config
    from pipeline.target import load_tokenizer
    from stages.extract import build_provenance

    store = tmp_path / "s.zarr"
    cfg = load_config(TINY, ["data.max_samples=150", "extract.token_budget=512"])
    tok = load_tokenizer(cfg.target.path)
    samples, _ = ingest(cfg.data, tok)
    create_or_open_store(str(store), build_provenance(cfg, tok, samples, 2, "the other node"))  # it made the store
    lock = store / "locks" / "shard-00001.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)  # (the store's creation left it, empty)
    lock.write_text(json.dumps({"token": "x", "host": "gpu-node-7", "machine": "elsewhere", "pids": [[4242, None]],
                                "command": "dflash extract --shard-index 1", "started": "2026-11-30T08:00:00+00:00",
                                "heartbeat": time.time(), "ttl": 600}))
    for extra in (["--shard-index", "1"], []):
        r = dflash("extract", "--config", TINY, "--shards", "2", "--store", str(store), *OPTS, *extra, check=False)
        assert r.returncode == 2 and f"shard 1 of {store} is being written" in r.stderr, r.stderr[-2000:]
        assert "pid 4242 on host gpu-node-7" in r.stderr and "Traceback" not in r.stderr
        assert sorted(p.name for p in lock.parent.iterdir()) == ["shard-00001.lock"]
        assert not (store / "shards" / "00000").exists()


def _assert_every_sample_intact(store):
    """The issue's symptom was samples with zeroed token ids, features, loss masks or split flags: compare every
    sample's tokens, mask and split with the ingest's, and check no feature row is the fill value."""
    from data.ingest import ingest
    from pipeline.config import load_config
    from pipeline.target import load_tokenizer

    cfg = load_config(TINY, ["data.max_samples=150", "extract.token_budget=512"])
    samples, _ = ingest(cfg.data, load_tokenizer(cfg.target.path))
    want = {st.sample_id_to_int(s.sample_id): s for s in samples}
    reader = StoreReader(store)
    assert sorted(r.sample_id for r in reader.samples) == sorted(want)
    for i, ref in enumerate(reader.samples):
        s, w = reader.read(i), want[ref.sample_id]
        np.testing.assert_array_equal(s["tokens"], w.input_ids)
        np.testing.assert_array_equal(s["loss_mask"], w.loss_mask)
        assert ref.split == st.SPLITS[w.split]
        assert (s["features"].reshape(len(w.input_ids), -1) != 0).any(axis=1).all(), f"zeroed features in {ref}"


# tiny_store: the session's shared store (tests/conftest.py); the tests below damage copies of it


def _train(store, run, *extra):
    return dflash("train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}",
                  "--set", "train.epochs=1", "--no-export", *extra, check=False)


@pytest.mark.slow
def test_train_stops_with_one_clear_error_on_a_damaged_store(tiny_store, tmp_path):
    bad = tmp_path / "bad.zarr"
    shutil.copytree(tiny_store, bad)
    (bad / "shards/00000/features/c/1/0/0").unlink()
    r = _train(str(bad), tmp_path / "r1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("error: "))
    assert f"damaged store {bad}: shard 0, array features, chunk 1 " in line and "is missing" in line
    assert "sample ids" in line and f"dflash verify {bad}" in line

    head = tmp_path / "head.zarr"
    shutil.copytree(tiny_store, head)
    f = head / st.FROZEN_HEAD_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    r = _train(str(head), tmp_path / "r2")
    assert r.returncode == 2 and "does not match its recorded checksum" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_teardown_failure_after_a_damaged_chunk_still_reports_the_chunk(tiny_store, tmp_path, monkeypatch, capsys):
    """CI once saw the damaged-store run above end with a traceback out of Lightning's teardown (its loader
    fetcher) instead of exit 2: an error raised while stopping on a store error must not hide it."""
    from lightning.pytorch.loops import fetchers

    from pipeline.config import load_config
    from stages.train import run_train

    bad = tmp_path / "bad.zarr"
    shutil.copytree(tiny_store, bad)
    (bad / "shards/00000/features/c/1/0/0").unlink()

    def teardown_fails(self):
        raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")

    monkeypatch.setattr(fetchers._DataFetcher, "teardown", teardown_fails)
    cfg = load_config(TINY, [f"train.run_dir={tmp_path / 'r'}", "train.epochs=1"])
    with pytest.raises(st.StoreDataError, match="shard 0, array features, chunk 1 "):
        run_train(cfg, store=str(bad), export=False)
    assert "train: RuntimeError while stopping on the error below: DataLoader worker (pid 4242) exited" in (
        capsys.readouterr().err)


@pytest.mark.slow
def test_train_refuses_another_checkpoint_with_the_same_name(tiny_store, tmp_path):
    from pipeline.config import load_config

    other = tmp_path / "other-target"
    shutil.copytree(load_config(TINY).target.path, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["max_position_embeddings"] = int(cfg.get("max_position_embeddings", 2048)) + 1
    (other / "config.json").write_text(json.dumps(cfg))
    r = _train(tiny_store, tmp_path / "r", "--set", f"target.path={other}")
    assert r.returncode == 2 and "target.config_sha256" in r.stderr, r.stderr[-3000:]
