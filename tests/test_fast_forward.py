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


def test_extract_config_has_the_switch(tmp_path):
    from pipeline.config import ConfigError, load_config

    assert load_config(None, []).extract.fast_forward is True
    assert load_config(None, ["extract.fast_forward=false"]).extract.fast_forward is False
    with pytest.raises(ConfigError, match="fast_forward"):
        load_config(None, ["extract.fast_forward=sometimes"])


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
    assert set(x["extraction"]["encodings"]) == {"int5"} and x["extraction"]["encodings"]["int5"]["ratio_vs_bare"] > 0
    assert abs(sum(x["fast"]["profile"]["families"].values()) - 1) < 1e-6
    assert "kernel family" in r.stdout and "extraction (32 tokens)" in r.stdout


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


def test_calls_with_a_cache_take_the_reference_forward(model):
    """Generation and speculative decoding pass a cache: the layers and GDN modules run transformers' own code
    (the fused conv and delta rule are never called), and the logits are the reference's."""
    ids = torch.randint(4, 500, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True).logits

    def boom(*a, **kw):
        raise AssertionError("fused kernel called with a cache")

    ops = ff.torch_ops()
    ops.causal_conv1d = ops.chunk_gated_delta_rule = ops.swiglu = boom
    ff.install(model, ops)
    try:
        with torch.no_grad():
            got = model(input_ids=ids, use_cache=True).logits
    finally:
        ff.remove(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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
