"""Block-wise FP8 checkpoints (pipeline/fp8_weights.py, the format of Qwen's FP8 releases): dflash's loader
gives the real weights, not the FP8 bytes cast without their scales (a silently wrong target before), and
refuses what it cannot read. The per-layer feature difference is bench/fp8_features.py's (docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import CheckpointError, load_text_model, read_frozen_head
from pipeline.config import load_config
from pipeline.fp8_weights import FP8, dequantize, quantize, scale_key

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.fp8_features import write_fp8_checkpoint  # noqa: E402

TINY = load_config(str(ROOT / "configs" / "tiny.yaml")).target.path


@pytest.mark.parametrize("shape", [(256, 128), (200, 130), (7, 300)])
def test_quantize_then_dequantize_is_the_weight_within_fp8_rounding(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, shape[1])
    q, s = quantize(w)
    assert q.dtype == FP8 and q.shape == w.shape and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize(q, s, (128, 128))
    rel = ((back - w).abs() / w.abs().clamp_min(1e-30))[w.abs() > s.max() * 2 ** -6]  # normal range of e4m3
    assert float(rel.max()) <= 2 ** -4 + 1e-6  # 3 mantissa bits: half an ulp is at most 1/16 of the value
    assert float((back - w).norm() / w.norm()) < 0.05


def test_an_fp8_checkpoint_loads_as_its_real_weights(tmp_path):
    fp8 = tmp_path / "fp8"
    n = write_fp8_checkpoint(Path(TINY), fp8)
    assert n > 0
    ref = load_text_model(Path(TINY), torch.float32, torch.device("cpu"))
    got = load_text_model(fp8, torch.float32, torch.device("cpu"))
    from safetensors import safe_open

    from pipeline.checkpoint import weight_files

    checked = 0
    for f in weight_files(fp8):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                if t.dtype != FP8:
                    continue
                real = dequantize(t, fh.get_tensor(scale_key(k)), (128, 128))
                param = got.get_parameter(k)
                assert torch.equal(param, real), k  # exactly the dequantized weight
                orig = ref.get_parameter(k)
                assert float((param - orig).norm() / orig.norm()) < 0.05, k  # and close to the bf16 one
                naive = t.float()  # what a loader without the scales made of it
                assert float((naive - orig).norm() / orig.norm()) > 0.5, k  # (so this test can tell them apart)
                checked += 1
    assert checked == n
    head = read_frozen_head(fp8, torch.float32)
    assert torch.equal(head["embed_tokens.weight"], read_frozen_head(Path(TINY), torch.float32)["embed_tokens.weight"])


def test_what_dflash_cannot_read_is_refused_by_name(tmp_path):
    fp8 = tmp_path / "fp8"
    write_fp8_checkpoint(Path(TINY), fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="quantized with 'awq'"):
        load_text_model(fp8, torch.float32, torch.device("cpu"))
    del cfg["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(cfg))  # FP8 tensors, but no quantization_config
    with pytest.raises(CheckpointError, match="stored in FP8 without a quantization_config"):
        load_text_model(fp8, torch.float32, torch.device("cpu"))


@pytest.mark.slow
def test_the_feature_difference_study_runs_and_reports_every_tap_layer(tmp_path):
    import subprocess

    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, "bench/fp8_features.py", "--tiny", "--root", str(tmp_path / "r"), "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res) == {"tiny replica", "random hybrid (tiny width)"}
    for r in res.values():
        assert r["fp8_tensors"] > 0 and len(r["per_layer"]) == len(r["layer_ids"])
        for x in r["per_layer"].values():
            assert 0.9 < x["cos_mean"] <= 1.0 and 0 < x["rel_mean"] < 0.5  # FP8 rounding: close, never equal
