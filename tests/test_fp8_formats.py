"""The FP8 loader reads every float8 format it can meet and refuses what it cannot dequantize, by tensor name
(issue 40 item 2; pipeline/fp8_weights.py): e5m2 (and the fnuz variants torch has) dequantized with its scale,
checked against a plain per-block reference; unknown `fmt`, bad block sizes, NaN/inf/zero/negative scales,
scale shapes that do not fit, 1-D FP8 tensors and non-weight float8 dtypes refused in one line. An extraction
whose shard commits no sample fails instead of leaving a "complete" empty store."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers_cli import TINY, dflash
from pipeline.checkpoint import load_text_model, weight_files
from pipeline.config import load_config
from pipeline.errors import CheckpointError
from pipeline.fp8_weights import FP8_DTYPES, FORMATS, dequantize, quantization, quantize, scale_key

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.fp8_features import write_fp8_checkpoint  # noqa: E402

TINY_TARGET = Path(load_config(TINY).target.path)
E5M2 = torch.float8_e5m2
CPU = torch.device("cpu")


def _reference(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Dequantization by hand: each block's float8 values times that block's scale, one block at a time."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].to(torch.float32) * float(s[i, j])
    return out


def test_every_float8_format_torch_has_is_known():
    assert torch.float8_e4m3fn in FORMATS["e4m3"] and E5M2 in FORMATS["e5m2"]
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz"):
        if hasattr(torch, name):
            assert getattr(torch, name) in FP8_DTYPES


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_each_format_dequantizes_with_its_scale_like_a_plain_reference(dtype):
    w = torch.randn(70, 45, generator=torch.Generator().manual_seed(1)) * 3
    q, s = quantize(w, (32, 16), dtype=dtype)
    assert q.dtype == dtype and s.shape == (3, 3)
    got = dequantize(q, s, (32, 16), "w")
    assert torch.equal(got, _reference(q, s, (32, 16)))
    assert float((got - w).norm() / w.norm()) < 0.15  # the real weight (2-3 mantissa bits), not the raw bytes
    assert float((q.float() - w).norm() / w.norm()) > 0.5


@pytest.fixture(scope="module")
def e5m2_ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fp8") / "e5m2"
    assert write_fp8_checkpoint(TINY_TARGET, d, dtype=E5M2) > 0
    return d


def test_an_e5m2_checkpoint_loads_as_its_real_weights(e5m2_ckpt):
    assert json.loads((e5m2_ckpt / "config.json").read_text())["quantization_config"]["fmt"] == "e5m2"
    got = load_text_model(e5m2_ckpt, torch.float32, CPU)
    checked = 0
    for f in weight_files(e5m2_ckpt):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                if t.dtype != E5M2:
                    continue
                real = _reference(t, fh.get_tensor(scale_key(k)), (128, 128))
                assert torch.equal(got.get_parameter(k), real), k  # with its scale, not the raw bytes cast
                checked += 1
    assert checked > 0


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_the_loader_refuses_a_nan_scale_naming_the_checkpoint_and_tensor(e5m2_ckpt, tmp_path):
    bad = tmp_path / "c"
    shutil.copytree(e5m2_ckpt, bad)
    (f,) = weight_files(bad)
    with safe_open(str(f), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    key = next(k for k in sorted(tensors) if tensors[k].dtype == E5M2)
    tensors[scale_key(key)].view(-1)[0] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_text_model(bad, torch.float32, CPU)
    assert _one_line(e).startswith(f"{bad}: {key}: 1 of its "), str(e.value)
    assert "block scale(s) are NaN, infinite, zero or negative (block [0, 0]: nan)" in str(e.value)


def _fp8(shape=(70, 45), block=(32, 16)):
    return quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(2)), block, dtype=E5M2)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 0.0, -0.5])
def test_a_bad_scale_is_refused_naming_the_tensor(value):
    q, s = _fp8()
    s[1, 2] = value
    with pytest.raises(CheckpointError) as e:
        dequantize(q, s, (32, 16), "ckpt: layers.3.mlp.up_proj.weight")
    assert _one_line(e).startswith("ckpt: layers.3.mlp.up_proj.weight: 1 of its 9 block scale(s) are NaN, infinite, "
                                   f"zero or negative (block [1, 2]: {value})")


@pytest.mark.parametrize("shape", [(2, 3), (3, 2), (9,), (3, 3, 1)])
def test_a_scale_of_the_wrong_shape_is_refused_naming_the_tensor(shape):
    q, _ = _fp8()
    with pytest.raises(CheckpointError) as e:
        dequantize(q, torch.ones(shape), (32, 16), "w.weight")
    assert _one_line(e).startswith(f"w.weight: its scale has shape {list(shape)}, not [3, 3] for blocks of [32, 16]")


def test_a_scale_that_is_no_float_is_refused():
    q, _ = _fp8()
    with pytest.raises(CheckpointError, match=r"^w: its scale is stored as torch.int32, not a float"):
        dequantize(q, torch.ones(3, 3, dtype=torch.int32), (32, 16), "w")


def test_a_one_dimensional_fp8_tensor_is_refused_naming_it():
    with pytest.raises(CheckpointError) as e:
        dequantize(torch.zeros(8).to(E5M2), torch.ones(1), (128, 128), "v.weight")
    assert _one_line(e).startswith("v.weight is an FP8 tensor of shape [8]: block-wise FP8 weights are 2-D [out, in]")


@pytest.mark.parametrize("block", [0, (0, 16), (32, "16"), "128", (True, 16), (32,)])
def test_a_bad_block_size_is_refused_naming_the_tensor(block):
    q, s = _fp8()
    with pytest.raises(CheckpointError) as e:
        dequantize(q, s, block, "w.weight")
    assert _one_line(e).startswith("w.weight: weight_block_size = ")
    assert "must be two positive integers such as [128, 128]" in str(e.value)


def test_a_float8_dtype_that_is_no_weight_format_is_refused():
    with pytest.raises(CheckpointError, match=r"^x is stored as torch.float8_e8m0fnu, which is no FP8 weight format"):
        dequantize(torch.ones(4, 4).to(torch.float8_e8m0fnu), torch.ones(1, 1), (128, 128), "x")


@pytest.mark.parametrize("q, says", [
    ({"fmt": "e3m4"}, "fmt = 'e3m4' is not a float8 format dflash reads (e4m3, e5m2)"),
    ({"weight_block_size": [0, 128]}, "weight_block_size = [0, 128] must be two positive integers"),
    ({"weight_block_size": ["128", "128"]}, "weight_block_size = ['128', '128'] must be two positive integers"),
    ({"weight_block_size": "128"}, "weight_block_size = '128' must be two positive integers"),
    ({"weight_block_size": [128]}, "weight_block_size = [128] must be two positive integers"),
])
def test_what_the_config_says_is_checked_before_any_tensor(tmp_path, q, says):
    cfg = json.loads((TINY_TARGET / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], **q}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        quantization(tmp_path)
    assert f"{tmp_path / 'config.json'} quantization_config: {says}" in _one_line(e)


@pytest.mark.slow  # a `dflash extract` subprocess on the tiny target (~10 s on 2 busy cores)
def test_an_extraction_that_commits_no_sample_fails_and_is_not_complete(tmp_path):
    broken = tmp_path / "nan-target"
    shutil.copytree(TINY_TARGET, broken)
    (f,) = weight_files(broken)
    with safe_open(str(f), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    key = next(k for k in sorted(tensors) if ".layers.0." in k and k.endswith("q_proj.weight"))
    tensors[key] = torch.full_like(tensors[key], float("nan"))  # every hidden state past layer 0 is NaN
    save_file(tensors, str(f), metadata={"format": "pt"})
    store = tmp_path / "store.zarr"
    r = dflash("extract", "--config", TINY, "--shards", "1", "--store", str(store), "--set",
               f"target.path={broken}", "--set", "data.max_samples=6", check=False)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "none of its 6 sample(s) was written (6 had NaN/Inf features)" in r.stderr, r.stderr[-3000:]
    assert "is complete" not in r.stderr
    from pipeline import store as st

    (shard,) = st.read_all_progress(str(store))
    assert not shard.done and shard.progress.committed_samples == 0


@pytest.mark.slow  # a `dflash extract` subprocess on the tiny target (~10 s on 2 busy cores)
def test_extraction_from_an_fp8_target_with_a_nan_scale_fails_naming_the_tensor(e5m2_ckpt, tmp_path):
    bad = tmp_path / "nan-scale"
    shutil.copytree(e5m2_ckpt, bad)
    (f,) = weight_files(bad)
    with safe_open(str(f), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    key = next(k for k in sorted(tensors) if tensors[k].dtype == E5M2)
    tensors[scale_key(key)].view(-1)[0] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    store = tmp_path / "store.zarr"
    r = dflash("extract", "--config", TINY, "--shards", "1", "--store", str(store), "--set", f"target.path={bad}",
               "--set", "data.max_samples=6", check=False)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"{key}: 1 of its" in r.stderr and "NaN, infinite, zero or negative" in r.stderr, r.stderr[-3000:]
    assert "is complete" not in r.stderr
