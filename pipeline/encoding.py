"""Feature encodings: how target hidden states become store bytes and back, on the device that holds them.

Contract:
- `encode(x, encoding)` takes features [T, L, H] in any float dtype on any device and returns
  (payload, scales): `bf16` -> int16 bit patterns of the bf16 values [T, L, H] (lossless for bf16
  inputs), scales None; `fp8` -> uint8 bit patterns of float8_e4m3fn [T, L, H] and float32 scales [T, L]
  with x ~= fp8 * scale, scale = amax over H / 448 (per token and layer; all-zero rows get scale 1).
- `decode(payload, scales, encoding, dtype)` inverts it on whatever device the payload is on (training
  decodes on the GPU, after the copy, so the CPU never touches float conversions).
- Payloads are exactly what the store holds (uint16 is stored for bf16: the same bits as int16).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def encode(x: torch.Tensor, encoding: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if encoding == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16), None
    if encoding == "fp8":
        xf = x.float()
        amax = xf.abs().amax(dim=-1)  # [T, L]
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (xf / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8), scales.contiguous()
    raise ValueError(f"unknown feature encoding {encoding!r}")


def decode(payload: torch.Tensor, scales: Optional[torch.Tensor], encoding: str,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """payload [..., L, H] (int16/uint16 view for bf16, uint8 for fp8) -> features [..., L, H] in `dtype`."""
    if encoding == "bf16":
        if payload.dtype != torch.int16:
            payload = payload.view(torch.int16)
        return payload.view(torch.bfloat16).to(dtype)
    if encoding == "fp8":
        x = payload.view(torch.float8_e4m3fn).to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
        return x.to(dtype)
    raise ValueError(f"unknown feature encoding {encoding!r}")


def to_storage(payload: torch.Tensor) -> np.ndarray:
    """A CPU payload as the numpy dtype the store holds (uint16 for bf16 bits, uint8 for fp8 bits)."""
    arr = payload.numpy()
    return arr.view(np.uint16) if arr.dtype == np.int16 else arr


def from_storage(arr: np.ndarray) -> torch.Tensor:
    """Store numpy (uint16/uint8) -> a CPU tensor that `decode` accepts, without copying."""
    if arr.dtype == np.uint16:
        arr = arr.view(np.int16)
    return torch.from_numpy(np.ascontiguousarray(arr))
