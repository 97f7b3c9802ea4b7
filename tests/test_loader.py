"""The data path of training (data/store_dataset.py): rank batches and per-epoch anchors, on a small store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.store_dataset import RankBatchSampler, StoreDataset
from pipeline import store as st
from pipeline.store_reader import StoreReader

from helpers_cli import HANG_S  # noqa: E402
from helpers_store import synthetic_store  # noqa: E402


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(40, 200, (12,), generator=g)]
    path = synthetic_store(str(tmp_path_factory.mktemp("loader") / "s.zarr"), lengths, prompt=lambda n: 10)
    return path, lengths  # a prompt of 10 tokens each: no anchors there


def test_rank_batches_split_each_epoch_evenly_and_reshuffle():
    lengths = list(range(30, 53))  # 23 samples
    ranks = [RankBatchSampler(lengths, 2, rank=r, world_size=3, seed=1) for r in range(3)]
    orders = []
    for epoch in (0, 1):
        for s in ranks:
            s.sampler.set_epoch(epoch)  # where Lightning sets it
        per_rank = [list(s) for s in ranks]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(ranks[0])  # same count per rank
        flat = [i for b in per_rank for batch in b for i, e, filler in batch if e == epoch and not filler]
        assert sorted(flat) == list(range(23))  # every sample once in an epoch, across ranks (fillers complete it)
        orders.append([i for batch in per_rank[0] for i, _, _ in batch])
    assert orders[0] != orders[1]  # a new order each epoch
    s = RankBatchSampler(lengths, 2, seed=1)
    full = list(s)
    s.resume(0, 3)
    assert list(s) == full[3:]  # a resumed run skips the batches it already trained on


def test_anchors_are_fresh_each_epoch_and_fixed_for_validation(small_store):
    path, lengths = small_store
    train = StoreDataset(path, list(range(len(lengths))), num_anchors=8, seed=0)
    val = StoreDataset(path, list(range(len(lengths))), num_anchors=8, seed=0, fixed_anchors=True)
    for pos, n in enumerate(lengths):
        a0, a1, a0_again = train[(pos, 0)]["anchors"], train[(pos, 1)]["anchors"], train[(pos, 0)]["anchors"]
        assert torch.equal(a0, a0_again)  # reproducible (resume gets the same anchors)
        assert a0.numel() == 8 and bool((a0 >= 10).all()) and bool((a0 < n - 1).all())  # supervised, a+1 < S
        assert torch.equal(a0, torch.sort(a0).values)
        if pos < 4:
            assert not torch.equal(a0, a1)  # a new epoch draws new anchors
            assert torch.equal(val[(pos, 0)]["anchors"], val[(pos, 1)]["anchors"])
    item = train[(0, 0)]
    assert set(item) == {"tokens", "loss_mask", "anchors", "sample_id", "features", "scales", "outliers"}  # encoded
    assert item["tokens"].shape == (lengths[0],) and item["features"].shape[:2] == (lengths[0], 2)


def test_accumulation_windows_carry_their_windows_weight():
    """Windows follow the epoch's batch index like Lightning's optimizer steps ([0,3), [3,6), [6,7) for 7
    batches at 3); an epoch resumed at batch 4 starts inside the second window; nothing is dropped."""
    from data.store_dataset import accumulation_windows

    def run(n, acc, offset):
        batches = [{"w": float(2 ** i)} for i in range(offset, n)]
        out = list(accumulation_windows(iter(batches), acc, offset, lambda b: b["w"]))
        assert [b["w"] for b in out] == [b["w"] for b in batches]  # same batches, same order
        return [float(b["window_weight"]) for b in out]

    assert run(7, 3, 0) == [7.0] * 3 + [56.0] * 3 + [64.0]
    assert run(7, 3, 4) == [48.0] * 2 + [64.0]  # batches 4, 5 close the window [3, 6)
    assert run(4, 1, 0) == [1.0, 2.0, 4.0, 8.0]


@pytest.mark.slow  # a parent, its killed trainer and a loader worker: several processes
def test_worker_exits_when_its_parent_died_before_worker_init(tmp_path):
    """A loader worker still importing when its training process dies sees getppid() == 1 by the time
    worker_init runs; comparing with that would never notice (torch's own check has this blind spot, and CI
    caught such an orphan). worker_init must compare with the parent multiprocessing started it from."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = tmp_path / "parent.py"
    script.write_text(f"""
import multiprocessing as mp, os, sys, time
sys.path.insert(0, {str(root)!r})

def child(path):
    time.sleep(3)  # still importing when the parent dies
    from data.store_dataset import worker_init
    open(path, "w").write(str(os.getpid()))
    worker_init(0)
    time.sleep(120)

if __name__ == "__main__":
    mp.get_context("spawn").Process(target=child, args=(sys.argv[1],)).start()
    os._exit(0)  # the training process dies (no cleanup, as under SIGKILL)
""")
    marker = tmp_path / "child.pid"
    subprocess.run([sys.executable, str(script), str(marker)], check=True, timeout=HANG_S)
    deadline = time.time() + HANG_S  # a hang guard only: the child's imports are slow on a busy machine
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the worker never reached worker_init"
    time.sleep(0.1)
    pid = int(marker.read_text())

    def running():
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + 90  # well before the child's own 120 s sleep ends: its exit is worker_init's
    while running() and time.time() < deadline:
        time.sleep(0.2)
    if running():
        os.kill(pid, 9)
        raise AssertionError("the orphaned worker kept running after worker_init")


