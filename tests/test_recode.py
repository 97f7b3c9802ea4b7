"""`dflash recode`: a finished store converted to another encoding without the target; resumable; refusals;
and the recoded store trains."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from pipeline import store as st
from pipeline.encoding import decode, from_storage
from pipeline.store_reader import StoreReader
from pipeline.store_writer import ShardWriter
from stages.recode import run_recode

from helpers_cli import dflash  # noqa: E402
from helpers_cli import dflash_all, must_pass, start  # noqa: E402 - independent commands side by side
from helpers_cli import dflash_each  # noqa: E402 - several refusing commands in one subprocess

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture
def src(tiny_store):
    """The session's tiny bf16 store (tests/conftest.py); recode only reads its source."""
    return tiny_store


def features(path):
    r = StoreReader(path)
    out = {}
    for i, ref in enumerate(r.samples):
        s = r.read(i)
        parts = {k: from_storage(v) for k, v in s.items() if k not in ("tokens", "loss_mask")}
        out[ref.sample_id] = (s["tokens"], s["loss_mask"], decode(parts, r.encoding, torch.float32))
    return out


@pytest.mark.parametrize("encoding,max_err", [pytest.param("int5", 0.06, marks=pytest.mark.slow),  # ~17 s each
                                              pytest.param("int4+int8last", 0.12, marks=pytest.mark.slow)])
def test_recode_keeps_samples_and_features_and_is_inspectable(src, tmp_path, encoding, max_err):
    dst = str(tmp_path / "dst.zarr")
    r = dflash("recode", src, dst, "--encoding", encoding)
    assert "done" in r.stderr
    a, b = features(src), features(dst)
    assert a.keys() == b.keys()
    for sid in a:
        assert np.array_equal(a[sid][0], b[sid][0]) and np.array_equal(a[sid][1], b[sid][1])
        x, y = a[sid][2], b[sid][2]
        assert ((y - x).norm() / x.norm()).item() < max_err
    attrs = st.read_root_attrs(dst)
    assert attrs["encoding"] == encoding and attrs["recoded_from"]["encoding"] == "bf16"
    assert st.exists(st.frozen_head_path(dst))
    # three commands that only read the recoded store, side by side: verify, inspect, and a training (the recoded
    # store trains, decoded on the device in the step)
    run = tmp_path / "run"
    train = ["train", "--config", TINY, "--store", dst, "--set", f"train.run_dir={run}", "--set", "train.max_steps=3",
             "--set", "train.num_workers=0", "--no-export"]
    verify, inspect, t = dflash_all(["verify", dst], ["inspect", dst], train)
    assert "is valid" in verify.stdout
    out = inspect.stdout
    assert f"encoding {encoding}" in out and "x smaller" in out and "outliers" in out
    again = dflash("recode", src, dst, "--encoding", encoding)  # finished: nothing rewritten
    assert again.returncode == 0
    assert "3 steps" in t.stderr


def test_recode_resumes_after_a_crash(src, tmp_path, monkeypatch):
    ref = str(tmp_path / "ref.zarr")
    run_recode(src, dst=ref, encoding="int4", batch_tokens=600)
    dst = str(tmp_path / "crash.zarr")
    real = ShardWriter.write_batch
    calls = {"n": 0}

    def failing(self, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("simulated crash")
        return real(self, *args, **kw)

    monkeypatch.setattr(ShardWriter, "write_batch", failing)
    with pytest.raises(OSError):
        run_recode(src, dst=dst, encoding="int4", batch_tokens=600)
    monkeypatch.setattr(ShardWriter, "write_batch", real)
    run_recode(src, dst=dst, encoding="int4", batch_tokens=600)
    for name in ("features", "scales", "outliers", "tokens"):
        for shard in ("shards/00000", "shards/00001"):
            n = zarr.open_group(ref, mode="r")[shard].attrs["progress"]["committed_tokens"]
            assert np.array_equal(zarr.open_group(ref, mode="r")[f"{shard}/{name}"][:n],
                                  zarr.open_group(dst, mode="r")[f"{shard}/{name}"][:n])


@pytest.mark.slow  # three recode subprocesses (the five refusals in one of them)
def test_recode_refusals(src, tmp_path):
    dst = str(tmp_path / "x.zarr")
    dflash("recode", src, dst, "--encoding", "fp8")
    partial = str(tmp_path / "partial.zarr")
    shutil.copytree(src, partial)
    g = zarr.open_group(partial, mode="a")["shards/00001"]
    unfinished = {**g.attrs["progress"], "done": False}  # as a stopped extraction leaves it (with its checksum)
    g.update_attributes({"progress": unfinished, st.PROGRESS_SHA: st.digest(unfinished)})
    # a recode of the lossy store (it only reads it), beside the five refusals: five commands, one subprocess
    # (helpers_cli.dflash_each)
    lossy2 = start([sys.executable, "-m", "stages.cli", "recode", dst, str(tmp_path / "lossy2.zarr"), "--encoding",
                    "int4"])
    same, other_encoding, int3, nothing, unfinished_src = dflash_each(
        ["recode", src, src, "--encoding", "int4"], ["recode", src, dst, "--encoding", "int6"],
        ["recode", src, str(tmp_path / "y.zarr"), "--encoding", "int3"],
        ["recode", str(tmp_path / "nothing.zarr"), str(tmp_path / "z.zarr"), "--encoding", "int4"],
        ["recode", partial, str(tmp_path / "p2.zarr"), "--encoding", "int4"])
    r = same
    assert r.returncode == 2 and "DST must differ from SRC" in r.stderr
    r = other_encoding
    assert r.returncode == 2 and "encoding: store has 'fp8'" in r.stderr
    r = int3
    assert r.returncode == 2 and "int3" in r.stderr
    r = nothing
    assert r.returncode == 2 and "no store at" in r.stderr
    r = unfinished_src
    assert r.returncode == 2 and "not complete" in r.stderr and "dflash extract" in r.stderr
    r = must_pass(lossy2.result())
    assert "compounds the errors" in r.stderr
