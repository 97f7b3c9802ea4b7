"""Training while extraction writes the store (issue 17): the growing-store reader on a hand-written store
(committed rows only, the stream order, validation first, a shard holding the stream up), and end to end on
the tiny target with a slowed extraction and 2 gloo ranks, stopped and resumed on both sides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.follow import GrowingStore
from pipeline import store as st
from pipeline.encoding import encode
from pipeline.provenance import create_or_open_store
from pipeline.store_reader import SampleRef, StoreReader, committed_refs
from pipeline.store_writer import ShardWriter

PROV = {"schema_version": st.SCHEMA_VERSION, "target": {"name": "t", "hidden_size": 32, "vocab_size": 100,
        "num_hidden_layers": 8, "tie_word_embeddings": False}, "layer_ids": [1, 3], "hidden_size": 32,
        "encoding": "bf16", "chunk_tokens": 64, "clevel": 1, "num_shards": 2,
        "dataset": {"fingerprint": "t", "samples": 10, "validation_samples": 2}, "max_length": 256}


def _write(w: ShardWriter, rows: list[tuple[int, int, int]]) -> None:
    """Commit one batch of (sample_id, split, length) rows."""
    ids, splits, lens = (np.array(c) for c in zip(*rows))
    T = int(lens.sum())
    parts = {k: v.numpy() for k, v in encode(torch.randn(T, 2, 32), "bf16").items()}
    w.write_batch(ids.astype(np.uint64), splits.astype(np.uint8), lens.astype(np.int32),
                  np.arange(T, dtype=np.int32) % 100, np.ones(T, np.uint8), parts)


def test_growing_store_reads_committed_rows_in_stream_order(tmp_path):
    path = str(tmp_path / "s.zarr")
    create_or_open_store(path, PROV)
    g = GrowingStore(path, report=False)
    assert g.stream == [] and not g.final and not g.validation_ready() and g.blocked == 0 and g.planned == 8
    w0, w1 = ShardWriter(path, 0, PROV), ShardWriter(path, 1, PROV)
    w0.start("p0", 5, 500, validation_batches=1)
    w1.start("p1", 5, 500, validation_batches=1)
    _write(w0, [(100, 1, 10)])  # shard 0's validation batch
    _write(w0, [(101, 0, 20), (102, 0, 30)])
    g.refresh()
    assert not g.validation_ready() and g.stream == [] and g.blocked == 1  # shard 1's row 0 may come first
    _write(w1, [(200, 1, 12)])
    g.refresh()
    assert g.validation_ready() and [r.sample_id for r in g.validation()] == [100, 200]
    assert [r.sample_id for r in g.stream] == [101] and g.blocked == 1  # shard 1's row 1 (key 0.3) ties 101's
    # rows written but not committed (an interrupted batch) are never read
    arr = w1.arrays  # its own writer: a second ShardWriter of shard 1 is refused by the shard lock
    for name in ("sample_start", "sample_length", "sample_id", "split"):
        arr[name].resize((3,))
        arr[name][1:3] = 7
    g.refresh()
    assert [r.sample_id for r in g.stream] == [101]
    _write(w1, [(201, 0, 5), (202, 0, 6), (203, 0, 7), (204, 0, 8)])
    w1.finish()
    _write(w0, [(103, 0, 40), (104, 0, 50)])
    w0.finish()
    g.refresh()
    keys = {(0, k): (k + 0.5) / 5 for k in range(5)} | {(1, k): (k + 0.5) / 5 for k in range(5)}
    expected = [sid for (sh, k), sid in sorted(
        zip(keys, [100, 101, 102, 103, 104, 200, 201, 202, 203, 204]), key=lambda x: (keys[x[0]], x[0][0]))
        if sid not in (100, 200)]
    assert g.final and [r.sample_id for r in g.stream] == expected
    assert [r.row for r in g.stream if r.shard == 0] == [1, 2, 3, 4]
    refs, lengths = g.all()
    assert [r.sample_id for r in refs] == sorted(expected) and g.filler().sample_id == 201
    assert [r.sample_id for r in g.stream_batch(2, 3, round_end=4)] == expected[6:9]  # no wait: final
    assert g.stream_batch(3, 3, round_end=4) == []  # past the end: the sampler deals a filler


def _finished_stream(n: int) -> GrowingStore:
    """A GrowingStore whose stream is n samples of a finished store (no store on disk needed)."""
    g = GrowingStore.__new__(GrowingStore)
    g.stream = [SampleRef(0, i, 10, 1000 + i, 0, i) for i in range(n)]
    g.planned, g.progress, g._mix, g.report = n, [st.Progress(done=True)], None, False
    return g


@pytest.mark.parametrize("n,size,buffer", [(100, 8, 32), (37, 4, 0), (50, 7, 1000)])
def test_shuffle_buffer_draws_every_sample_once_from_its_window(n, size, buffer):
    g = _finished_stream(n)
    K = -(-n // size)
    batches = [[r.row for r in g.mixed_batch(k, size, k + 1, buffer, seed=3, epoch=0)] for k in range(K + 1)]
    assert batches[-1] == [] and sorted(p for b in batches for p in b) == list(range(n))  # each once, then nothing
    assert all(max(b) < (k + 1) * size + buffer for k, b in enumerate(batches[:-1]))  # only from its window
    if buffer == 0:
        assert batches[:-1] == [list(range(k * size, min(n, (k + 1) * size))) for k in range(K)]  # the stream's order
    else:
        assert batches[0] != list(range(size))
    fresh = _finished_stream(n)  # a resumed run or another rank asks for batch 3 first: the same samples
    assert [r.row for r in fresh.mixed_batch(3, size, 4, buffer, seed=3, epoch=0)] == batches[3]
    assert [r.row for r in fresh.mixed_batch(1, size, 2, buffer, seed=3, epoch=1)] != batches[1] or buffer == 0


def test_a_shard_of_an_older_plan_is_refused_until_it_finishes(tmp_path):
    path = str(tmp_path / "s.zarr")
    create_or_open_store(path, PROV)
    w0 = ShardWriter(path, 0, PROV)
    w0.start("p0", 5, 500)  # no validation_batches: started by a dflash that planned longest first
    _write(w0, [(100, 0, 10)])
    with pytest.raises(st.StoreError, match="did not extract validation samples first"):
        GrowingStore(path, report=False).validation_ready()


# -- end to end ------------------------------------------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

from helpers_cli import FEW_ANCHORS, HANG_S, Lazy, selected  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DFLASH_SAMPLE_LOG": "1"}
LONG = HANG_S  # a hang guard only (tests/helpers_cli.py): no assertion depends on speed


def _cli(*args, env=ENV, **kw) -> subprocess.Popen:
    """A dflash command as a terminal's job: its own process group, Ctrl-C at its default. (Under a CI runner
    that ignores SIGINT, an inherited ignore made `dflash train` run on through the tests' Ctrl-C.)"""
    return subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw)


