"""bench/fp8_gemm.py, the FP8-GEMM half of issue 30 item 4: row-scaled quantization, FP8Linear against the
linear it replaces, which linears `convert` takes, and (GPU) `torch._scaled_mm`'s result against the same
quantized values multiplied in fp32 (a wrong operand layout or scale shape would show there first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.fp8_gemm import E4M3_MAX, FP8Linear, convert, feature_error, quantize_rows, tap_outputs  # noqa: E402


def test_quantize_rows_keeps_each_rows_scale_and_fp8_precision():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None]
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1) and s.dtype == torch.float32
    assert torch.allclose(q.float().abs().amax(-1), torch.full((64,), E4M3_MAX))  # each row uses the full range
    back = q.float() * s
    rel = ((back - x).norm(dim=-1) / x.norm(dim=-1))
    assert rel.max() < 0.05 and rel.min() > 0  # e4m3's 3 mantissa bits: a few percent, at every row's scale


def test_fp8_linear_is_the_linear_within_fp8_error_and_convert_takes_only_aligned_linears():
    g = torch.Generator().manual_seed(1)
    block = nn.Sequential(nn.Linear(64, 128, bias=True), nn.SiLU(), nn.Linear(128, 48, bias=False), nn.Linear(48, 10))
    for p in block.parameters():
        nn.init.normal_(p, std=0.1, generator=g)
    x = torch.randn(3, 7, 64, generator=g)
    ref = block(x)
    fp8 = FP8Linear(block[0])
    y = fp8(x)
    assert y.shape == (3, 7, 128) and fp8.w8.dtype == torch.float8_e4m3fn and fp8.sw.shape == (1, 128)
    rel = ((y - block[0](x)).norm() / block[0](x).norm()).item()
    assert 0 < rel < 0.08
    assert convert(block) == 2  # 64x128 and 128x48; 48x10 is not a multiple of 16 and stays
    assert [type(m).__name__ for m in block] == ["FP8Linear", "SiLU", "FP8Linear", "Linear"]
    layers = nn.ModuleList([block])
    taps = tap_outputs(layers, [0], lambda: layers[0](x))
    err = feature_error({0: ref.detach()}, taps)["0"]
    assert taps[0].shape == (3, 7, 10) and 0.99 < err["cosine"] < 1 and 0 < err["rel_err"] < 0.1


@pytest.mark.gpu
def test_scaled_mm_on_the_gpu_equals_the_quantized_product_in_fp32():
    g = torch.Generator(device="cuda").manual_seed(0)
    lin = nn.Linear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16)
    nn.init.normal_(lin.weight, std=0.05, generator=g)
    x = torch.randn(4, 50, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    fp8 = FP8Linear(lin)
    y = fp8(x)  # torch._scaled_mm
    q, s = quantize_rows(x.reshape(-1, 256))
    want = (q.float() * s) @ (fp8.w8.float() * fp8.sw.t()).t()
    assert y.dtype == torch.bfloat16 and y.shape == (4, 50, 384)
    assert ((y.float().reshape(-1, 384) - want).norm() / want.norm()).item() < 0.01  # bf16 output rounding only
    assert ((y.float() - lin(x).float()).norm() / lin(x).float().norm()).item() < 0.08
