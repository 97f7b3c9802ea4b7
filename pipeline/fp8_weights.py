"""Block-wise scaled FP8 weights, the format of Qwen's FP8 releases (and DeepSeek's): reading them, and making them.

The format: in `config.json`, `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], ...}`; each quantized Linear weight `X.weight` [out, in] is stored as a float8 tensor next to
`X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)] (fp32 or bf16), and the real weight is
`weight.float() * scale_inv` per 128 x 128 block. Embeddings, the head, norms and the GDN's small tensors stay
bf16 (`modules_to_not_convert`).

Contract:
- `quantization(d)`: the checkpoint's block size when it is block-wise FP8, None when it is not quantized. A
  CheckpointError (one line naming config.json and the fix) for any other quantization method, an `fmt` that is
  not one of `FORMATS` (e4m3, e5m2; absent means e4m3, Qwen's), and a `weight_block_size` that is not two
  positive integers (zero, a string, a bool, one number).
- `is_fp8(t)`: whether `t` is stored in one of the float8 dtypes torch has (`FP8_DTYPES`: float8_e4m3fn,
  float8_e5m2 and the fnuz variants where torch has them). Every one of them is dequantized with its scale: the
  dtype of the stored bytes says how to read them, whatever `fmt` says, so an e5m2 tensor in an e4m3 checkpoint
  is read right rather than cast without its scale.
- `dequantize(w, scale_inv, block, name)`: the real weight, fp32, [out, in]. pipeline/checkpoint.py's loader
  calls it for every FP8 tensor while streaming the shards, so the target runs on the weights the FP8 release
  serves (in the target's dtype; the GEMMs stay bf16). It refuses, as one CheckpointError naming the tensor
  (`name`): a weight that is not 2-D, a float8 dtype that is not a weight format (float8_e8m0fnu), a block size
  that is not two positive integers, a scale whose shape is not [ceil(out / bo), ceil(in / bi)], a scale that is
  not a float, and any scale that is NaN, infinite, zero or negative (such a weight is silently wrong, or a NaN
  that later drops every sample).
- `checked(w, scale_inv, block, name)`: dequantize's refusals alone (the FP8 capture keeps the bytes).
- `quantize(w, block)`: (float8_e4m3fn weight, fp32 scale_inv) with scale_inv = amax(block) / 448, the inverse of
  dequantize up to FP8 rounding; `quantize(w, block, dtype=torch.float8_e5m2)` makes an e5m2 one (amax / 57344).
  It is used for tests and for the feature-difference study (bench/fp8_features.py), never at training time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from pipeline.errors import CheckpointError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_SUFFIX = "_scale_inv"
# config.json `fmt` -> the float8 weight dtypes of that format torch has here (fnuz: AMD's variants)
FORMATS = {
    "e4m3": tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n)),
    "e5m2": tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e5m2fnuz") if hasattr(torch, n)),
}
FP8_DTYPES = tuple(dt for dts in FORMATS.values() for dt in dts)
_ALL_FLOAT8 = tuple(getattr(torch, n) for n in dir(torch) if n.startswith("float8_")
                    and isinstance(getattr(torch, n), torch.dtype))
_FIX = "the checkpoint is damaged or not a block-wise FP8 release: download it again, or point target.path at its bf16 release"


def _block_size(value, where: str) -> tuple[int, int]:
    """(bo, bi) of a weight_block_size, or a CheckpointError naming `where`."""
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value))
    if not ok:
        raise CheckpointError(f"{where}: weight_block_size = {value!r} must be two positive integers such as "
                              f"[128, 128]; {_FIX}")
    return int(value[0]), int(value[1])


def quantization(d: Path) -> Optional[tuple[int, int]]:
    from pipeline.targets import read_target_config

    q = read_target_config(d).quantization
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method != "fp8":
        raise CheckpointError(f"{d} is quantized with {method or 'an unnamed method'!r}; dflash reads bf16/fp16 "
                              "checkpoints and block-wise FP8 ones (Qwen's FP8 releases). Point target.path at the "
                              "bf16 release (or the FP8 one)")
    where = f"{Path(d) / 'config.json'} quantization_config"
    fmt = q.get("fmt", "e4m3")
    if fmt not in FORMATS:
        raise CheckpointError(f"{where}: fmt = {fmt!r} is not a float8 format dflash reads ({', '.join(FORMATS)}); "
                              "point target.path at the bf16 release")
    return _block_size(q.get("weight_block_size") or [128, 128], where)


def is_fp8(t: torch.Tensor) -> bool:
    """Stored in a float8 dtype (any: one that is no weight format is refused by `dequantize`, by name)."""
    return t.dtype in _ALL_FLOAT8


def scale_key(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX  # model.layers.0.mlp.up_proj.weight -> ...weight_scale_inv


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(out/bo), ceil(in/bi)] -> [out, in], each block's scale over its block."""
    out, inp = shape
    return scale.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]


def _check_scale(scale_inv: torch.Tensor, want: tuple[int, int], block, name: str) -> None:
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"{name}: its scale has shape {list(scale_inv.shape)}, not {list(want)} for blocks "
                              f"of {list(block)}; {_FIX}")
    if not scale_inv.dtype.is_floating_point:
        raise CheckpointError(f"{name}: its scale is stored as {scale_inv.dtype}, not a float; {_FIX}")
    s = scale_inv.float()
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckpointError(f"{name}: {int(bad.sum())} of its {s.numel()} block scale(s) are NaN, infinite, zero "
                              f"or negative (block {list(first)}: {float(s[first])}); {_FIX}")


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               name: str = "an FP8 weight") -> torch.Tensor:
    """The real weight of the float8 tensor `w` (fp32, [out, in]); see the module contract for what is refused."""
    block = checked(w, scale_inv, block, name)
    return w.float() * _expand(scale_inv.to(w.device), w.shape, block)  # [out, in] fp32


def checked(w: torch.Tensor, scale_inv: torch.Tensor, block, name: str = "an FP8 weight") -> tuple[int, int]:
    """`dequantize`'s refusals without the dequantization (pipeline/fp8_block.py keeps the FP8 bytes and their
    scale as loaded): the block size, or one CheckpointError naming the tensor."""
    if w.dtype not in FP8_DTYPES:
        raise CheckpointError(f"{name} is stored as {w.dtype}, which is no FP8 weight format dflash reads "
                              f"({', '.join(str(d).removeprefix('torch.') for d in FP8_DTYPES)}); {_FIX}")
    if w.dim() != 2:
        raise CheckpointError(f"{name} is an FP8 tensor of shape {list(w.shape)}: block-wise FP8 weights are 2-D "
                              f"[out, in]; {_FIX}")
    block = _block_size(block, name)
    want = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
    _check_scale(scale_inv, want, block, name)
    return block


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128),
             dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    top = float(torch.finfo(dtype).max)
    nb0, nb1 = math.ceil(out / block[0]), math.ceil(inp / block[1])
    padded = torch.zeros(nb0 * block[0], nb1 * block[1], dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    blocks = padded.view(nb0, block[0], nb1, block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [nb0, nb1]
    scale_inv = amax / top
    q = (w.float() / _expand(scale_inv, w.shape, block)).clamp(-top, top).to(dtype)
    return q, scale_inv