@pytest.mark.slow  # a trainer, the forkserver and its workers: several processes
def test_forkserver_workers_start_imported_and_exit_with_a_killed_trainer(tmp_path, monkeypatch):
    """The loaders' workers fork from data/loader_workers.py's forkserver (torch already imported there; a
    spawned worker imported it again, 2-4 s before the first batch on this machine). Their parent is then the
    server, which lives as long as they do: SIGKILL the training process, and the worker (watching the trainer,
    not its parent) exits, then the server. DFLASH_LOADER_START=spawn keeps the old start."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = tmp_path / "trainer.py"
    script.write_text(f"""
import os, signal, sys
sys.path.insert(0, {str(root)!r})
import torch
from data import loader_workers
from data.store_dataset import worker_init

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid(), os.getppid(), int("torch" in sys.modules)])

if __name__ == "__main__":
    ctx = loader_workers.context()
    dl = torch.utils.data.DataLoader(Pids(), batch_size=2, num_workers=1, worker_init_fn=worker_init,
                                     multiprocessing_context=ctx, persistent_workers=True)
    batch = next(iter(dl))
    print(ctx.get_start_method(), *batch[0].tolist(), os.getpid(), flush=True)
    if ctx.get_start_method() == "forkserver":
        os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies, no cleanup
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == -9, r.stdout + r.stderr
    method, first, worker_pid, server_pid, imported, trainer = r.stdout.split()
    assert (method, first, imported) == ("forkserver", "0", "1") and server_pid != trainer, r.stdout

    def running(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + 60  # a hang guard: the worker's watch polls every 0.5 s
    while (running(worker_pid) or running(server_pid)) and time.time() < deadline:
        time.sleep(0.2)
    left = [p for p in (worker_pid, server_pid) if running(p)]
    for p in left:
        os.kill(int(p), 9)
    assert not left, f"still running after their trainer's SIGKILL: {left} (worker {worker_pid}, server {server_pid})"
    from data import loader_workers

    monkeypatch.setenv("DFLASH_LOADER_START", "spawn")
    assert loader_workers.context().get_start_method() == "spawn"


def test_reader_opens_each_array_once_and_reads_the_same_values(small_store):
    """Opening a zarr array parses its zarr.json; per read that was half a sample's read time. The reader keeps
    the arrays it opened, and what it returns does not change (checked against a fresh open of each array)."""
    import zarr

    path, lengths = small_store
    reader = StoreReader(path)
    opened = []

    class Counting:  # stands in for the shard's group: counts the opens
        def __init__(self, group):
            self.group = group

        def __getitem__(self, name):
            opened.append(name)
            return self.group[name]

    reader.shards = {i: Counting(g) for i, g in reader.shards.items()}
    names = st.token_arrays("int5")
    group = zarr.open_group(path, mode="r")[st.shard_name(0)]
    for _ in range(2):
        for i, ref in enumerate(reader.samples):
            got = reader.read(i)
            assert set(got) == set(names) and got["tokens"].shape == (ref.length,)
            for name in names:
                np.testing.assert_array_equal(got[name], group[name][ref.start:ref.start + ref.length])
    assert sorted(opened) == sorted(names), opened  # once each, over 2 x 12 reads


def test_worker_init_keeps_a_worker_to_one_thread():
    """Each loader worker decodes with one thread (torch and blosc), so 4 workers per rank don't fight the
    training step for cores. The blosc line had slipped behind the parent-watch loop, where it never ran."""
    code = """
import torch
from numcodecs import blosc
from data.store_dataset import worker_init
blosc.set_nthreads(4)
worker_init(0)
print(torch.get_num_threads(), blosc.get_nthreads())
"""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.stdout.split() == ["1", "1"], out.stderr[-2000:]


@pytest.mark.slow
def test_validation_keeps_one_worker_between_runs_with_the_same_batches(tiny_store):
    """The validation loader's worker persists (a spawned worker's start cost 8-9 s a validation on the 2-core
    machine): one worker at most, the same batches each validation (fixed anchors), the same process serving them,
    and gone after the shutdown fit's end does (stages/train_fit.py)."""
    from pipeline.config import load_config
    from stages.train_store import dataloaders

    cfg = load_config(None, ["train.num_workers=2", "train.batch_size=8"])
    _, val_dl, _ = dataloaders(cfg, tiny_store, StoreReader(tiny_store), 0, 1, pad_multiple=1)
    assert val_dl is not None and val_dl.num_workers == 1 and val_dl.persistent_workers
    first = list(val_dl)
    pids = [w.pid for w in val_dl._iterator._workers]
    second = list(val_dl)
    assert [w.pid for w in val_dl._iterator._workers] == pids and len(pids) == 1
    assert len(first) == len(second) > 0
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    workers = val_dl._iterator._workers
    val_dl._iterator._shutdown_workers()
    assert not any(w.is_alive() for w in workers)
