"""The real target's architecture (Qwen3.5/3.6: Qwen3_5ForConditionalGeneration, Gated DeltaNet + gated attention)
on a tiny replica built in code (scripts/make_tiny_hybrid.py): loading like a serving engine, the frozen head
from the checkpoint, the weights fingerprint, the cache rollback of speculative decoding, the kernel preflight,
and the whole pipeline end to end."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.target import (FeatureCapture, capture_features, frozen_head_from_checkpoint, frozen_head_tensors,
                             load_target, target_fingerprint)

from helpers_cli import HANG_S, dflash, side_by_side  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from scripts.make_tiny_hybrid import build_tiny_hybrid  # noqa: E402

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)

@pytest.fixture(scope="module")
def reference(hybrid):
    """What transformers itself loads from the replica (the text-only Qwen3_5ForCausalLM)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hybrid), dtype=torch.float32).eval()


def test_replica_has_the_real_layout(hybrid, reference):
    cfg = json.loads((hybrid / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25 and cfg["tie_word_embeddings"] is False
    index = json.loads((hybrid / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2 and all((hybrid / f).exists() for f in set(index.values()))
    assert any(k.startswith("mtp.") for k in index) and any(k.startswith("model.visual.") for k in index)
    assert any(k.startswith("model.language_model.layers.0.linear_attn.") for k in index)
    assert any(k.startswith("model.language_model.layers.3.self_attn.") for k in index)
    assert type(reference).__name__ == "Qwen3_5ForCausalLM"


def test_load_is_text_only_and_equals_transformers(hybrid, reference):
    model = load_target(str(hybrid), torch.float32, CPU)
    names = [n for n, _ in model.named_parameters()]
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and len(model.model.layers) == 8
    assert not any("visual" in n or "mtp" in n for n in names)
    ref_sd, sd = reference.state_dict(), model.state_dict()
    assert sorted(sd) == sorted(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    ids = torch.randint(4, 500, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
    assert model.generation_config.eos_token_id == 2


def test_truncated_load_captures_hidden_states_k_plus_1(hybrid, reference):
    """Layers past the deepest tap are never built; the captured features are transformers' hidden_states[k+1]."""
    layer_ids = [1, 3, 5]
    model = load_target(str(hybrid), torch.float32, CPU, keep_layers=max(layer_ids) + 1)
    assert len(model.model.layers) == 6 and not any(".layers.6." in n for n, _ in model.named_parameters())
    ids = torch.randint(4, 500, (2, 21), generator=torch.Generator().manual_seed(1))
    att = torch.ones_like(ids)
    att[1, 16:] = 0
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
    cap = FeatureCapture(model, layer_ids)
    got = capture_features(model, cap, ids, att)
    for j, k in enumerate(layer_ids):
        torch.testing.assert_close(got[:, :16, j], ref[k + 1][:, :16], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[:, :16, j], ref[k][:, :16])


def test_frozen_head_read_from_the_checkpoint(hybrid, reference):
    head = frozen_head_from_checkpoint(str(hybrid), torch.float32)
    want = frozen_head_tensors(reference)
    assert set(head) == set(want) == {"embed_tokens.weight", "lm_head.weight", "norm.weight"}
    for k in want:
        assert torch.equal(head[k], want[k]), k
    assert not torch.equal(head["lm_head.weight"], head["embed_tokens.weight"])  # untied, like the 27B
    # Qwen3_5RMSNorm is x * (1 + w): the stored weight is zero-centred, and the logits use it that way
    ids = torch.randint(4, 500, (1, 9))
    with torch.no_grad():
        out = reference(input_ids=ids, output_hidden_states=True)
    assert abs(float(head["norm.weight"].mean())) < 0.5
    torch.testing.assert_close(out.logits, out.hidden_states[-1] @ head["lm_head.weight"].T, rtol=1e-5, atol=1e-5)


def _edit_tensor_in_place(path: Path, name: str) -> None:
    """Flip the sign of one tensor's bytes inside its safetensors file: same size, same header."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start, end = header[name]["data_offsets"]
        f.seek(8 + n + start)
        t = torch.frombuffer(bytearray(f.read(end - start)), dtype=torch.float32)
        f.seek(8 + n + start)
        f.write((-t - 1.0).numpy().tobytes())


def test_fingerprint_changes_when_one_tensor_changes(hybrid, tmp_path, monkeypatch):
    import pipeline.checkpoint as ck

    monkeypatch.setenv("DFLASH_HASH_CACHE", str(tmp_path / "hashes.json"))
    calls = []
    real = ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda f, *a: calls.append(Path(f).name) or real(f, *a))
    copy = tmp_path / "target"
    shutil.copytree(hybrid, copy)
    before = target_fingerprint(str(copy))
    assert before["weights_hash"] == "content" and len(calls) == 3  # every shard read once
    assert target_fingerprint(str(copy)) == before and len(calls) == 3  # cached: nothing read again
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    shard = copy / index["lm_head.weight"]
    size = shard.stat().st_size
    _edit_tensor_in_place(shard, "lm_head.weight")
    assert shard.stat().st_size == size
    after = target_fingerprint(str(copy))
    assert after["weights_sha256"] != before["weights_sha256"]
    assert after["config_sha256"] == before["config_sha256"] and calls[3:] == [shard.name]  # only it re-read
    assert {k: v for k, v in after.items() if k != "weights_sha256"} == {k: v for k, v in before.items()
                                                                          if k != "weights_sha256"}


# ---------------------------------------------------------------------------------------------------------------
# speculative decoding with a rolled-back cache
# ---------------------------------------------------------------------------------------------------------------


def test_rollback_equals_a_forward_over_the_kept_tokens(hybrid):
    from pipeline.target_cache import RollbackCache

    model = load_target(str(hybrid), torch.float32, CPU)
    assert RollbackCache.support(model)[0] == "hybrid"
    ids = torch.randint(4, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids=ids).logits[0]
        rc = RollbackCache(model)
        rc.forward(ids[:, :12])
        pos = 12
        for block, keep in ((8, 3), (6, 1), (5, 0), (7, 7), (4, 2)):  # tokens verified, tokens kept
            rc.forward(ids[:, pos:pos + block])
            rc.rollback(pos + keep)
            pos += keep
            assert rc.length == pos
            nxt = rc.forward(ids[:, pos:pos + 1]).logits[0]
            torch.testing.assert_close(nxt, full[pos:pos + 1], rtol=1e-4, atol=1e-4)
            pos += 1
        assert rc.replays == 3  # keep 0: restore only; (7, 7) kept everything: nothing to restore
        # without restoring the linear states (attention KV cropped only) the next logits are wrong
        rc.forward(ids[:, pos:pos + 6])
        for layer in rc.cache.layers:
            if type(layer).__name__ == "DynamicLayer":
                layer.crop(-5)
        wrong = rc.forward(ids[:, pos + 1:pos + 2]).logits[0]
        assert (wrong - full[pos + 1:pos + 2]).abs().max() > 1e-2


def test_speculative_equals_greedy_on_the_hybrid(hybrid):
    from stages.speculate import TargetRunner, greedy_decode, speculative_decode

    model = load_target(str(hybrid), torch.float32, CPU)
    bs, layer_ids = 5, [1, 3, 5]
    for cache in ("auto", "kv", "recompute"):
        runner = TargetRunner(model, cache)
        assert runner.policy == ("recompute" if cache == "recompute" else "kv")
        prompt = [1, 6, 20, 30, 40, 2, 7, 9]
        g = greedy_decode(runner, prompt, 24, set())
        full = prompt + g.tokens
        calls = {"n": 0}

        def oracle(context, pos, last):  # right except at a rotating slot: every accept length happens
            d = (full[pos + 1:pos + bs] + [0] * bs)[:bs - 1]
            wrong = calls["n"] % bs
            calls["n"] += 1
            if wrong < bs - 1:
                d[wrong] = (d[wrong] + 1) % 500
            return d

        s = speculative_decode(runner, oracle, prompt, layer_ids, bs, 24, set(), feature_encoding=None)
        assert s.tokens == g.tokens and s.cache == runner.policy
        assert len(set(g.tokens)) > 5
        if runner.policy == "kv":
            assert runner._cache.replays > 0 and "linear-attention" in runner.describe()


def test_kv_policy_refused_with_the_reason_when_the_cache_cannot_roll_back():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stages.speculate import TargetRunner

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                      sliding_window=4, use_sliding_window=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="cannot roll back.*DynamicSlidingWindowLayer.*--cache recompute"):
        TargetRunner(model, "kv")
    auto = TargetRunner(model, "auto")
    assert auto.policy == "recompute" and "DynamicSlidingWindowLayer" in auto.describe()


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------


def test_kernel_preflight_lines(monkeypatch):
    import pipeline.kernels as kn

    types = (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert kn.kernel_report(["full_attention"] * 4, "cuda") is None  # dense: nothing to say
    assert "CPU: transformers' torch reference paths" in kn.kernel_report(types, "cpu")
    monkeypatch.setattr(kn, "available", lambda: {"fla": None, "causal_conv1d": None})
    slow = kn.kernel_report(types, "cuda")
    assert "48 linear-attention layers" in slow and "WARNING" in slow and "6,413 vs 9,291 tokens/s" in slow
    assert 'pip install -e ".[gpu]"' in slow
    monkeypatch.setattr(kn, "available", lambda: {"fla": "0.6.0", "causal_conv1d": None})
    fast = kn.kernel_report(types, "cuda")
    assert "flash-linear-attention 0.6.0" in fast and "WARNING" not in fast and "autotuning cached" in fast
    assert "causal conv1d on torch" in fast
    assert "causal conv1d on flash-linear-attention's Triton kernel" in kn.kernel_report(types, "cuda", True)


@pytest.mark.slow
def test_kernels_transformers_binds_are_the_ones_reported(tmp_path):
    """With an importable `fla` (a stand-in package here), transformers binds its kernels and both the preflight
    and the resolved names say so; without it they name the torch fallback."""
    fake = tmp_path / "site" / "fla" / "ops" / "gated_delta_rule"
    fake.mkdir(parents=True)
    (tmp_path / "site" / "fla" / "__init__.py").write_text("")
    (tmp_path / "site" / "fla" / "ops" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("def chunk_gated_delta_rule(q, k, v, g, beta, **kw): raise RuntimeError\n"
                                      "def fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw): raise RuntimeError\n")
    code = ("import json; from pipeline.kernels import available, resolved_kernels; "
            "print(json.dumps([available(), resolved_kernels()]))")
    cases = ((None, "transformers.models.qwen3_5"), (str(tmp_path / "site"), "fla.ops.gated_delta_rule"))
    outs = side_by_side(*[([sys.executable, "-c", code],  # the two processes side by side
                           {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, str(ROOT)]))})
                          for site, _ in cases])
    for (site, expect), out in zip(cases, outs):
        have, bound = json.loads(out.stdout.strip().splitlines()[-1])
        assert (have["fla"] is not None) == (site is not None)
        assert bound["chunk_gated_delta_rule"].startswith(expect), bound
        assert bound["fused_recurrent_gated_delta_rule"].startswith(expect), bound
        assert bound["causal_conv1d_fn"].startswith("transformers.models.qwen3_5")  # no causal-conv1d either way


def test_kernel_cache_is_kept_across_runs(monkeypatch, tmp_path):
    import pipeline.kernels as kn

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setenv("DFLASH_COMPILE_CACHE", str(tmp_path / "compile"))
    d = kn.use_kernel_cache()
    assert d.parent == tmp_path / "kernels" and d.is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(d) and os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert kn.use_kernel_cache() == d  # the same directory for the next run (keyed by versions only)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert kn.use_kernel_cache() == tmp_path / "mine"  # the user's choice wins


# ---------------------------------------------------------------------------------------------------------------
# host memory of loading, and the whole pipeline
# ---------------------------------------------------------------------------------------------------------------

_RSS = """
import json, sys, torch
from pipeline.checkpoint import peak_rss_bytes
import transformers.models.qwen3_5.modeling_qwen3_5  # imports paid before the baseline
path, how = sys.argv[1], sys.argv[2]
before = peak_rss_bytes()
if how == "dflash":
    from pipeline.target import load_target
    m = load_target(path, torch.bfloat16, torch.device("cpu"), keep_layers=1)
else:  # the plain way: from_pretrained (memory-maps every shard), then .to(device), which reads every byte of it
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    sum(float(p.float().sum()) for p in m.parameters())  # the reads a host-to-GPU copy makes
print(json.dumps({"growth": peak_rss_bytes() - before, "layers": len(m.model.layers)}))
"""


@pytest.mark.slow
def test_loading_never_holds_the_checkpoint_in_host_memory(tmp_path):
    """A ~200 MB replica (8 shards, bf16): loading layer 0 for extraction grows the peak resident memory by a
    small part of the checkpoint; from_pretrained followed by the reads of a move to the GPU (the plain load)
    by about all of it (its mapped shards become resident), which shows the measurement catches a full host copy.
    On a GPU the kept tensors go to the device, so the growth is smaller still."""
    big = build_tiny_hybrid(tmp_path / "big", hidden=1024, ffn=4096, layers=8, shards=8, dtype="bfloat16")
    size = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    assert size > 150e6
    got = {}
    for how in ("dflash", "from_pretrained"):
        out = subprocess.run([sys.executable, "-c", _RSS, str(big), how], cwd=ROOT, capture_output=True, text=True,
                             timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr[-2000:]
        got[how] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dflash"]["layers"] == 1 and got["from_pretrained"]["layers"] == 8
    assert got["dflash"]["growth"] < 0.3 * size, (got, size)
    assert got["from_pretrained"]["growth"] > 0.9 * size, (got, size)


def _sets(*items):
    return [x for item in items for x in ("--set", item)]


HYBRID_RUN = ("drafter.hidden_size=64", "drafter.intermediate_size=128", "drafter.num_attention_heads=4",
              "drafter.num_key_value_heads=2", "drafter.head_dim=16", "data.max_samples=48", "target.name=qwen3_5-tiny")


@pytest.mark.slow
def test_hybrid_end_to_end_lossless_with_the_rolled_back_cache(hybrid, tmp_path):
    """extract -> train -> export -> offline eval -> online eval with --cache kv on the replica (multi-shard
    extraction is test_extract's; one shard keeps this run short)."""
    store, run, out = str(tmp_path / "store.zarr"), tmp_path / "run", tmp_path / "eval"
    common = ["--config", TINY, *_sets(f"target.path={hybrid}", *HYBRID_RUN)]
    r = dflash("extract", *common, "--shards", "1", "--store", store)
    assert "complete" in r.stderr
    assert "target kernels (6 linear-attention layers): CPU: transformers' torch reference paths" in r.stderr
    from pipeline import store as st
    from pipeline.store_reader import StoreReader

    attrs = st.read_root_attrs(store)
    assert attrs["target"]["model_type"] == "qwen3_5" and attrs["layer_ids"] == [1, 3, 5]
    assert attrs["target"]["weights_hash"] == "content"
    logs = "".join(p.read_text() for p in Path(store, "logs").glob("extract-shard-*.log"))
    assert "target kernels: {'chunk_gated_delta_rule': 'transformers.models.qwen3_5" in logs
    # a stored sample's features are the replica's hidden_states[k+1] (bf16 store: bf16 rounding)
    from transformers import AutoModelForCausalLM

    from pipeline.encoding import decode, from_storage

    ref = AutoModelForCausalLM.from_pretrained(str(hybrid), dtype=torch.float32).eval()
    sample = StoreReader(store).read(0)
    ids = torch.from_numpy(sample["tokens"].astype("int64"))[None]
    with torch.no_grad():
        hs = ref(input_ids=ids, output_hidden_states=True).hidden_states
    want = torch.stack([hs[k + 1][0] for k in (1, 3, 5)], dim=1)  # [S, L, H]
    got = decode({"features": from_storage(sample["features"])}, "bf16", torch.float32)
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
    dflash("train", *common, "--store", store,
           *_sets(f"train.run_dir={run}", "train.max_steps=12", "train.batch_size=8", "train.num_workers=0",
                  "train.val_every=1000", "train.checkpoint_every=1000"))
    export = run / "export"
    assert (export / "model.safetensors").exists()
    e = dflash("eval", str(export), *common, "--store", store, "--online", "--cache", "kv", "--out", str(out),
               *_sets("eval.num_prompts=4", "eval.max_new_tokens=16", "eval.max_anchors_per_sample=16"))
    assert "eval: target kernels (6 linear-attention layers)" in e.stderr and "cache=kv" in e.stderr
    report = json.loads((out / "report.json").read_text())
    on = report["online"]
    assert report["offline"]["tau"] >= 1.0
    assert on["lossless"] and on["mismatches"] == 0 and on["cache"] == "kv", on
    assert "linear-attention conv+recurrent states restored" in on["cache_rollback"]
    assert on["speculative_target_forwards"] < on["greedy_target_forwards"] + on["prompts"] * 16


_AUTOTUNE = """
import torch
from pipeline.kernels import resolved_kernels, use_kernel_cache
use_kernel_cache()  # before the kernels are imported, as the extract worker and the online eval do
from bench.extract_bench import build_model
model, cfg = build_model("qwen3_5", "tiny", device="cuda")
print("BOUND", resolved_kernels()["chunk_gated_delta_rule"], flush=True)
with torch.inference_mode():
    for B, S in ((2, 300), (3, 200), (2, 300)):
        model.model(input_ids=torch.randint(0, 1000, (B, S), device="cuda"), use_cache=False)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_kernel_autotuning_is_paid_once_per_machine(tmp_path):
    """With flash-linear-attention installed (`.[gpu]`), transformers binds its Triton kernels; the first process
    autotunes them, a second process (a resumed run, the next shard) reads every choice from the kept cache."""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention (fla-core) not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env.update(DFLASH_COMPILE_CACHE=str(tmp_path / "compile"), TRITON_PRINT_AUTOTUNING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    runs = [subprocess.run([sys.executable, "-c", _AUTOTUNE], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "BOUND fla.ops.gated_delta_rule" in runs[0].stdout
    assert runs[0].stdout.count("Triton autotuning for function") > 0
    assert runs[1].stdout.count("Triton autotuning for function") == 0, runs[1].stdout[-3000:]
    assert list((tmp_path / "kernels").rglob("*.autotune.json"))


@pytest.mark.slow
def test_benchmarks_run_on_cpu_at_a_tiny_size(tmp_path):
    """The extract35 and load35 parts (bench/extract_bench.py --arch qwen3_5, bench/load_bench.py) as `bash
    bench/device_run.sh smoke` runs them, at their tiny size (tests/test_bench_parts.py leaves them to this test)."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.parts", "run", "--tiny", "extract35", "load35"], cwd=ROOT,
                       capture_output=True, text=True, timeout=HANG_S,
                       env={**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    x = json.loads((out / "extract35.json").read_text())
    assert x["arch"] == "qwen3_5" and x["layers_built"] == 6 and x["layer_ids"] == [1, 2, 3, 4, 5]
    assert x["kernels"]["chunk_gated_delta_rule"].startswith("transformers.")  # no fla on this machine
    assert x["forward"].startswith("target forward: transformers' reference (CPU")  # the fast forward is CUDA-only
    assert all(x["encodings"][e]["ratio_vs_bare"] > 0 for e in ("int5", "fp8", "bf16"))
    assert "extract_meets_goal" in x["goals"]
    log = (out / "extract35.log").read_text()
    assert "goals (one H200)" in log and "CPU: transformers' torch reference paths" in log
    loads = json.loads((out / "load35.json").read_text())["loads"]
    assert loads["dflash"]["layers"] == loads["old"]["layers"] == 4
