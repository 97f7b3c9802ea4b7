"""The hybrid target's fast forward (pipeline/fast_forward.py): which forward runs when, and that it computes what
transformers' reference forward computes: on the CPU with the torch stand-ins of the kernels (the wiring: layouts,
zero-centred weights, fused residual, in-kernel gates), on the GPU with flash-linear-attention's kernels (bf16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pipeline.fast_forward as ff
from pipeline.target import FeatureCapture, capture_features, load_target

from helpers_cli import HANG_S, dflash  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(hybrid):
    return load_target(str(hybrid), torch.float32, CPU)


def _batch(seed=0, B=3, S=23, pad=(0, 5, 11)):
    ids = torch.randint(4, 500, (B, S), generator=torch.Generator().manual_seed(seed))
    att = torch.ones_like(ids)
    for r, p in enumerate(pad):
        if p:
            att[r, S - p:] = 0
    return ids, att


def _features(model, ids, att, layer_ids=range(8)):
    cap = FeatureCapture(model, list(layer_ids))
    try:
        return capture_features(model, cap, ids, att)
    finally:
        cap.remove()


def _scaled_max_error(got, ref) -> float:
    """max |got - ref| over max |ref|."""
    return float((got - ref).abs().max() / ref.abs().max())


# ---- selection ----------------------------------------------------------------------------------------------

def test_choose_says_which_forward_runs_and_why(model):
    cuda = torch.device("cuda")
    fast, line = ff.choose(model, cuda, True, have_fla=True)
    assert fast and "dflash's fast forward" in line
    assert ff.choose(model, cuda, False, have_fla=True) == (False, "target forward: transformers' reference "
                                                                    "(extract.fast_forward: false)")
    fast, line = ff.choose(model, CPU, True, have_fla=True)
    assert not fast and "CPU" in line
    fast, line = ff.choose(model, cuda, True, have_fla=False)
    assert not fast and "flash-linear-attention is not installed" in line and 'pip install -e ".[gpu]"' in line


def test_targets_it_does_not_cover_keep_the_reference_forward():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    fast, line = ff.choose(dense, torch.device("cuda"), True, have_fla=True)
    assert not fast and "Qwen3DecoderLayer is not covered" in line
    assert ff.enable(dense, torch.device("cuda"), True) == line and ff.installed(dense) == 0


def test_another_activation_keeps_the_reference_forward(model, monkeypatch):
    monkeypatch.setattr(model.config, "hidden_act", "gelu")
    fast, line = ff.choose(model, torch.device("cuda"), True, have_fla=True)
    assert not fast and "hidden_act 'gelu'" in line


def test_enable_on_the_cpu_leaves_the_model_as_it_is(model):
    line = ff.enable(model, CPU, True)
    assert "CPU" in line and ff.installed(model) == 0
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("section,default", [("extract", True), ("regenerate", True), ("eval", True)])
def test_each_stage_that_runs_the_target_has_the_switch(model, section, default):
    """On by default in every stage that runs the target: both GPU tests (without and with a cache) passed on the
    H200 (2026-12-02); each stage can turn it off."""
    from pipeline.config import ConfigError, load_config

    assert getattr(load_config(None, []), section).fast_forward is default
    assert getattr(load_config(None, [f"{section}.fast_forward=true"]), section).fast_forward is True
    assert getattr(load_config(None, [f"{section}.fast_forward=false"]), section).fast_forward is False
    with pytest.raises(ConfigError, match="fast_forward"):
        load_config(None, [f"{section}.fast_forward=sometimes"])
    assert ff.choose(model, torch.device("cuda"), False, have_fla=True, key=f"{section}.fast_forward") == (
        False, f"target forward: transformers' reference ({section}.fast_forward: false)")


def test_regenerate_and_online_eval_load_their_target_through_the_switch(hybrid, monkeypatch, capsys):
    """The embedded engine's and the online eval's loaders log the same line as extraction (here the CPU
    reason, or the switch when it is off) and install the fast forward when choose() says it runs."""
    from pipeline.config import load_config
    from stages.eval_online import load_online_target
    from stages.regen_worker import load_engine_target

    cpu_line = "target forward: transformers' reference (CPU; the fast forward's fused kernels are CUDA/Triton)"
    cfg = load_config(None, [f"target.path={hybrid}", "regenerate.fast_forward=true", "eval.fast_forward=true"])
    model, device = load_engine_target(cfg)
    assert device == CPU and ff.installed(model) == 0 and cpu_line in capsys.readouterr().err
    model = load_online_target(cfg, CPU, torch.float32)
    assert ff.installed(model) == 0 and f"eval: {cpu_line}" in capsys.readouterr().err
    off = load_config(None, [f"target.path={hybrid}", "regenerate.fast_forward=false", "eval.fast_forward=false"])
    load_engine_target(off)
    load_online_target(off, CPU, torch.float32)
    err = capsys.readouterr().err
    assert "(regenerate.fast_forward: false)" in err and "eval: target forward: transformers' reference " \
                                                           "(eval.fast_forward: false)" in err
    # where choose() says fast (CUDA with fla), both install it: here with the torch stand-ins as the kernels
    monkeypatch.setattr(ff, "choose", lambda m, d, enabled, key="": (enabled, f"fast or not: {key}"))
    monkeypatch.setattr(ff, "fla_ops", ff.torch_ops)
    model, _ = load_engine_target(cfg)
    assert ff.installed(model) > 0 and "fast or not: regenerate.fast_forward" in capsys.readouterr().err
    model = load_online_target(cfg, CPU, torch.float32)
    assert ff.installed(model) > 0 and "eval: fast or not: eval.fast_forward" in capsys.readouterr().err


@pytest.mark.slow
def test_extract_worker_logs_the_forward_it_runs(hybrid, tmp_path):
    """`dflash extract` on the hybrid replica: the shard log says which forward ran, following
    extract.fast_forward (on this CPU machine always the reference; with the switch off it says so)."""
    store = str(tmp_path / "store.zarr")
    sets = [f"target.path={hybrid}", "data.max_samples=6", "target.name=qwen3_5-tiny", "drafter.hidden_size=64",
            "extract.fast_forward=false"]
    dflash("extract", "--config", str(ROOT / "configs" / "tiny.yaml"), *[x for s in sets for x in ("--set", s)],
           "--shards", "1", "--store", store)
    logs = "".join(p.read_text() for p in Path(store, "logs").glob("extract-shard-*.log"))
    assert "target forward: transformers' reference (extract.fast_forward: false)" in logs, logs[-2000:]


@pytest.mark.slow
def test_bench_part_runs_on_cpu_at_a_tiny_size(tmp_path):
    """`bash bench/device_run.sh fastfwd`'s command lines (bench/parts.py) at their tiny size on the CPU (the GPU
    test skips; the bench runs both forwards, the torch stand-ins as the fast ops, and an extraction)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": "",
           "TRITON_CACHE_DIR": str(tmp_path / "kc")}
    r = subprocess.run([sys.executable, "-m", "bench.parts", "run", "--tiny", "fastfwd"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and "FAILED" not in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "test_fast_forward_equals_transformers_on_the_gpu_in_bf16" in (tmp_path / "out" / "fastfwd_test.log").read_text()
    x = json.loads((tmp_path / "out" / "fastfwd.json").read_text())
    assert x["ops"] == "torch" and x["modules_rebound"] > 0 and "fast_error" not in x
    assert x["reference"]["tok_s"] > 0 and x["fast"]["tok_s"] > 0 and x["speedup"] > 0
    assert set(x["extraction"]["encodings"]) == {"int5", "int5/null"}  # the writer thread, and no store write
    assert all(e["ratio_vs_bare"] > 0 and e["ratio_before_drain"] > 0 for e in x["extraction"]["encodings"].values())
    assert x["extraction"]["encodings"]["int5"]["warmup"]["batches"] == 1
    loop = x["extraction"]["encodings"]["int5"]["loop"]  # the loop's own figures
    assert loop["batches"] == 1 and loop["writer_busy_s"] > 0 and loop["queue_wait_s"] >= 0
    prof = x["extraction"]["profile"]  # the profiled window: the bare forward, then each encoding
    assert prof["batches"] == 1 and prof["bare"]["wall_ms"] > 0 and set(prof["added"]) == {"int5"}
    assert {"extract.forward", "extract.encode", "extract.queue", "extract.write"} <= set(prof["int5"]["host_ranges_ms"])
    assert "profiled window, 1 batches" in r.stdout and "host extract.write" in r.stdout
    assert abs(sum(x["fast"]["profile"]["families"].values()) - 1) < 1e-6
    assert "kernel family" in r.stdout and "extraction (32 tokens)" in r.stdout
    f = x["fp8_gemm"]  # step 4: the linears as FP8 GEMMs (the CPU multiplies the same quantized values in fp32)
    assert f["linears"] > 0 and f["tok_s"] > 0 and "fp8_gemm_error" not in x and "FP8 GEMMs (" in r.stdout
    assert all(0.9 < e["cosine"] <= 1 and 0 < e["rel_err"] < 0.5 for e in f["features"].values()), f["features"]


# ---- equality on the CPU (torch stand-ins of the kernels) ------------------------------------------------------

@pytest.mark.parametrize("gate_in_kernel", [True, False])
def test_fast_forward_equals_the_reference_on_every_layer(model, gate_in_kernel):
    ids, att = _batch()
    ref = _features(model, ids, att)  # [B, S, 8, H]
    n = ff.install(model, ff.torch_ops(), gate_in_kernel=gate_in_kernel)
    try:
        # 8 decoder layers, 6 GDN modules, 2 norms per layer + q/k norms of 2 attention layers + the final norm
        assert n == 8 + 6 + 16 + 4 + 1 and ff.installed(model) == n
        got = _features(model, ids, att)
    finally:
        assert ff.remove(model) == n
    valid = att.bool()
    assert got.shape == ref.shape
    for j in range(8):  # fp32: the chunked reference and the token recurrence differ in rounding only (~3e-6)
        assert _scaled_max_error(got[:, :, j][valid], ref[:, :, j][valid]) < 2e-5, j
    # the reference forward is back, bit for bit
    torch.testing.assert_close(_features(model, ids, att), ref, rtol=0, atol=0)


def test_a_wrong_layout_would_be_caught(model):
    """The check above can fail: a conv that reads [B, T, D] as [B, D, T] (the slot's layout) changes layer 0."""
    ids, att = _batch(seed=1, B=2, S=17, pad=(0, 4))
    ref = _features(model, ids, att, [0])
    ops = ff.torch_ops()
    conv = ops.causal_conv1d
    ops.causal_conv1d = lambda x, **kw: (conv(x.transpose(1, 2).reshape(x.shape), **kw)[0], None)
    ff.install(model, ops)
    try:
        got = _features(model, ids, att, [0])
    finally:
        ff.remove(model)
    assert _scaled_max_error(got[att.bool()], ref[att.bool()]) > 1e-2


# ---- calls with a cache: generation and speculative decoding (CPU, torch stand-ins) ----------------------------

LM_VOCAB = 512


def _tiny_lm(dtype: torch.dtype, num_hidden_layers: int):
    """A tiny random Qwen3_5 text model on the CPU (seed 0), built in code by the benches' builder."""
    sys.path.insert(0, str(ROOT))
    from bench.extract_bench import build_model

    torch.manual_seed(0)
    model, _ = build_model("qwen3_5", "tiny", device="cpu", dtype=dtype, vocab_size=LM_VOCAB,
                           hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                           initializer_range=0.2)
    return model


@pytest.fixture(scope="module")
def lm():
    """A tiny random Qwen3_5 text model built in code: 3 Gated DeltaNet layers then 1 gated attention layer,
    fp32, weights large enough that greedy outputs vary, non-zero zero-centred norm weights."""
    model = _tiny_lm(torch.float32, num_hidden_layers=4)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    _nonzero_norms(model)
    _long_memory(model)
    return model


def _nonzero_norms(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")):
                p.copy_(0.1 * torch.randn_like(p))


def _long_memory(model) -> None:
    """GDN decays of a trained model's order (per token exp(-A softplus(a + dt_bias)), A in [0.001, 0.02]: a state
    remembers tens to hundreds of tokens) instead of the random init's A up to 16, which forgets within a token or
    two, so that a cached state handled wrongly shows in the logits."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "Qwen3_5GatedDeltaNet":
                a = torch.empty(mod.A_log.shape).uniform_(0.001, 0.02, generator=g)
                mod.A_log.copy_(a.log().to(mod.A_log.dtype))


def _counting_ops(ops=None):
    """ops whose kernels record each call: (kernel, tokens T of its input, initial state given, final state asked)."""
    ops = ops or ff.torch_ops()
    calls = []

    def wrap(name, fn):
        def counted(*a, **kw):
            calls.append((name, a[0].shape[1] if a[0].dim() >= 3 else None, kw.get("initial_state") is not None,
                          bool(kw.get("output_final_state"))))
            return fn(*a, **kw)
        return counted

    for name in ("causal_conv1d", "chunk_gated_delta_rule", "swiglu", "rms_norm"):
        setattr(ops, name, wrap(name, getattr(ops, name)))
    return ops, calls


def _left_padded(seed=0, B=2, S=19, pad=(0, 6), vocab=LM_VOCAB):
    """A batch as the embedded engine makes one: prompts left-padded to one width."""
    ids = torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(seed))
    att = torch.ones_like(ids)
    for r, p in enumerate(pad):
        att[r, :p] = 0
    return ids, att


def _cache_kw(model) -> str:
    from pipeline.target_cache import _cache_kwarg

    return _cache_kwarg(model.forward)


def _states(cache) -> dict:
    """Every tensor a hybrid cache holds: conv and recurrent states of the linear layers, keys and values of the
    attention layers."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(getattr(layer, "conv_states", None), dict):
            out[f"{i}.conv"], out[f"{i}.recurrent"] = layer.conv_states[0], layer.recurrent_states[0]
        else:
            out[f"{i}.keys"], out[f"{i}.values"] = layer.keys, layer.values
    return out


@torch.no_grad()
def _cached_run(model, ids, att, steps):
    """Prefill with a fresh cache, then one forward per entry of `steps` (new tokens [B, t]: a decode token or a
    block), the mask growing; returns (the cache's tensors after the prefill, the logits of every forward, the
    cache's tensors at the end)."""
    from transformers import DynamicCache

    cache, kw = DynamicCache(config=model.config), _cache_kw(model)
    logits = [model(input_ids=ids, attention_mask=att, use_cache=True, **{kw: cache}).logits]
    after_prefill = {k: v.clone() for k, v in _states(cache).items()}
    for new in steps:
        att = torch.cat([att, torch.ones_like(new)], dim=1)
        logits.append(model(input_ids=new, attention_mask=att, use_cache=True, **{kw: cache}).logits)
    return after_prefill, logits, _states(cache)


@pytest.mark.parametrize("gate_in_kernel", [True, False])
def test_cache_after_the_prefill_and_the_next_steps_equal_the_reference(lm, gate_in_kernel):
    """A left-padded prefill with a cache, five decode steps, a 4-token block after the state (a verify forward)
    and two more steps: the cache (conv, recurrent, keys, values) after the prefill and at the end, and every
    forward's logits, are the reference's. The prefill and the block run the fused conv and delta rule (the block
    reading the cached states); a one-token step keeps transformers' per-step GDN update; every forward runs the
    fused norms and SwiGLU."""
    ids, att = _left_padded()
    g = torch.Generator().manual_seed(1)
    steps = [torch.randint(3, LM_VOCAB, (2, t), generator=g) for t in (1, 1, 1, 1, 1, 4, 1, 1)]
    ref_prefill, ref_logits, ref_end = _cached_run(lm, ids, att, steps)
    ops, calls = _counting_ops()
    ff.install(lm, ops, gate_in_kernel=gate_in_kernel)
    try:
        got_prefill, got_logits, got_end = _cached_run(lm, ids, att, steps)
    finally:
        ff.remove(lm)
    assert set(got_prefill) == set(ref_prefill) == {"0.conv", "0.recurrent", "1.conv", "1.recurrent", "2.conv",
                                                    "2.recurrent", "3.keys", "3.values"}
    for states_got, states_ref in ((got_prefill, ref_prefill), (got_end, ref_end)):
        for name, ref in states_ref.items():
            got = states_got[name]
            assert got.shape == ref.shape and got.dtype == ref.dtype, name
            assert _scaled_max_error(got, ref) < 2e-5, name  # fp32: the chunked reference vs the token recurrence
    valid = att.bool()
    assert _scaled_max_error(got_logits[0][valid], ref_logits[0][valid]) < 2e-5
    for j, (got, ref) in enumerate(zip(got_logits[1:], ref_logits[1:])):
        assert _scaled_max_error(got, ref) < 2e-5, j
    conv = [(t, init) for name, t, init, _ in calls if name == "causal_conv1d"]
    rule = [(t, init, final) for name, t, init, final in calls if name == "chunk_gated_delta_rule"]
    assert conv == [(19, False)] * 3 + [(4 + 4, False)] * 3  # the block: its 4 tokens after the 4 cached inputs
    assert rule == [(19, False, True)] * 3 + [(4, True, True)] * 3
    assert sum(name == "swiglu" for name, *_ in calls) == 4 * (1 + len(steps))


def test_the_embedded_engine_generates_the_same_with_the_fast_forward(lm):
    """regenerate's engine (generate_ids: left-padded batch, transformers' generate with its cache): the same
    token ids with the fast forward installed as without, and the logits of every step close."""
    from stages.regen_worker import generate_ids, neutral_generation_config

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, LM_VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    ids, att = torch.zeros(4, 30, dtype=torch.long), torch.zeros(4, 30, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, 30 - len(p):], att[r, 30 - len(p):] = torch.tensor(p), 1
    cfg = neutral_generation_config({LM_VOCAB - 1}, 0)
    cfg.max_new_tokens, cfg.output_logits, cfg.return_dict_in_generate = 12, True, True

    def run():
        with torch.inference_mode():
            out = lm.generate(input_ids=ids, attention_mask=att, generation_config=cfg)
        return generate_ids(lm, prompts, 12, {LM_VOCAB - 1}, 0), out.sequences, torch.stack(out.logits, 1)

    ref_rows, ref_seq, ref_logits = run()
    ops, calls = _counting_ops()
    ff.install(lm, ops)
    try:
        got_rows, got_seq, got_logits = run()
    finally:
        ff.remove(lm)
    assert got_rows == ref_rows and torch.equal(got_seq, ref_seq)
    assert len({tuple(t) for t, _ in ref_rows}) == 4  # the rows generate different tokens
    assert _scaled_max_error(got_logits, ref_logits) < 2e-5
    assert ("chunk_gated_delta_rule", 30, False, True) in calls  # the prefill with the cache ran on the fast GDN
    assert sum(name == "swiglu" for name, *_ in calls) >= 4 * 12  # and every decode step on the fast MLP


def _oracle(truth: list[int], P: int, bs: int):
    """A draft_fn proposing the true greedy continuation with one token wrong at a varying place, or none, so
    verify steps accept 0..bs-1 drafts and the cache rolls back by varying amounts."""
    state = {"step": 0}

    def draft(context, pos, last_id):
        j = pos - P  # index of the last verified token in the output
        want = (truth[j + 1: j + bs] + [3] * bs)[: bs - 1]
        k = (None, 0, 2, 1, 3)[state["step"] % 5]
        state["step"] += 1
        if k is not None:
            want[k] = (want[k] + 1) % LM_VOCAB
        return want

    draft.reset = lambda: state.update(step=0)
    return draft


def test_speculative_decoding_rolls_back_the_same_with_the_fast_forward(lm):
    """Online eval's decoders on the fast forward: the greedy baseline and speculative decoding (verify blocks,
    RollbackCache restoring the linear states and replaying the accepted tokens through the fast GDN) give the
    reference's tokens and the same accepted lengths per verify step."""
    from stages.speculate import TargetRunner, greedy_decode, speculative_decode

    prompt = torch.randint(3, LM_VOCAB, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    runner = TargetRunner(lm, "kv")
    assert runner.policy == "kv" and runner.kind == "hybrid"
    bs, n = 5, 30
    spec_kw = dict(layer_ids=[0, 2], block_size=bs, max_new_tokens=n, stop_ids=set(), feature_encoding=None)

    def run():
        greedy = greedy_decode(runner, prompt, n, set())
        spec = speculative_decode(runner, _oracle(truth, len(prompt), bs), prompt, **spec_kw)
        return greedy, spec

    truth = greedy_decode(runner, prompt, n, set()).tokens
    ref_greedy, ref_spec = run()
    ops, calls = _counting_ops()
    ff.install(lm, ops)
    try:
        got_greedy, got_spec = run()
        replays = runner._cache.replays
    finally:
        runner.reset()
        ff.remove(lm)
    assert ref_spec.tokens == ref_greedy.tokens == truth and len(set(truth)) > 5
    assert got_greedy.tokens == truth and got_spec.tokens == truth
    assert got_spec.steps == ref_spec.steps and set(ref_spec.steps) == set(range(1, bs + 1))  # 0..4 drafts kept
    assert replays > 0
    assert any(name == "chunk_gated_delta_rule" and init for name, _, init, _ in calls)  # blocks after a state


def test_which_cached_calls_the_fast_gdn_serves(lm):
    """A fresh cache: prefill; a cache with state: more than one token is a block, one token a decode step
    (transformers' per-step kernels); a cache recording its past for `crop` and a cache without transformers 5's
    linear-attention methods keep the reference."""
    from transformers import DynamicCache

    gdn = lm.model.layers[0].linear_attn
    cache = DynamicCache(config=lm.config)
    assert ff._cached_mode(gdn, cache, 7) == "prefill" and ff._cached_mode(gdn, cache, 1) == "prefill"
    with torch.no_grad():
        lm(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True, **{_cache_kw(lm): cache})
    assert ff._cached_mode(gdn, cache, 4) == "extend" and ff._cached_mode(gdn, cache, 1) is None
    cache.layers[0].activate_past_recording()
    assert ff._cached_mode(gdn, cache, 4) is None
    assert ff._cached_mode(gdn, SimpleNamespace(layers=[]), 4) is None


# ---- the same numbers on the GPU (flash-linear-attention) -----------------------------------------------------

def _rel_errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-token relative error ||got - ref|| / ||ref|| over the hidden dimension: its max and mean."""
    e = (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-12)
    return {"max": float(e.max()), "mean": float(e.mean())}


def _small_width_hybrid(device):
    """The real head counts (GDN 16 key / 48 value heads x 128, attention 24 / 4 heads x 256, conv 4) at hidden
    1024, 8 layers (both layer types twice), bf16, with non-zero zero-centred norm weights."""
    sys.path.insert(0, str(ROOT))
    from bench.extract_bench import build_model

    torch.manual_seed(0)
    model, _ = build_model("qwen3_5", "real", device=device, vocab_size=4096, hidden_size=1024,
                           intermediate_size=3072, num_hidden_layers=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.gpu
def test_fast_forward_equals_transformers_on_the_gpu_in_bf16():
    """Every tap layer's hidden states from the fast forward (fla kernels) against transformers' reference forward
    of the same bf16 model, on right-padded batches, for both ways of computing the GDN gates. Both are also
    measured against an fp32 forward of the same weights (the torch stand-ins, which the CPU tests hold equal to
    the reference; no new Triton compiles), which gives bf16's own rounding error as the yardstick. Writes the
    figures to $DFLASH_FASTFWD_REPORT (bench/device_run.sh fastfwd)."""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention (fla-core) not installed")
    dev = torch.device("cuda")
    model = _small_width_hybrid(dev)
    assert ff.choose(model, dev, True)[0]
    ids, att = _batch(seed=5, B=4, S=600, pad=(0, 133, 300, 501))
    ids, att = (ids % 4096).to(dev), att.to(dev)
    valid = att.bool()
    ref = _features(model, ids, att)
    model.float()
    ff.install(model, ff.torch_ops())
    try:
        truth = _features(model, ids, att)
    finally:
        ff.remove(model)
        model.to(torch.bfloat16)
    report = {"shape": "hidden 1024, 8 layers, GDN 16/48 x 128, attention 24/4 x 256, bf16",
              "tokens": int(valid.sum()), "error": "per-token ||a - b|| / ||b|| over the hidden size: max, mean",
              "variants": {}}
    for gate_in_kernel in (True, False):
        ff.install(model, ff.fla_ops(), gate_in_kernel=gate_in_kernel)
        try:
            got = _features(model, ids, att)
        finally:
            ff.remove(model)
        report["variants"]["gate_in_kernel" if gate_in_kernel else "gates_in_torch"] = {
            j: {"fast_vs_bf16_reference": _rel_errors(got[:, :, j][valid], ref[:, :, j][valid]),
                "fast_vs_fp32": _rel_errors(got[:, :, j][valid], truth[:, :, j][valid]),
                "reference_vs_fp32": _rel_errors(ref[:, :, j][valid], truth[:, :, j][valid])}
            for j in range(got.shape[2])}
    print(json.dumps(report, indent=1))
    if os.environ.get("DFLASH_FASTFWD_REPORT"):
        Path(os.environ["DFLASH_FASTFWD_REPORT"]).write_text(json.dumps(report, indent=1))
    for variant, rows in report["variants"].items():
        for j, row in rows.items():
            fast, floor = row["fast_vs_fp32"], row["reference_vs_fp32"]
            # the yardstick is bf16 rounding (a few % per token after 8 random layers), not a wrong forward (~1)
            assert floor["mean"] < 0.1, (j, row)
            assert fast["mean"] <= 1.5 * floor["mean"] + 2e-3, (variant, j, row)  # no worse than bf16's own error
            assert fast["max"] <= 2 * floor["max"] + 1e-2, (variant, j, row)
            assert row["fast_vs_bf16_reference"]["mean"] <= 2 * floor["mean"] + 2e-3, (variant, j, row)


@torch.no_grad()
def _greedy_cached(model, ids, att, n, forced=None):
    """Greedy decoding with a cache as generate does it (the prefill, then one token per forward): (tokens [B, n],
    each step's logits [B, n, V] fp32, the cache's tensors after the prefill in fp32); with `forced` [B, n] those
    tokens are fed instead of the argmax (teacher forcing)."""
    from transformers import DynamicCache

    cache, kw = DynamicCache(config=model.config), _cache_kw(model)
    out = model(input_ids=ids, attention_mask=att, use_cache=True, **{kw: cache})
    states = {k: v.float().clone() for k, v in _states(cache).items()}
    toks, logits = [], []
    for t in range(n):
        logits.append(out.logits[:, -1].float())
        toks.append(logits[-1].argmax(-1) if forced is None else forced[:, t])
        if t + 1 < n:
            att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
            out = model(input_ids=toks[-1][:, None], attention_mask=att, use_cache=True, **{kw: cache})
    return (torch.stack(toks, 1), torch.stack(logits, 1), states) if n else (None, None, states)


@torch.no_grad()
def _rollback_run(model, prompt: list[int], plan: list):
    """Speculative decoding's cache traffic on one sequence (pipeline/target_cache.py RollbackCache): the prompt,
    then per (block, keep) a verify forward of the block and, unless keep is None, a rollback to `keep` tokens.
    Returns (each forward's logits [T, V] fp32, the tokens each forward's sequence held, the tokens kept at the end,
    the cache's tensors at the end in fp32); the yardstick reruns the sequences without a cache, and prefills the
    kept tokens for the states (the cache after rollbacks must equal a prefill of exactly the kept tokens)."""
    from pipeline.target_cache import RollbackCache

    dev = next(model.parameters()).device
    rc = RollbackCache(model)
    try:
        seq, seen = list(prompt), [list(prompt)]
        logits = [rc.forward(torch.tensor([prompt], device=dev)).logits[0].float()]
        for block, keep in plan:
            seen.append(seq + block)
            logits.append(rc.forward(torch.tensor([block], device=dev)).logits[0].float())
            seq = seq + block
            if keep is not None:
                rc.rollback(keep)
                seq = seq[:keep]
        states = {k: v.float().clone() for k, v in _states(rc.cache).items()}
    finally:
        rc.close()
    return logits, seen, seq, states


def _cached_against_reference(model, ops, vocab: int, S: int, n: int, pad: int, P: int) -> dict:
    """The GPU test's check, for any device and kernels: a bf16 `model`'s cached forwards with the fast forward
    on `ops` against transformers' cached forward, both measured against an fp32 forward of the same weights
    (the torch stand-ins, which the CPU tests hold equal to the reference; cache-less for the logits), so that
    bf16's own error is the yardstick, with the constants of the uncached test above. Checked: the linear-
    attention states after a left-padded prefill (2 rows of S tokens, `pad` of them padding), the logits of n
    decode steps teacher-forced on the reference's greedy tokens, the logits of a speculative sequence's verify
    blocks (a P-token prompt, rollbacks keeping 5, 3 and 1 of 8 tokens in between); free-running greedy tokens
    equal the reference's or first differ where the reference's own top-two margin is within its bf16 error. The
    linear-attention states are checked after the prefill and at the end of the speculative sequence (against a
    prefill of its kept tokens). Returns the figures."""
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(6)
    B = 2
    ids = torch.randint(4, vocab, (B, S), generator=g).to(dev)
    att = torch.ones_like(ids)
    att[1, :pad] = 0  # left padding, as the embedded engine batches prompts
    prompt = torch.randint(4, vocab, (P,), generator=g).tolist()
    blocks = [torch.randint(4, vocab, (t,), generator=g).tolist() for t in (8, 8, 1, 8, 8)]
    plan = list(zip(blocks, [P + 5, P + 8, None, P + 10, None]))  # 5 of 8 kept, 3 of 8, a step, 1 of 8, a block

    ref_tok, ref_logits, ref_states = _greedy_cached(model, ids, att, n)
    ref_spec, seen, kept, ref_spec_states = _rollback_run(model, prompt, plan)
    ops, calls = _counting_ops(ops)
    ff.install(model, ops)
    try:
        fast_tok, _, fast_states = _greedy_cached(model, ids, att, n)
        _, fast_logits, _ = _greedy_cached(model, ids, att, n, forced=ref_tok)
        fast_spec, _, _, fast_spec_states = _rollback_run(model, prompt, plan)
    finally:
        ff.remove(model)
    assert any(c[0] == "chunk_gated_delta_rule" and c[3] and not c[2] for c in calls)  # the prefill, fast
    assert any(c[0] == "chunk_gated_delta_rule" and c[2] for c in calls)  # blocks after a state, fast
    model.float()
    ff.install(model, ff.torch_ops())
    try:
        full = torch.cat([ids, ref_tok[:, :-1]], dim=1)
        mask = torch.cat([att, torch.ones_like(ref_tok[:, :-1])], dim=1)
        with torch.no_grad():
            truth = model(input_ids=full, attention_mask=mask, use_cache=False).logits[:, S - 1:].float()  # [B, n, V]
            truth_spec = [model(input_ids=torch.tensor([s], device=dev), use_cache=False).logits[0, -len(f):].float()
                          for s, f in zip(seen, ref_spec)]
        _, _, truth_states = _greedy_cached(model, ids, att, 0)  # the fast prefill on the stand-ins (CPU-tested)
        kept = torch.tensor([kept], device=dev)
        _, _, truth_spec_states = _greedy_cached(model, kept, torch.ones_like(kept), 0)
    finally:
        ff.remove(model)
        model.to(torch.bfloat16)

    report = {"error": "||a - b|| / ||b|| per token over the vocabulary (per row over a state): max, mean"}
    checks = {"decode_logits": (fast_logits, ref_logits, truth),
              "verify_logits": (torch.cat(fast_spec), torch.cat(ref_spec), torch.cat(truth_spec))}
    for name, (fast, ref, tru) in checks.items():
        row = report[name] = {"fast_vs_fp32": _rel_errors(fast, tru), "reference_vs_fp32": _rel_errors(ref, tru),
                              "fast_vs_bf16_reference": _rel_errors(fast, ref)}
        floor = row["reference_vs_fp32"]
        assert floor["mean"] < 0.1, (name, row)  # bf16 rounding (a few %), not a wrong forward (~1)
        assert row["fast_vs_fp32"]["mean"] <= 1.5 * floor["mean"] + 2e-3, (name, row)
        assert row["fast_vs_fp32"]["max"] <= 2 * floor["max"] + 1e-2, (name, row)
        assert row["fast_vs_bf16_reference"]["mean"] <= 2 * floor["mean"] + 2e-3, (name, row)
    linear = [k for k in truth_states if k.endswith((".conv", ".recurrent"))]
    assert len(linear) == 2 * model.config.layer_types.count("linear_attention")
    for where, got, want, tru in (("prefill", fast_states, ref_states, truth_states),
                                  ("speculative", fast_spec_states, ref_spec_states, truth_spec_states)):
        for k in linear:
            rows = tru[k].shape[0]
            fast, ref = (_rel_errors(st[k].reshape(rows, -1), tru[k].reshape(rows, -1)) for st in (got, want))
            report[f"{where} state {k}"] = {"fast_vs_fp32": fast, "reference_vs_fp32": ref}
            assert fast["max"] <= 2 * ref["max"] + 1e-2, (where, k, fast, ref)
    for r in range(B):
        diff = (fast_tok[r] != ref_tok[r]).nonzero()
        if len(diff):
            i = int(diff[0])
            a, b = int(ref_tok[r, i]), int(fast_tok[r, i])
            margin = float(ref_logits[r, i, a] - ref_logits[r, i, b])
            noise = float((ref_logits[r, i] - truth[r, i]).abs().max())
            report[f"row {r} first difference"] = {"step": i, "reference_margin": margin, "reference_error": noise}
            assert margin <= 2 * noise, (r, i, margin, noise)
    return report


def test_cached_check_of_the_gpu_test_runs_on_the_cpu_in_bf16():
    """The GPU test's check end to end on the CPU (bf16, the torch stand-ins as the kernels, a tiny model)."""
    model = _tiny_lm(torch.bfloat16, num_hidden_layers=8)
    _nonzero_norms(model)
    _long_memory(model)
    report = _cached_against_reference(model, ff.torch_ops(), LM_VOCAB, S=40, n=12, pad=9, P=30)
    assert report["decode_logits"]["reference_vs_fp32"]["mean"] > 0  # bf16 really rounds: the yardstick is not 0


@pytest.mark.gpu
def test_cached_fast_forward_equals_transformers_on_the_gpu_in_bf16():
    """Generation and speculative decoding with a cache on the fla kernels (bf16) against transformers' cached
    forward of the same model (`_cached_against_reference`: the states after a left-padded 2 x 300-token
    prefill, 24 decode steps, verify blocks around rollbacks after a 200-token prompt). Prints the figures."""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention (fla-core) not installed")
    dev = torch.device("cuda")
    model = _small_width_hybrid(dev)
    _long_memory(model)
    assert ff.choose(model, dev, True, key="eval.fast_forward")[0]
    report = _cached_against_reference(model, ff.fla_ops(), 4096, S=300, n=24, pad=87, P=200)
    report["shape"] = "hidden 1024, 8 layers, GDN 16/48 x 128, attention 24/4 x 256, bf16"
    print(json.dumps(report, indent=1))
