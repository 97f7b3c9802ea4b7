"""The activation quantization of block-FP8 capture as one Triton kernel (issue 45 item 3).

`pipeline/fp8_block.quantize_act` in plain torch, compiled by Inductor, ran as two kernels (an amax reduction,
then the scale-and-cast pass) and took 22.6% of the 27B hybrid's block-FP8 forward on an H200 (2026-12-04), about
6x the time of reading each input once. Here one program reads a [BLOCK_M, 128] tile of x once, takes each row's
amax, writes the FP8 tile and the row scales: one pass over x, as vLLM's `_per_token_group_quant_fp8` does
(vllm/model_executor/layers/quantization/utils/fp8_utils.py; SGLang's fp8_kernel.py, from which it is adapted).

Contract: `quantize(x)` with x [M, K] (K a multiple of 128, any float dtype, rows of unit stride) on CUDA returns
exactly `fp8_block.quantize_act(x)`, bit for bit (tested on the GPU; `pad_rows` adds zero rows after them):
s = max(amax |x| in fp32, 1e-10) / 448 and x / s with IEEE division (`div_rn`: Triton's plain `/` is an
approximate division), clamped to +-448 and cast to float8_e4m3fn rounding to nearest even; the scales float32
[M, K/128] stored outer-dim-major (stride (1, M); a single row row-major), the layouts `torch._scaled_mm` takes.
Triton is imported by this module (and pipeline/int_encode_kernel.py) alone, and only where the caller runs on
CUDA (the CPU keeps `quantize_act`); `TRITON_INTERPRET=1` runs the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128  # pipeline/fp8_block.GROUP
FP8_MAX = 448.0  # pipeline/fp8_weights.FP8_MAX
EPS = 1e-10  # pipeline/fp8_block.EPS
BLOCK_M = 32  # rows per program: a 32 x 128 tile, 8 KB of bf16 read once


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, M_PAD, K, stride_xm,
                     BLOCK_M: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    g = tl.program_id(1)  # the 128-channel group
    cols = g * GROUP + tl.arange(0, GROUP)  # [GROUP]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=(rows < M)[:, None],
                other=0.0).to(tl.float32)  # [BLOCK_M, GROUP]; the padding rows read as zeros
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_M]
    s = tl.math.div_rn(tl.maximum(amax, EPS), FP8_MAX)  # [BLOCK_M] fp32
    y = tl.math.div_rn(x, s[:, None])
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    kept = rows < M_PAD
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], y.to(q_ptr.dtype.element_ty),
             mask=kept[:, None])
    tl.store(s_ptr + g.to(tl.int64) * M_PAD + rows, s, mask=kept)  # scale [m, g] at g * M_PAD + m: outer-dim-major


def quantize(x: torch.Tensor, pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M', K] float8_e4m3fn, sx [M', K/128] fp32 with stride (1, M')), in one kernel, where M' is M
    rounded up to a multiple of `pad_rows` (the rows past M: zeros, with the floor's scale); with pad_rows 1 a
    single row's scales are row-major, as quantize_act's."""
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"the activation's last dimension ({k}) is not a multiple of {GROUP}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m_pad = -(-m // pad_rows) * pad_rows
    x8 = torch.empty(m_pad, k, dtype=torch.float8_e4m3fn, device=x.device)
    sx = (torch.empty(k // GROUP, m_pad, dtype=torch.float32, device=x.device).t() if m_pad > 1 else
          torch.empty(1, k // GROUP, dtype=torch.float32, device=x.device))  # [M', G]
    if m_pad:
        grid = (triton.cdiv(m_pad, BLOCK_M), k // GROUP)
        _quantize_kernel[grid](x, x8, sx, m, m_pad, k, x.stride(0), BLOCK_M=BLOCK_M, GROUP=GROUP, FP8_MAX=FP8_MAX,
                               EPS=EPS)
    return x8, sx
