"""Block-FP8 capture (issue 45): the target's linears run the way vLLM and SGLang serve a block-FP8 release.

`extract.target_precision` picks the numerics of the frozen target during extraction:
  bf16                 every weight in the target's dtype (an FP8 release is dequantized while loading:
                       pipeline/fp8_weights.py), bf16 GEMMs: the features of neither the bf16 model nor the served one
  fp8-block            the FP8 release's weights stay FP8 with their 128 x 128 block scales, as loaded; each linear's
                       input is quantized per token in groups of 128 channels and the GEMM runs in FP8 with fp32
                       accumulation: the served target's features
  fp8-block-from-bf16  a bf16 checkpoint's decoder linears quantized to block FP8 first (scale = amax / 448 per
                       128 x 128 block, as the releases are made), then as fp8-block: for users who serve their
                       own FP8 conversion
  auto (the default)   bf16, with one line saying so when the checkpoint is a block-FP8 release: issue 45's
                       seeded τ pairs found FP8 capture no better for an FP8-served target (docs/benchmarks.md)

The numerics, read from the engines' block-FP8 linear (vLLM `vllm/model_executor/layers/quantization/utils/
fp8_utils.py`: `per_token_group_quant_fp8` and `_w8a8_triton_block_scaled_mm`, adapted from SGLang's
`python/sglang/srt/layers/quantization/fp8_kernel.py`):
  activations  x [M, K] -> per token and group g of 128 channels: s = max(amax |x| in fp32, 1e-10) / 448,
               x8 = clamp(x / s, -448, 448) cast to float8_e4m3fn (round to nearest even)
  GEMM         y[m, n] = sum over K blocks k of (x8 . w8 over the block) * sx[m, k] * sw[n // 128, k], in fp32,
               cast to the activation dtype; the bias (none in Qwen3.5/3.6) is added after
`reference_linear` is that arithmetic in plain torch: both operands dequantized exactly as rounded, one fp32
matmul (the same sums in another order). `BlockFP8Linear` runs it through `torch._scaled_mm`'s block-scaled FP8
GEMM on CUDA (activation scales float32 [M, K/128] stored outer-dim-major, stride (1, M); weight scales the
transposed view of the contiguous [N/128, K/128] `weight_scale_inv`), its activation quantization one Triton kernel
(pipeline/fp8_act_kernel.py) done once per input tensor and shared by the sibling linears that read it
(`quantize_input`); on the CPU, below compute capability 9.0, or for an N that is not whole 128-blocks (the GDN's
48-row in_proj_b/a), it runs `reference_linear`'s arithmetic.

Contract: a linear runs in FP8 only when K is a multiple of 128 (the activation group) and its blocks are
128 x 128; any other FP8 tensor is dequantized and its linear stays in the target's dtype (counted in the line
`describe` prints). Store provenance records the precision (`target.precision`): a store is never resumed
with features of another precision.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from torch import Tensor, nn

from pipeline.errors import ConfigError
from pipeline.fp8_weights import FP8, FP8_MAX, dequantize

GROUP = 128  # activation channels per scale: the engines' group size, and the weights' block width
BLOCK = (GROUP, GROUP)
EPS = 1e-10  # the engines' floor on a group's amax (an all-zero group gets a tiny scale, not a division by zero)
SMALL_WEIGHT = 1 << 22  # off the kernel on CUDA, a weight up to this many elements keeps its fp32 dequantization
KERNEL_ROWS = 16  # torch._scaled_mm's rows padded to a multiple of this (cuBLAS refused one row)
PRECISIONS = ("auto", "bf16", "fp8-block", "fp8-block-from-bf16")
FP8_PRECISIONS = ("fp8-block", "fp8-block-from-bf16")


def resolve(choice: str, block: Optional[tuple[int, int]], path: str,
            key: str = "extract.target_precision") -> tuple[str, str]:
    """(the precision extraction runs, one line saying why; empty for bf16 on a bf16 checkpoint) for
    `key` (extract.target_precision, eval.target_precision) = `choice` on a checkpoint whose FP8 block size is
    `block` (None: not FP8). ConfigError names the key and the fix."""
    if choice not in PRECISIONS:
        raise ConfigError(f"{key} = {choice!r}: choose one of {', '.join(PRECISIONS)}")
    fp8 = block is not None
    if choice == "auto":
        if not fp8:
            return "bf16", ""  # the common case says nothing
        return "bf16", (f"target precision bf16: {path} is a block-FP8 release, dequantized to bf16 GEMMs "
                        f"({key}=fp8-block runs the served FP8 GEMMs)")
    if choice == "fp8-block" and not fp8:
        raise ConfigError(f"{key} = fp8-block needs a block-FP8 release (config.json "
                          f"quantization_config with quant_method fp8); {path} is not one: set "
                          "fp8-block-from-bf16 to quantize it for capture, or bf16")
    if choice == "fp8-block-from-bf16" and fp8:
        raise ConfigError(f"{key} = fp8-block-from-bf16 quantizes a bf16 checkpoint; {path} is "
                          "already a block-FP8 release: set fp8-block to capture with its own weights")
    if choice == "fp8-block" and tuple(block) != BLOCK:
        raise ConfigError(f"{key} = fp8-block runs 128 x 128 weight blocks (the engines' "
                          f"block-FP8 linear); {path} has blocks of {list(block)}: set bf16")
    return choice, (f"target precision {choice}: FP8 GEMMs with 1 x 128 activation and 128 x 128 weight scales "
                    f"({GPU_EQUALITY})")


# what the GPU path's tests last showed (docs/benchmarks.md), said with every fp8-block run
GPU_EQUALITY = ("each FP8 linear equals the engines' arithmetic on its own inputs within 1e-2 on the GPU, "
                "tests/test_fp8_block.py on an H100, 2026-12-06")


# ---- the numerics ----------------------------------------------------------------------------------------------

def quantize_act(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (K a multiple of 128) -> (x8 [M, K] float8_e4m3fn, sx [M, K/128] fp32 with stride (1, M))."""
    m, k = x.shape
    xg = x.float().reshape(m, k // GROUP, GROUP)  # [M, G, 128]
    amax = xg.abs().amax(dim=-1).clamp(min=EPS)  # [M, G]
    s = amax / torch.full_like(amax, FP8_MAX)  # an IEEE division (a tensor / a number is x * (1/448) on CUDA)
    x8 = (xg / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(m, k)
    return x8, s.t().contiguous().t()  # the scales outer-dim-major, as _scaled_mm takes them (one row: row-major)


def dequantize_act(x8: Tensor, sx: Tensor) -> Tensor:
    """The activations x8 * sx as fp32 [M, K]."""
    m, k = x8.shape
    return (x8.float().reshape(m, k // GROUP, GROUP) * sx.float().unsqueeze(-1)).reshape(m, k)


def reference_linear(x: Tensor, w8: Tensor, scale_inv: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """The engines' block-FP8 linear in plain torch: x [..., K] -> [..., N] in x's dtype (module docstring)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x8, sx = quantize_act(x.reshape(-1, k))
    y = dequantize_act(x8, sx) @ dequantize(w8, scale_inv, BLOCK).to(x.device).t()  # [M, N] fp32
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, w8.shape[0])


_SHARED = threading.local()  # the last input quantized on this thread: (weakref, version, (x8, sx), {its fp32})


def _version(x: Tensor) -> Optional[int]:
    return None if x.is_inference() else x._version  # inference tensors keep no version counter


def quantize_input(x: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_act(x [..., K] as [M, K]), once per input tensor (on CUDA with zero rows after the M real ones, up
    to a multiple of KERNEL_ROWS): sibling linears that read the same tensor one after another (q/k/v, gate/up,
    the GDN's four input projections) share one quantization. The last input is
    held by a weak reference (its quantization lives no longer than it, per thread), and a tensor changed in
    place since (its version counter; tensors made under inference mode keep none) is quantized again. On CUDA
    one Triton kernel (pipeline/fp8_act_kernel.py), elsewhere the plain torch of `quantize_act`."""
    last = getattr(_SHARED, "last", None)
    if last is not None and last[0]() is x and last[1] == _version(x):
        return last[2]
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:  # rows padded to whole multiples of 16 (cuBLAS refused a block-scaled GEMM of one row)
        from pipeline import fp8_act_kernel

        q = fp8_act_kernel.quantize(x2, pad_rows=KERNEL_ROWS)
    else:
        q = quantize_act(x2)
    _SHARED.last = (weakref.ref(x), _version(x), q, {})
    return q


def _dequantized_input(x8: Tensor, sx: Tensor) -> Tensor:
    """dequantize_act(x8, sx) of the input quantize_input just gave, made once for the siblings that need it
    (the GDN's in_proj_b and in_proj_a, both off the kernel)."""
    last = getattr(_SHARED, "last", None)
    if last is None or last[2][0] is not x8:
        return dequantize_act(x8, sx)
    if "fp32" not in last[3]:
        last[3]["fp32"] = dequantize_act(x8, sx)
    return last[3]["fp32"]


def kernel_takes(w8: Tensor, device: torch.device) -> bool:
    """Whether torch._scaled_mm's block-scaled GEMM runs this weight here: CUDA on compute capability 9.0+, the
    weight's dimensions whole blocks of 128 (the GDN's 48-row in_proj_b/a are not: `BlockFP8Linear` runs them
    on reference_linear's arithmetic, their weight dequantized once), and K/128 a multiple of 4: cuBLAS reads
    128 x 128 scales with a leading dimension rounded up to 4 K-blocks (torch's block-scaling tests pad them so),
    and the release's unpadded `weight_scale_inv` is that layout only then (every K of Qwen3.5/3.6-27B is)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    n, k = w8.shape
    return (torch.cuda.get_device_capability(device) >= (9, 0) and n % GROUP == 0 and k % GROUP == 0
            and (k // GROUP) % 4 == 0)


class BlockFP8Linear(nn.Module):
    """An nn.Linear of the target as served in block FP8: `weight` float8_e4m3fn [N, K] and `weight_scale_inv`
    fp32 [ceil(N/128), K/128], as the release stores them (buffers: nothing here trains)."""

    def __init__(self, w8: Tensor, scale_inv: Tensor, bias: Optional[Tensor] = None):
        super().__init__()
        if w8.dtype != FP8 or w8.dim() != 2 or w8.shape[1] % GROUP:
            raise ValueError(f"BlockFP8Linear takes a float8_e4m3fn [N, K] weight with K a multiple of {GROUP}, "
                             f"not {w8.dtype} {list(w8.shape)}")
        self.out_features, self.in_features = w8.shape
        self.register_buffer("weight", w8)
        self.register_buffer("weight_scale_inv", scale_inv.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._kernel: Optional[bool] = None
        self._w32: Optional[Tensor] = None  # off the kernel on CUDA: the dequantized weight, [N, K] fp32, made once

    def forward(self, x: Tensor) -> Tensor:  # x [..., K] -> [..., N]
        if self._kernel is None:
            self._kernel = kernel_takes(self.weight, x.device)
        lead, n = x.shape[:-1], self.out_features
        m = x.numel() // self.in_features
        x8, sx = quantize_input(x)  # [M', K] fp8, [M', K/128] fp32 stride (1, M'); M' >= M; shared with siblings
        if self._kernel:
            y = torch._scaled_mm(x8, self.weight.t(), scale_a=sx, scale_b=self.weight_scale_inv.t(),
                                 out_dtype=x.dtype)  # [M', N], fp32 accumulation
            y = y[:m]  # the real rows
        else:  # reference_linear's arithmetic on the shared quantization
            w = self._w32 if self._w32 is not None and self._w32.device == x.device else \
                dequantize(self.weight, self.weight_scale_inv, BLOCK).to(x.device)  # [N, K] fp32
            if x.is_cuda and w.numel() <= SMALL_WEIGHT:  # the GDN's in_proj_b/a: small, called every layer
                self._w32 = w
            y = (_dequantized_input(x8, sx)[:m] @ w.t()).to(x.dtype)  # the real rows
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block=128x128"


# ---- putting it into a model -----------------------------------------------------------------------------------

def takes(module: nn.Module, w8: Tensor, block) -> bool:
    """Whether the FP8 tensor `w8` of `module` runs as a BlockFP8Linear (else it is dequantized)."""
    return (type(module) is nn.Linear and tuple(block) == BLOCK and w8.dtype == FP8 and w8.dim() == 2
            and w8.shape[1] % GROUP == 0)


def adopt(model: nn.Module, kept: dict[str, tuple[Tensor, Tensor]]) -> int:
    """Replace each nn.Linear named in `kept` ({module name: (w8, scale_inv)}) by a BlockFP8Linear; its bias (a
    loaded parameter) moves along. -> how many."""
    for name, (w8, scale) in kept.items():
        owner, _, attr = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        old = getattr(parent, attr)
        bias = old.bias.detach() if old.bias is not None and not old.bias.is_meta else None
        setattr(parent, attr, BlockFP8Linear(w8, scale, bias))
    return len(kept)


def quantize_linears(layers: nn.Module) -> int:
    """fp8-block-from-bf16: every nn.Linear under `layers` (the decoder layers) whose input is whole 128-groups
    becomes a BlockFP8Linear of its own block quantization (pipeline/fp8_weights.quantize, as the releases and
    bench/fp8_features.py's copies are made). -> how many."""
    from pipeline.fp8_weights import quantize

    todo = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.in_features % GROUP == 0]
    for parent, name, child in todo:
        w8, scale = quantize(child.weight.detach(), BLOCK)
        bias = None if child.bias is None else child.bias.detach()
        setattr(parent, name, BlockFP8Linear(w8, scale, bias))
    return len(todo)


def describe(model: nn.Module) -> str:
    """One line: how many linears run in block FP8, and how many other linears keep the target's dtype."""
    fp8 = sum(isinstance(m, BlockFP8Linear) for m in model.modules())
    other = sum(type(m) is nn.Linear for m in model.modules())
    return f"{fp8} linears in block FP8, {other} in the target's dtype (head, or not whole 128-blocks)"
