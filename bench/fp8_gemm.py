"""Issue 30 item 4, the speed half: the hybrid target's linears as FP8 GEMMs, for bench/fastfwd_bench.py.

Measured, not adopted: dflash loads Qwen's FP8 release by dequantizing its block-wise scales into bf16 weights
(pipeline/fp8_weights.py), and extraction runs bf16 GEMMs. This module answers what FP8 GEMMs would buy on top of
the fast forward. `convert(model)` replaces every `nn.Linear` of the decoder layers whose two dimensions are
multiples of 16 with `FP8Linear`:

    weight [N, K] bf16 -> w8 [N, K] float8_e4m3fn, one fp32 scale per output row   (once, at conversion)
    x [..., K]         -> x8 [M, K] float8_e4m3fn, one fp32 scale per token        (each call; compiled on CUDA)
    y = torch._scaled_mm(x8, w8.T, scale_a [M, 1], scale_b [1, N]) -> [..., N] in x's dtype   (H100/H200)

Row-wise scales are what torch 2.11's `_scaled_mm` runs on Hopper; Qwen's release has 128 x 128 weight blocks,
so this is the speed of FP8 GEMMs of the same shapes, with the release's weights requantized per row. On a CPU
(the smoke run) the same quantized values are multiplied in fp32: the numbers of the FP8 path, not its speed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

E4M3_MAX = 448.0


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (x8 [M, K] float8_e4m3fn, scale [M, 1] fp32) with x ~= x8 * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


_QUANT: dict = {}


def _quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_rows, compiled on CUDA (one fused kernel instead of five eager ones)."""
    if not x.is_cuda:
        return quantize_rows(x)
    if "fn" not in _QUANT:
        _QUANT["fn"] = torch.compile(quantize_rows, dynamic=True)
    return _QUANT["fn"](x)


class FP8Linear(nn.Module):
    """An nn.Linear's forward through row-scaled FP8 GEMMs (see the module docstring)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w8, sw = quantize_rows(lin.weight.detach())
        self.register_buffer("w8", w8)  # [N, K]
        self.register_buffer("sw", sw.view(1, -1).contiguous())  # [1, N]
        self.bias = lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x8, sx = _quant(x.reshape(-1, x.shape[-1]))  # [M, K], [M, 1]
        if x.is_cuda:
            y = torch._scaled_mm(x8, self.w8.t(), scale_a=sx, scale_b=self.sw, out_dtype=x.dtype)  # [M, N]
        else:
            y = ((x8.float() * sx) @ (self.w8.float() * self.sw.t()).t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


def convert(layers: nn.Module) -> int:
    """Replace the nn.Linear modules under `layers` (both dimensions multiples of 16) by FP8Linear; returns
    how many were replaced. The bf16 weights they held are released."""
    todo = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0]
    for parent, name, child in todo:
        setattr(parent, name, FP8Linear(child))
    return len(todo)


def tap_outputs(layers: nn.ModuleList, layer_ids: list[int], run) -> dict[int, Tensor]:
    """The outputs of layers[i] for i in layer_ids while `run()` runs (forward hooks), as fp32 on the host."""
    got: dict[int, Tensor] = {}
    hooks = [layers[i].register_forward_hook(
        lambda m, a, out, i=i: got.__setitem__(i, (out[0] if isinstance(out, tuple) else out).detach().float().cpu()))
        for i in layer_ids]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return got


def feature_error(ref: dict[int, Tensor], new: dict[int, Tensor]) -> dict[str, dict]:
    """Per tap layer: the mean per-token cosine and ||new - ref|| / ||ref||."""
    out = {}
    for i, a in ref.items():
        b = new[i].reshape(-1, a.shape[-1])
        a = a.reshape(-1, a.shape[-1])
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
        out[str(i)] = {"cosine": cos, "rel_err": ((b - a).norm() / a.norm().clamp(min=1e-12)).item()}
    return out
