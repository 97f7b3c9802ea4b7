"""Stage one on the tiny target: capture equals hidden_states[k+1], multi-shard CLI runs, resume after kill -9,
refusals, verify catching corruption, and a plain-zarr read of one sample."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from pipeline import store as st
from pipeline.config import load_config
from pipeline.encoding import decode, from_storage
from pipeline.provenance import create_or_open_store
from pipeline.store_reader import StoreReader
from pipeline.store_writer import ShardWriter
from pipeline.target import FeatureCapture, capture_features, load_target, truncate_layers

from helpers_cli import HANG_S, TINY_STORE_OPTS, dflash  # noqa: E402
from helpers_cli import dflash_all, dflash_each  # noqa: E402 - side by side / refusals in one subprocess

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = TINY_STORE_OPTS  # the options of the session's tiny store (tests/conftest.py: tiny_store)


def test_capture_equals_output_hidden_states():
    cfg = load_config(TINY)
    model = load_target(cfg.target.path, torch.float32, torch.device("cpu"))
    ids = torch.randint(4, model.config.vocab_size, (2, 20))
    att = torch.ones_like(ids)
    att[1, 15:] = 0
    ref = model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
    layer_ids = [1, 3, 5]
    truncate_layers(model, max(layer_ids) + 1)
    cap = FeatureCapture(model, layer_ids)
    got = capture_features(model, cap, ids, att)  # [B, S, L, H]
    for j, k in enumerate(layer_ids):
        torch.testing.assert_close(got[:, :, j], ref[k + 1], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[:, :, j], ref[k])  # the off-by-one this test exists for
    assert len(model.model.layers) == 6


@pytest.fixture
def two_shard_store(tiny_store):
    """The session's tiny store (tests/conftest.py), which the extract CLI wrote with 2 shards: its fixture
    asserts the run's "finished shard(s) [0, 1]" and "complete" lines. Read only; reruns take a copy."""
    return tiny_store


@pytest.mark.slow  # a two-shard extraction again (worker processes), verify and inspect: several processes
def test_two_shards_store_is_complete_and_valid(two_shard_store, tiny_store_copy):
    logs = Path(two_shard_store) / "logs"  # the workers ran on the parent's resolved config and samples
    assert load_config(str(logs / "extract-config.yaml")).data.max_samples == 240
    for i in range(2):
        assert f"--samples {logs}/extract-samples-{i:05d}.npz" in (logs / f"extract-shard-{i:05d}.log").read_text()
    reader = StoreReader(two_shard_store)
    assert len(reader.samples) == 240
    assert len({s.sample_id for s in reader.samples}) == 240
    assert {s.shard for s in reader.samples} == {0, 1}
    # verify and inspect read the store, the rerun its copy: side by side (each must exit 0)
    v, i, again = dflash_all(["verify", two_shard_store], ["inspect", two_shard_store],
                             ["extract", "--config", TINY, "--shards", "2", "--store", tiny_store_copy, *SMALL])
    assert "is valid" in v.stdout
    assert "B/token" in i.stdout and "[0] done" in i.stdout and "[1] done" in i.stdout
    assert "nothing to do" in again.stderr


def test_features_equal_reference_forward(two_shard_store):
    cfg = load_config(TINY)
    reader = StoreReader(two_shard_store)
    model = load_target(cfg.target.path, torch.float32, torch.device("cpu"))
    for index in (0, 57):
        s = reader.read(index)
        ids = torch.from_numpy(s["tokens"].astype(np.int64))[None]
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        ref = torch.stack([hs[k + 1][0] for k in reader.layer_ids], dim=1)  # [S, L, H]
        got = decode({"features": from_storage(s["features"])}, "bf16", torch.float32)
        torch.testing.assert_close(got, ref.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)


def test_frozen_head_file_is_the_targets_embedding_head_and_norm(two_shard_store):
    from safetensors.torch import load_file

    cfg = load_config(TINY)
    model = load_target(cfg.target.path, torch.float32, torch.device("cpu"))
    head = load_file(st.frozen_head_path(two_shard_store))
    assert torch.equal(head["embed_tokens.weight"], model.get_input_embeddings().weight)
    tied = bool(model.config.tie_word_embeddings)
    assert st.read_root_attrs(two_shard_store)["target"]["tie_word_embeddings"] == tied
    # a tied target (the tiny one is) stores the embedding once; training uses it as the head
    got = head["embed_tokens.weight"] if tied else head["lm_head.weight"]
    assert ("lm_head.weight" in head) != tied
    assert torch.equal(got, model.get_output_embeddings().weight)
    assert torch.equal(head["norm.weight"], model.model.norm.weight)


