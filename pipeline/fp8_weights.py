"""Block-wise scaled FP8 weights, the format of Qwen's FP8 releases (and DeepSeek's): reading them, and making them.

The format: in `config.json`, `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], ...}`; each quantized Linear weight `X.weight` [out, in] is stored as float8_e4m3fn next to
`X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)] (fp32 or bf16), and the real weight is
`weight.float() * scale_inv` per 128 x 128 block. Embeddings, the head, norms and the GDN's small tensors stay
bf16 (`modules_to_not_convert`).

Contract:
- `quantization(d)`: the checkpoint's block size when it is block-wise FP8, None when it is not quantized; a
  CheckpointError for any other quantization method, which dflash cannot read as the served weights.
- `dequantize(w, scale_inv, block)`: the real weight, fp32, [out, in]. pipeline/checkpoint.py's loader calls it
  for every FP8 tensor while streaming the shards, so the target runs on the weights the FP8 release serves (in
  the target's dtype; the GEMMs stay bf16). Without this, an FP8 tensor cast to bf16 without its scale is a
  silently wrong target.
- `quantize(w, block)`: (float8_e4m3fn weight, fp32 scale_inv) with scale_inv = amax(block) / 448, the inverse of
  dequantize up to FP8 rounding. It is used for tests and for the feature-difference study
  (bench/fp8_features.py), never at training time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

from pipeline.errors import CheckpointError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_SUFFIX = "_scale_inv"


def quantization(d: Path) -> Optional[tuple[int, int]]:
    cfg = json.loads((Path(d) / "config.json").read_text())
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method != "fp8":
        raise CheckpointError(f"{d} is quantized with {method or 'an unnamed method'!r}; dflash reads bf16/fp16 "
                              "checkpoints and block-wise FP8 ones (Qwen's FP8 releases). Point target.path at the "
                              "bf16 release (or the FP8 one)")
    block = q.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def scale_key(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX  # model.layers.0.mlp.up_proj.weight -> ...weight_scale_inv


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(out/bo), ceil(in/bi)] -> [out, in], each block's scale over its block."""
    out, inp = shape
    return scale.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    want = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
    if w.dim() != 2 or tuple(scale_inv.shape) != want:
        raise CheckpointError(f"an FP8 weight of shape {tuple(w.shape)} has a scale of shape "
                              f"{tuple(scale_inv.shape)}, not {want} for blocks of {block}")
    return w.float() * _expand(scale_inv.to(w.device), w.shape, block)  # [out, in] fp32


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    nb0, nb1 = math.ceil(out / block[0]), math.ceil(inp / block[1])
    padded = torch.zeros(nb0 * block[0], nb1 * block[1], dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    blocks = padded.view(nb0, block[0], nb1, block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [nb0, nb1]
    scale_inv = amax / FP8_MAX
    q = (w.float() / _expand(scale_inv, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale_inv
