"""The intN feature encode of pipeline/encoding.py as one Triton kernel (issue 45 item 3).

`encoding._encode_int` in plain torch ran as ~20 small kernels on an H100 (topk 6.7 ms, group amax 4.3 ms, abs
2.2 ms for 16,384 tokens x 5 layers x 5120, where reading x once takes ~0.25 ms) and held block-FP8 extraction at
0.944 of the bare forward. Here one program reads one row (a token's layer: H channels) once, as a [G_PAD, 4, 8]
tile (G = H/32 groups padded to a power of two, 4 bytes of 8 channels each), and writes that row's three parts.

Contract: `encode(x, n)` with x [..., L, H] on CUDA (any float dtype, any strides; H a multiple of 32, at most 65536;
n bits, 1 to 8) returns (features uint8 [..., L, n*H/8], scales float16 [..., L, H/32], outliers int32 [..., L, 4])
equal, bit for bit, to `encoding._encode_int_at(xf, top, n)` run on the CPU (tested on the GPU; on CUDA torch's
`amax / qmax` multiplies by the reciprocal, which can differ in the last bit), where xf is x as bf16 then float32
and top the channels of the 4 largest |xf|, largest first and, among equal magnitudes, the lowest channel first
(torch.topk leaves that order unspecified). That is: the outliers kept as (channel << 16) | bf16 bits and zeroed;
per group of 32 channels s = amax |x| / qmax with IEEE division (`div_rn`: Triton's plain `/` is an approximate
division), clamped to [2^-24, 65504] and rounded to float16 (to nearest even); codes round(x / s) to nearest even,
clamped to +-qmax, plus qmax; plane b's byte j holds bit b of the codes of channels 8j..8j+7 (channel 8j+k at bit k).
Triton is imported by this module (and pipeline/fp8_act_kernel.py) alone, and only where the caller runs on CUDA
(the CPU keeps the torch path); `TRITON_INTERPRET=1` runs the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32  # channels per scale: pipeline/encoding.GROUP
OUTLIERS = 4  # exact values per row: pipeline/encoding.OUTLIERS
FP16_TINY, FP16_MAX = 2.0**-24, 65504.0  # the scales' clamp: pipeline/encoding._FP16_TINY, _FP16_MAX


@triton.jit
def _top_channels(bits, chan, real, K: tl.constexpr):
    """bits, chan, real [G_PAD, 4, 8] (bf16 bit patterns as int32, channel, not padding) -> (top [K] int32: the
    channels of the K largest |x|, largest first, the lowest channel first among equal magnitudes; taken [G_PAD, 4, 8]).
    One max per round over a key that orders by |x| then by channel, lowest first: (|x|'s bf16 bits << 16) |
    (0xFFFF - channel), since the bits of a non-negative float order as its value does."""
    key = tl.where(real, ((bits & 0x7FFF) << 16) | (0xFFFF - chan), -1)  # [G_PAD, 4, 8] int32, >= 0 but padding
    slot = tl.arange(0, K)
    top = tl.zeros([K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(key)  # the whole tile
        top = tl.where(slot == k, 0xFFFF - (best & 0xFFFF), top)
        key = tl.where(key == best, -1, key)
    return top, (key < 0) & real


@triton.jit
def _round_half_even(y, QMAX: tl.constexpr):
    """y [...] fp32 -> round(y) to nearest even, clamped to +-QMAX (fp32). Exact: a = min(|y|, QMAX + 1) keeps the
    clamped result, and a - floor(a) is exact (a < 1, or floor(a) >= a / 2)."""
    a = tl.minimum(tl.abs(y), QMAX + 1.0)
    r = tl.floor(a)
    f = a - r
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.minimum(tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r), QMAX)
    return tl.where(y < 0, -r, r)


@triton.jit
def _encode_kernel(x_ptr, f_ptr, s_ptr, o_ptr, B, stride_a, stride_b,
                   H: tl.constexpr, N: tl.constexpr, QMAX: tl.constexpr, G_PAD: tl.constexpr, K: tl.constexpr,
                   TINY: tl.constexpr, BIG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row = a * B + b of x viewed as [A, B, H]
    x_row = x_ptr + (row // B) * stride_a + (row % B) * stride_b
    G = H // 32
    grp = tl.arange(0, G_PAD)[:, None, None]  # [G_PAD, 1, 1] the group of 32 channels
    byte = tl.arange(0, 4)[None, :, None]  # [1, 4, 1] the byte of 8 channels within it
    bit = tl.arange(0, 8)[None, None, :]  # [1, 1, 8] the channel within the byte
    chan = grp * 32 + byte * 8 + bit  # [G_PAD, 4, 8]
    real = grp < G
    xb = tl.load(x_row + chan, mask=real, other=0.0)  # [G_PAD, 4, 8] bf16, read once
    top, taken = _top_channels(xb.to(tl.int16, bitcast=True).to(tl.int32), chan, real, K)
    x = tl.where(taken, 0.0, xb.to(tl.float32))  # the outliers zeroed
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [G_PAD]
    s = tl.minimum(tl.maximum(tl.math.div_rn(amax, QMAX * 1.0), TINY), BIG).to(tl.float16)  # [G_PAD]
    g1 = tl.arange(0, G_PAD)
    tl.store(s_ptr + row * G + g1, s, mask=g1 < G)
    code = (_round_half_even(tl.math.div_rn(x, s.to(tl.float32)[:, None, None]), QMAX) + QMAX).to(tl.int32)
    g2, j2 = tl.arange(0, G_PAD)[:, None], tl.arange(0, 4)[None, :]  # [G_PAD, 1], [1, 4]
    for b in tl.static_range(N):
        plane = tl.sum(((code >> b) & 1) << bit, axis=2)  # [G_PAD, 4] bytes of plane b
        tl.store(f_ptr + row * (N * G * 4) + b * (G * 4) + g2 * 4 + j2, plane.to(tl.uint8), mask=g2 < G)
    vbits = tl.load(x_row + top).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [K] the outliers' bf16 bits
    tl.store(o_ptr + row * K + tl.arange(0, K), (top << 16) | vbits)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] -> a bf16 [A, B, H] view of it (B = its second-last dim) with channels of unit stride, copying
    only when no such view exists (a mixed encoding's layer slice of [T, L, H] is one: no copy)."""
    H = x.shape[-1]
    x3 = x.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, H)
    if x3.dtype != torch.bfloat16:
        x3 = x3.to(torch.bfloat16)
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def encode(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., H] -> (features uint8 [..., n*H/8], scales fp16 [..., H/32], outliers int32 [..., 4]), in one kernel."""
    H = x.shape[-1]
    if H % GROUP or not GROUP <= H <= 65536 or not 1 <= n <= 8:
        raise ValueError(f"the int encode kernel needs a hidden size that is a multiple of {GROUP} up to 65536 and "
                         f"1 to 8 bits (got {H}, {n})")
    lead = x.shape[:-1]
    f = torch.empty(*lead, n * H // 8, dtype=torch.uint8, device=x.device)
    s = torch.empty(*lead, H // GROUP, dtype=torch.float16, device=x.device)
    o = torch.empty(*lead, OUTLIERS, dtype=torch.int32, device=x.device)
    if x.numel():
        x3 = _rows(x)  # [A, B, H]
        g_pad = triton.next_power_of_2(H // GROUP)
        _encode_kernel[(x3.shape[0] * x3.shape[1],)](
            x3, f, s, o, x3.shape[1], x3.stride(0), x3.stride(1), H, N=n, QMAX=2 ** (n - 1) - 1, G_PAD=g_pad,
            K=OUTLIERS, TINY=FP16_TINY, BIG=FP16_MAX, num_warps=max(1, min(8, g_pad // 32)))
    return f, s, o