def _until(cond, what: str, proc=None) -> None:
    deadline = time.time() + LONG
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert proc is None or proc.poll() is None, f"{what}: the process ended ({proc.returncode}): {proc.stderr.read()[-3000:]}"
        time.sleep(0.3)


def _readable_train(store: str) -> int:
    """Training samples a following run can read now: the commit-order stream's length once the validation split
    is in (0 before). Not the committed count: a shard that lags holds the stream up, and a test that stops
    the extraction on the committed count alone could leave a follower waiting for rows that never come."""
    try:  # the extraction may be creating the store right now: a group without its attributes yet
        if st.read_root_attrs(store) is None or not st.exists(st.frozen_head_path(store)):
            return 0
    except st.StoreDataError:  # a damaged provenance is a failure, not "not yet"
        raise
    except st.StoreError:
        return 0
    g = GrowingStore(store, report=False)
    return len(g.stream) if g.validation_ready() else 0


def _lines(run: Path, rank: int) -> list[dict]:
    p = run / "logs" / f"samples-rank{rank}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _stream_order(store: str) -> list[int]:
    """The commit-order stream, computed here from the finished store: row k of shard i (P_i planned rows) at
    ((k + 0.5) / P_i, i), training rows only."""
    attrs = st.read_root_attrs(store)
    N, S = attrs["dataset"]["samples"], attrs["num_shards"]
    rows = [committed_refs(store, i)[1] for i in range(S)]
    keyed = [((r.row + 0.5) / len(range(i, N, S)), i, r.sample_id) for i in range(S) for r in rows[i] if r.split == 0]
    return [sid for _, _, sid in sorted(keyed)]