def test_tied_target_head_is_its_embedding(tmp_path):
    """A tied target's checkpoint has no lm_head.weight; the head must be the embedding, never a fresh matrix."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.target import frozen_head_tensors

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "tied")
    model = load_target(str(tmp_path / "tied"), torch.float32, torch.device("cpu"))
    t = frozen_head_tensors(model)
    assert torch.equal(t["lm_head.weight"], t["embed_tokens.weight"])
    ids = torch.randint(0, 64, (1, 9))
    out = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, out.hidden_states[-1] @ t["lm_head.weight"].T, rtol=1e-5, atol=1e-5)


def test_plain_zarr_read_without_dflash(two_shard_store):
    code = f"""
import json, sys, numpy as np, zarr
sys.modules['pipeline'] = None  # prove no dflash import is needed
root = zarr.open_group({two_shard_store!r}, mode='r')
a = root.attrs['dflash']
g = root['shards/00001']
n = g.attrs['progress']['committed_samples']
start, length = int(g['sample_start'][0]), int(g['sample_length'][0])
toks = g['tokens'][start:start + length]
feats = g['features'][start:start + length]
assert feats.dtype == np.dtype(a['feature_dtype']) and feats.shape == (length, len(a['layer_ids']), a['hidden_size'])
bf = (feats.astype(np.uint32) << 16).view(np.float32)  # bf16 bits -> float32
assert np.isfinite(bf).all() and toks.max() < a['target']['vocab_size']
print(json.dumps({{'n': n, 'len': length}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n"] > 0


def _store_content(path):
    reader = StoreReader(path)
    out = {}
    for i, ref in enumerate(reader.samples):
        s = reader.read(i)
        out[ref.sample_id] = (s["tokens"].tobytes(), s["features"].tobytes(), ref.split)
    return out


@pytest.mark.slow
def test_resume_after_kill_equals_uninterrupted(tmp_path, two_shard_store):
    store = str(tmp_path / "k.zarr")
    args = [sys.executable, "-m", "stages.cli", "extract", "--config", TINY, "--shards", "2", "--store", store,
            *SMALL, "--set", "extract.token_budget=512"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    rng = np.random.default_rng(0)
    for round_ in range(2):  # kill a random worker at a random point, twice
        p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + HANG_S  # a hang guard only (tests/helpers_cli.py)
        killed = False
        while time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
            try:
                root = zarr.open_group(store, mode="r")
                shard = int(rng.integers(0, 2))
                prog = dict(root[st.shard_name(shard)].attrs).get("progress", {})
            except Exception:  # noqa: BLE001 - store not created yet
                continue
            if prog.get("committed_batches", 0) >= 2 + 2 * round_ and not prog.get("done"):
                out = subprocess.run(["pgrep", "-f", f"extract_worker.*--shard-index {shard} .*{store}"],
                                     capture_output=True, text=True).stdout.split()
                for pid in out:
                    os.kill(int(pid), signal.SIGKILL)
                killed = bool(out)
                break
        rc = p.wait(timeout=HANG_S)
        if killed:
            assert rc == 1, (rc, p.stderr.read())
            assert "failed" in (err := p.stderr.read()) and "resume" in err
    dflash("extract", "--config", TINY, "--shards", "2", "--store", store, *SMALL, "--set", "extract.token_budget=512")
    assert dflash("verify", store).returncode == 0
    # same samples, same tokens, same features as the uninterrupted store (different batching: features equal
    # to bf16 rounding of the same forward, compared below per sample)
    a, b = _store_content(store), _store_content(two_shard_store)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0] and a[k][2] == b[k][2]
        fa = np.frombuffer(a[k][1], np.uint16).astype(np.uint32) << 16
        fb = np.frombuffer(b[k][1], np.uint16).astype(np.uint32) << 16
        np.testing.assert_allclose(fa.view(np.float32), fb.view(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_resumed_store_is_bitwise_equal_with_same_plan(tmp_path):
    """Kill -9 mid-run and resume with the same batch plan: the features are bit-for-bit identical."""
    ref, store = str(tmp_path / "ref.zarr"), str(tmp_path / "k.zarr")
    opts = [*SMALL, "--set", "extract.token_budget=512", "--set", "data.max_samples=60"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with open(tmp_path / "ref.log", "w") as log:  # the uninterrupted reference, beside the run killed below
        ref_run = subprocess.Popen([sys.executable, "-m", "stages.cli", "extract", "--config", TINY, "--shards", "1",
                                    "--store", ref, *opts], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    q = subprocess.Popen([sys.executable, "-m", "stages.cli", "extract", "--config", TINY, "--shards", "1",
                          "--store", store, *opts], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + HANG_S
    while time.time() < deadline:
        try:
            prog = dict(zarr.open_group(store, mode="r")[st.shard_name(0)].attrs).get("progress", {})
            if prog.get("committed_batches", 0) >= 2:
                break
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.1)
    for pid in subprocess.run(["pgrep", "-f", f"extract_worker.*{store}"], capture_output=True, text=True).stdout.split():
        os.kill(int(pid), signal.SIGKILL)
    q.wait(timeout=HANG_S)
    dflash("extract", "--config", TINY, "--shards", "1", "--store", store, *opts)
    assert ref_run.wait(timeout=HANG_S) == 0, (tmp_path / "ref.log").read_text()[-3000:]  # a hang guard only
    assert _store_content(store) == _store_content(ref)


@pytest.mark.slow  # four refusing extract commands in one subprocess (helpers_cli.dflash_each)
def test_refusals(tmp_path, tiny_store_copy):
    two_shard_store = tiny_store_copy
    other = tmp_path / "other.zarr"
    zarr.open_group(str(other), mode="w", attributes={"hello": 1})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    # four ways this run differs from the one that made the store: one refusal names each on its own line
    # (provenance_differences in pipeline/provenance.py), so one command proves all four (they were four)
    r, foreign, no_samples, fingerprint = dflash_each(
        ["extract", "--config", TINY, "--shards", "3", "--store", two_shard_store, *SMALL,
         "--set", "target.layer_ids=[1,2,3]", "--set", "store.encoding=fp8", "--set", "data.enable_thinking=true"],
        ["extract", "--config", TINY, "--store", str(other), *SMALL],
        ["extract", "--config", TINY, "--store", str(tmp_path / "e.zarr"), "--set",
         f"data.train_files=[{empty}]", "--set", "data.validation_files=[]"],
        ["extract", "--config", TINY, "--shards", "2", "--store", two_shard_store,
         "--set", "data.max_samples=100", "--set", "extract.token_budget=2048"])
    assert r.returncode == 2 and "different run" in r.stderr, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    for says in ("layer_ids: store has [1, 3, 5], this run has [1, 2, 3]", "num_shards: store has 2, this run has 3",
                 "encoding: store has 'bf16', this run has 'fp8'", "enable_thinking: store has False, this run has True"):
        assert sum(says in x for x in lines) == 1, (says, r.stderr[-3000:])
    assert foreign.returncode == 2 and "not a dflash store" in foreign.stderr, foreign.stderr[-3000:]
    r = no_samples
    assert r.returncode == 2 and ("no samples" in r.stderr.lower() or "empty" in r.stderr.lower()), r.stderr
    assert fingerprint.returncode == 2 and "dataset.fingerprint" in fingerprint.stderr, fingerprint.stderr[-3000:]


def test_unwritable_store_path_fails_clearly(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = dflash("extract", "--config", TINY, "--store", str(blocker / "s.zarr"), *SMALL, check=False)
    assert r.returncode == 2 and "error:" in r.stderr and str(blocker) in r.stderr
    assert "Traceback" not in r.stderr


def test_verify_catches_corruption_and_truncation(tmp_path, two_shard_store):
    import shutil

    bad = tmp_path / "bad.zarr"
    shutil.copytree(two_shard_store, bad)
    chunk = bad / "shards/00000/features/c/0/0/0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    r = dflash("verify", str(bad), check=False)
    assert r.returncode == 1 and "shard 0: array features, chunk 0 (rows 0..1023)" in r.stdout
    assert "checksum" in r.stdout and "sample ids" in r.stdout
    cut = tmp_path / "cut.zarr"
    shutil.copytree(two_shard_store, cut)
    (cut / "shards/00001/tokens/c/0").unlink()
    r = dflash("verify", str(cut), check=False)
    assert r.returncode == 1 and "shard 1: array tokens, chunk 0 (rows 0..16383) is missing" in r.stdout


def test_nonfinite_samples_are_skipped_and_counted(tmp_path, monkeypatch):
    import stages.extract_worker as w
    from stages.extract import build_provenance
    from data.ingest import ingest
    from pipeline.target import load_tokenizer

    cfg = load_config(TINY, ["data.max_samples=20"])
    store = str(tmp_path / "nan.zarr")
    tok = load_tokenizer(cfg.target.path)
    samples, _ = ingest(cfg.data, tok)
    create_or_open_store(store, build_provenance(cfg, tok, samples, 1, "test"))
    import stages.extract_loop as loop

    real = loop.capture_features

    def poisoned(model, capture, ids, att):
        out = real(model, capture, ids, att).clone()
        out[0, 1, 0, 0] = float("nan")  # first sample of every batch
        return out

    monkeypatch.setattr(loop, "capture_features", poisoned)
    monkeypatch.setattr(w, "die_with_parent", lambda: None)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert w.run_shard(cfg, 0, 1, store) == 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    reader = StoreReader(store)
    skipped = reader.progress[0].nonfinite_skipped
    assert skipped >= 1 and len(reader.samples) == 20 - skipped


def test_disk_full_fails_clearly_and_resumes(tmp_path, monkeypatch):
    """A write that fails with ENOSPC after the first commit: clear error, committed part valid, rerun finishes."""
    import errno

    import stages.extract_worker as w
    from data.ingest import ingest
    from pipeline.target import load_tokenizer
    from stages.extract import build_provenance

    cfg = load_config(TINY, ["data.max_samples=40", "extract.token_budget=512"])
    store = str(tmp_path / "full.zarr")
    tok = load_tokenizer(cfg.target.path)
    samples, _ = ingest(cfg.data, tok)
    create_or_open_store(store, build_provenance(cfg, tok, samples, 1, "test"))
    real_write = ShardWriter.write_batch
    calls = {"n": 0}

    def full_after_one(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *a, **k)

    monkeypatch.setattr(ShardWriter, "write_batch", full_after_one)
    monkeypatch.setattr(w, "die_with_parent", lambda: None)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(st.StoreError, match="No space left on device.*intact.*resume"):
            w.run_shard(cfg, 0, 1, store)
        committed = StoreReader(store, require_complete=False)
        assert committed.progress[0].committed_batches == 1 and not committed.progress[0].done
        monkeypatch.setattr(ShardWriter, "write_batch", real_write)
        assert w.run_shard(cfg, 0, 1, store) == 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert len(StoreReader(store).samples) == 40


def test_workers_take_the_parents_tokenised_samples(tmp_path, monkeypatch):
    """`dflash extract` tokenises once: each worker gets its shard's samples and the resolved config as files, so
    a worker no longer reads the data (here: the data files are gone) and extracts the same store."""
    import stages.extract_worker as w
    from data.ingest import ingest, load_shard_samples, save_shard_samples
    from pipeline.config import config_from_dict, dump_config
    from pipeline.target import load_tokenizer
    from stages.extract import build_provenance

    import yaml

    cfg = load_config(TINY, ["data.max_samples=24"])
    tok = load_tokenizer(cfg.target.path)
    samples, _ = ingest(cfg.data, tok)
    for i in range(2):  # the files round-trip each shard's samples exactly
        save_shard_samples(samples, 2, i, tmp_path / f"s{i}.npz")
        back, meta = load_shard_samples(tmp_path / f"s{i}.npz")
        assert meta == {"dataset_fingerprint": build_provenance(cfg, tok, samples, 2, "t")["dataset"]["fingerprint"],
                        "num_shards": 2, "shard": i}
        assert [(s.sample_id, s.split) for s in back] == [(s.sample_id, s.split) for s in samples[i::2]]
        assert all(np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
                   for a, b in zip(back, samples[i::2]))
    store = str(tmp_path / "h.zarr")
    create_or_open_store(store, build_provenance(cfg, tok, samples, 2, "test"))
    resolved = config_from_dict(yaml.safe_load(dump_config(cfg)), "resolved")
    resolved.data.train_files = [str(tmp_path / "gone.jsonl")]  # a worker that read the data would fail here
    monkeypatch.setattr(w, "die_with_parent", lambda: None)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(st.StoreError, match="holds shard 0 of 2, not 1 of 2"):
            w.run_shard(resolved, 1, 2, store, samples_file=str(tmp_path / "s0.npz"))
        for i in range(2):
            assert w.run_shard(resolved, i, 2, store, samples_file=str(tmp_path / f"s{i}.npz")) == 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    reader = StoreReader(store)
    assert sorted(r.sample_id for r in reader.samples) == sorted(st.sample_id_to_int(s.sample_id) for s in samples)