def _follow_a_slow_extraction(tmp_path: Path, packing: bool) -> tuple:
    """The follow test's processes (see its docstring): extraction stopped early, training on what is committed
    until it waits, extraction resumed, training stopped and resumed while extraction goes on, both to the end.
    Returns (store, run, the checkpoint step it resumed from, each rank's sample-log lines at the stop, rank 0's
    log) for the test's checks."""
    store, run = str(tmp_path / "store.zarr"), tmp_path / "run"
    extract = ["extract", "--config", TINY, "--shards", "2", "--store", store, "--set", "data.max_samples=240",
               "--set", "extract.token_budget=1024"]
    slow = {**ENV, "DFLASH_TEST_EXTRACT_DELAY": "0.7"}
    train = ["train", "--follow", "--devices", "2", "--config", TINY, "--store", store, "--no-export",
             "--set", f"train.run_dir={run}", "--set", "train.num_workers=1", "--set", "train.batch_size=8",
             "--set", "train.epochs=3", "--set", "train.checkpoint_every=4", "--set", "train.log_every=1",
             "--set", "train.follow_buffer=0", *FEW_ANCHORS]  # no shuffle buffer: epoch 0 is the stream's own order
    if packing:
        train += ["--set", "train.packing=true", "--set", "train.pack_tokens=512"]
    x = _cli(*extract, env=slow)
    _until(lambda: _readable_train(store) >= 40, "40 readable training samples", x)  # the run needs 16
    os.killpg(x.pid, signal.SIGINT)  # Ctrl-C: the workers commit what they have and stop
    assert x.wait(timeout=LONG) == 130
    assert not all((st.shard_progress(store, i) or st.Progress()).done for i in range(2))
    t = _cli(*train)
    log = run / "logs" / "rank0.log"
    _until(lambda: log.exists() and "train: waiting for extraction" in log.read_text(), "training to wait", t)
    assert _lines(run, 0) and _lines(run, 1), "training did not start on the committed samples"
    x = _cli(*extract, env=slow)  # extraction resumes: so does training
    going = 10 if packing else 20  # packed epochs after the stream's are short (~8 samples a row): stop inside the stream
    _until(lambda: len(_lines(run, 0)) >= going and (run / "checkpoints" / "last.ckpt").exists(), "training to go on", t)
    os.killpg(t.pid, signal.SIGINT)  # Ctrl-C of the training; extraction goes on
    assert t.wait(timeout=LONG) == 130, t.stderr.read()[-3000:]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    stopped = {r: len(_lines(run, r)) for r in (0, 1)}
    assert x.poll() is None or x.returncode == 0
    r = subprocess.run([sys.executable, "-m", "stages.cli", *train, "--resume"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=LONG)
    assert r.returncode == 0, r.stderr[-3000:]
    assert x.wait(timeout=LONG) == 0
    return store, run, ckpt, stopped, log


FOLLOW_TEST = "test_two_ranks_follow_a_slow_extraction_stopped_and_resumed_on_both_sides"
UNFINISHED_TEST = "test_train_on_an_unfinished_store_says_it_follows"


@pytest.fixture(scope="module")
def follow_runs(request, tmp_path_factory):
    """A future of each slow run below: packing -> _follow_a_slow_extraction's result, "unfinished" ->
    _train_on_an_unfinished_store's. The selected ones all start at the first one's setup, each in its own
    thread: each spends much of its time in waits (extraction is slowed 0.5-0.7 s a batch, training waits for
    it), which leaves the 2 cores to the others. Each test then takes its own result (an assertion that failed
    in its thread is raised there)."""
    pool = ThreadPoolExecutor(max_workers=3)

    def make(key):
        tmp = tmp_path_factory.mktemp(f"follow-{key}")
        return pool.submit(*((_train_on_an_unfinished_store, tmp) if key == "unfinished" else
                             (_follow_a_slow_extraction, tmp, key)))
    runs = Lazy(make)
    for item in selected(request, FOLLOW_TEST, UNFINISHED_TEST):
        runs[item.callspec.params["packing"] if item.originalname == FOLLOW_TEST else "unfinished"]
    yield runs
    pool.shutdown(wait=True)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_two_ranks_follow_a_slow_extraction_stopped_and_resumed_on_both_sides(follow_runs, packing):
    """Extraction is stopped (Ctrl-C) early: training starts on what is committed, trains, and waits, saying so.
    Extraction resumes; training is stopped (Ctrl-C) and resumed while extraction goes on. In the end every
    training sample was trained exactly once per epoch on one rank; the first epoch in commit order (the
    stream, recomputed here from the store), continued at the same position after the stop. With packing
    (train.packing) the stream's batches are packed into rows as they come, the later epochs follow the
    packing plan of the finished store, and the same holds. (Both cases run side by side: follow_runs.)"""
    store, run, ckpt, stopped, log = follow_runs[packing].result()
    per_rank = {rk: [b for b in _lines(run, rk)[: stopped[rk]] if b["step"] < ckpt] + _lines(run, rk)[stopped[rk]:]
                for rk in (0, 1)}
    assert len(per_rank[0]) == len(per_rank[1])  # the same number of batches on both ranks
    stream = _stream_order(store)
    assert len(stream) == sum(1 for ref in StoreReader(store).samples if ref.split == 0)
    for epoch in range(3):
        ids = [i for rk in (0, 1) for b in per_rank[rk] if b["epoch"] == epoch for i in b["ids"] if i >= 0]
        assert sorted(ids) == sorted(stream), f"epoch {epoch}: each training sample exactly once"
    # epoch 0 is the stream in rounds: global batch g (8 samples) on rank g % 2, in order on each rank (packed:
    # the batch's samples in rows, longest first)
    order = sorted if packing else list
    for rk in (0, 1):
        got = [order(b["ids"]) for b in per_rank[rk] if b["epoch"] == 0]
        want = [order(stream[8 * g: 8 * g + 8]) or [-1] for g in range(rk, 2 * len(got), 2)]
        assert got == want, f"rank {rk}"
    if packing:  # the later epochs: rows of several samples, up to 8 rows a batch (the plan of the finished store)
        later = [b["ids"] for rk in (0, 1) for b in per_rank[rk] if b["epoch"] > 0 and b["ids"] != [-1]]
        assert max(len(ids) for ids in later) > 8 and "docs/row" in log.read_text()


def test_extraction_plan_puts_validation_first_and_mixes_lengths():
    from stages.extract_worker import extraction_plan, plan_batches

    lengths = [10 + (i * 37) % 300 for i in range(200)]
    val = [i % 10 == 0 for i in range(200)]
    plan, n_val = extraction_plan(lengths, val, token_budget=1200, max_batch_size=8)
    assert [b.index for b in plan] == list(range(len(plan)))
    assert sorted(m for b in plan for m in b.members) == list(range(200))  # every sample once
    assert all(val[m] for b in plan[:n_val] for m in b.members) and not any(val[m] for b in plan[n_val:] for m in b.members)
    train = [b for b in plan[n_val:]]
    assert max(lengths[m] for m in train[0].members) == max(lengths[i] for i in range(200) if not val[i])  # longest first
    firsts = [max(lengths[m] for m in b.members) for b in train[1:]]
    assert firsts != sorted(firsts, reverse=True)  # the rest is not longest-to-shortest
    for b in plan:  # still length-grouped batches within the token budget
        assert len(b.members) * max(lengths[m] for m in b.members) <= 1200 or len(b.members) == 1
    assert extraction_plan(lengths, val, 1200, 8)[0] == plan  # deterministic
    assert len(plan) >= len(plan_batches(lengths, 1200, 8))


@pytest.mark.slow
def test_a_shard_begun_with_the_old_plan_resumes_with_it(tmp_path):
    """A store whose shard was started by a dflash that planned longest first (and was killed after its first
    batch) resumes with that plan, not with a 'different batch plan' error, and ends complete."""
    import zarr

    from data.ingest import ingest
    from pipeline.config import load_config
    from pipeline.target import load_tokenizer
    from stages.extract_worker import plan_batches, plan_fingerprint

    store = str(tmp_path / "s.zarr")
    args = ["extract", "--config", TINY, "--shards", "2", "--store", store, "--set", "data.max_samples=60",
            "--set", "extract.token_budget=1024"]
    r = subprocess.run([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = load_config(TINY, ["data.max_samples=60", "extract.token_budget=1024"])
    mine = ingest(cfg.data, load_tokenizer(cfg.target.path))[0][0::2]
    lengths = [len(s.input_ids) for s in mine]
    legacy = plan_batches(lengths, 1024, cfg.extract.max_batch_size)
    first = legacy[0].members
    g = zarr.open_group(store, mode="a")[st.shard_name(0)]  # shard 0 as the old dflash left it: one batch in
    g.attrs["progress"] = st.Progress(committed_batches=1, committed_samples=len(first),
                                      committed_tokens=sum(lengths[m] for m in first),
                                      plan_fingerprint=plan_fingerprint(legacy, [s.sample_id for s in mine]),
                                      planned_samples=len(mine), planned_tokens=sum(lengths)).to_attrs()
    g.attrs[st.PROGRESS_SHA] = st.digest(g.attrs["progress"])  # its checksum, as a writer commits it
    r = subprocess.run([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0 and "complete" in r.stderr, r.stderr[-2000:]
    prog, refs = committed_refs(store, 0)
    assert prog.done and prog.validation_batches == -1
    # rows after the old commit follow the old plan (the first batch's rows are whatever was there)
    assert [x.sample_id for x in refs[len(first):]] == [st.sample_id_to_int(mine[m].sample_id) for b in legacy[1:]
                                                        for m in b.members]


def _train_on_an_unfinished_store(tmp_path: Path) -> tuple:
    """The next test's processes: an extraction stopped (Ctrl-C) with 20 training samples readable, then a plain
    `dflash train` of 2 steps on that store. Returns (the training's CompletedProcess, its run dir)."""
    store, run = str(tmp_path / "s.zarr"), tmp_path / "run"
    x = _cli("extract", "--config", TINY, "--shards", "2", "--store", store, "--set", "data.max_samples=200",
             "--set", "extract.token_budget=1024", env={**ENV, "DFLASH_TEST_EXTRACT_DELAY": "0.5"})
    _until(lambda: _readable_train(store) >= 20, "20 readable training samples", x)  # the run needs 4 + 8
    os.killpg(x.pid, signal.SIGINT)
    assert x.wait(timeout=LONG) == 130
    r = subprocess.run([sys.executable, "-m", "stages.cli", "train", "--config", TINY, "--store", store, "--no-export",
                        "--set", f"train.run_dir={run}", "--set", "train.max_steps=2", "--set", "train.num_workers=0",
                        "--set", "train.batch_size=4", "--set", "train.follow_buffer=8"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=LONG)
    return r, run


@pytest.mark.slow
def test_train_on_an_unfinished_store_says_it_follows(follow_runs):
    """(Its processes run beside the follow test's: follow_runs.)"""
    r, run = follow_runs["unfinished"].result()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is still being written (shard(s) [" in r.stderr and "training follows the extraction" in r.stderr
    assert [b["epoch"] for b in _lines(run, 0)] == [0, 0]


def test_follow_buffer_must_not_be_negative():
    from pipeline.config import ConfigError, load_config

    assert load_config(None, ["train.follow_buffer=0"]).train.follow_buffer == 0
    with pytest.raises(ConfigError, match="train.follow_buffer must be 0 or more"):
        load_config(None, ["train.follow_buffer=-1"])
