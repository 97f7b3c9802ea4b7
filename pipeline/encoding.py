"""Feature encodings: how target hidden states become store bytes and back, on the device that holds them.

An encoding turns features x [T, L, H] (T tokens, L captured layers, H hidden) into named *parts*, each a
tensor with T rows that the store keeps as one array (pipeline.store owns the arrays; this module owns
what is in them):

    encoding  parts (per token)                                  bits/value before entropy coding
    bf16      features int16 [L, H]  bf16 bit patterns (lossless)                        16
    fp8       features uint8 [L, H]  float8_e4m3fn bits; scales float32 [L]               8.006 (H=5120)
              x ~= fp8 * scale, scale = amax over H / 448 (per token and layer)
    intN      features uint8 [L, N*H/8]  N bit planes of the offset codes, 8 channels a byte
    (N=4..8)  scales float16 [L, H/32]   one per group of 32 channels: amax / (2^(N-1)-1)
              outliers int32 [L, 4]      the 4 largest |x| of each token and layer, exact:
                                         (channel << 16) | bf16 bits                     N + 0.525 (H=5120)

    intA+intBlast  the deepest captured layer in intB, the others in intA (mixed precision by layer):
              intA's parts over layers [0, L-1) plus "last_"-prefixed intB parts over layer L-1

intN is symmetric round-to-nearest with small group scales (GPTQ/AWQ-style groups of 32), plus the 4
largest-magnitude values of each token and layer kept exactly and zeroed before quantising. Large models
carry a few "massive activation" channels at 100-1000x the typical magnitude: without the outlier
parts, the group holding such a channel would quantise its 31 neighbours to zero.

Contract:
- `encode(x, encoding)` -> dict of parts on x's device; `decode(parts, encoding, dtype)` inverts it on
  whatever device the parts are on (training decodes on the GPU after the copy; the CPU only moves bytes).
  Parts may carry any leading dims ([T, ...] or [B, S, ...]).
- On CUDA the intN encode is one Triton kernel (pipeline/int_encode_kernel.py): the CPU's parts to the bit, except
  that among equal magnitudes it takes the lowest channel as an outlier (torch.topk's choice there is unspecified).
- `parts_spec(encoding, L, H)` gives each part's per-token shape and numpy storage dtype; `to_storage` /
  `from_storage` convert between torch parts and the numpy arrays the store holds (uint16 for bf16 bits).
- `compression_factor(encoding, H)`: the measured store bytes / raw bytes of an encoding's parts (blosc),
  which `dflash extract --plan` sizes a store with; None for an encoding not measured yet (the plan then
  assumes raw size and says so). A new encoding adds its factors to `COMPRESSION` beside its parts.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUP = 32  # channels per scale in the intN encodings
OUTLIERS = 4  # exact values kept per token and layer in the intN encodings
INT_BITS = {"int8": 8, "int6": 6, "int5": 5, "int4": 4}
# mixed precision by layer: (encoding of layers [0, L-1), encoding of the deepest captured layer L-1)
MIXED = {"int4+int8last": ("int4", "int8"), "int5+int8last": ("int5", "int8")}
LAST = "last_"  # prefix of the deepest layer's parts in a mixed encoding
ENCODINGS = ("bf16", "fp8", *INT_BITS, *MIXED)
_FP16_MAX, _FP16_TINY = 65504.0, 2.0**-24
# store bytes of the feature parts / their raw bytes, blosc zstd-1 + byte shuffle (the default store.clevel)
COMPRESSION = {
    # "tiny": the tiny target (hidden 128, 3 layers): 240 tiny-chat samples (13,879 tokens) extracted in bf16
    # on CPU (2 shards) and `dflash recode`d to every encoding; (all files of the store - frozen head - ids,
    # masks and sample index) / (tokens x raw feature bytes), so zarr's metadata is in it (2026-11-30)
    "tiny": {"bf16": 0.773, "fp8": 0.860, "int8": 0.915, "int6": 0.884, "int5": 0.866, "int4": 0.843,
             "int4+int8last": 0.865, "int5+int8last": 0.876},
    # "large": 27B-shaped activations (5 x 5120, log-normal channel scales, massive-activation channels);
    # `python bench/codec_bench.py --tokens 4096`, docs/benchmarks.md "Feature encodings" (B/value / raw B/value).
    # Extraction from a random-initialised 27B measured 0.787 (bf16), 0.907 (fp8), 0.965 (int5), 0.958 (int4):
    # these are the larger (safer) of the two where both exist.
    "large": {"bf16": 0.799, "fp8": 0.989, "int8": 0.984, "int6": 0.971, "int5": 0.966, "int4": 0.960,
              "int4+int8last": 0.968, "int5+int8last": 0.972},
}
LARGE_HIDDEN = 1024  # targets at least this wide use the "large" factors


def size_class(hidden_size: int) -> str:
    """Which row of COMPRESSION a target of this width takes."""
    return "large" if hidden_size >= LARGE_HIDDEN else "tiny"


def compression_factor(encoding: str, hidden_size: int) -> float | None:
    """The measured compression factor of `encoding` for a target this wide, or None when it was not measured."""
    return COMPRESSION[size_class(hidden_size)].get(encoding)


def check(encoding: str, hidden_size: int) -> None:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown feature encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")
    if (encoding in INT_BITS or encoding in MIXED) and hidden_size % GROUP:
        raise ValueError(f"encoding {encoding!r} needs a hidden size divisible by {GROUP} (got {hidden_size}); "
                         "use bf16 or fp8 for this target")


def parts_spec(encoding: str, L: int, H: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape of one token's part, numpy dtype the store holds)."""
    check(encoding, H)
    if encoding == "bf16":
        return {"features": ((L, H), "uint16")}
    if encoding == "fp8":
        return {"features": ((L, H), "uint8"), "scales": ((L,), "float32")}
    if encoding in MIXED:
        if L < 2:
            raise ValueError(f"encoding {encoding!r} needs at least 2 captured layers (got {L}); use "
                             f"{MIXED[encoding][0]} for this target")
        base, last = MIXED[encoding]
        return {**parts_spec(base, L - 1, H), **{LAST + k: v for k, v in parts_spec(last, 1, H).items()}}
    n = INT_BITS[encoding]
    return {"features": ((L, n * H // 8), "uint8"), "scales": ((L, H // GROUP), "float16"),
            "outliers": ((L, OUTLIERS), "int32")}


def part_names(encoding: str) -> tuple[str, ...]:
    """The names of an encoding's parts, "features" first (the store keeps one per-token array per part)."""
    return tuple(parts_spec(encoding, 2, GROUP))


def raw_bytes_per_token(encoding: str, L: int, H: int) -> int:
    return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in parts_spec(encoding, L, H).values())


def encode(x: torch.Tensor, encoding: str) -> dict[str, torch.Tensor]:
    """x [..., L, H] any float dtype -> parts (see the table above)."""
    check(encoding, x.shape[-1])
    if encoding == "bf16":
        return {"features": x.to(torch.bfloat16).contiguous().view(torch.int16)}
    if encoding == "fp8":
        xf = x.float()
        amax = xf.abs().amax(dim=-1)  # [..., L]
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (xf / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"features": q.view(torch.uint8), "scales": scales.contiguous()}
    if encoding in MIXED:
        base, last = MIXED[encoding]
        parts = encode(x[..., :-1, :], base)
        return {**parts, **{LAST + k: v for k, v in encode(x[..., -1:, :], last).items()}}
    return _encode_int(x, INT_BITS[encoding])


def decode(parts: Mapping[str, torch.Tensor], encoding: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """parts (as `encode` returns them, or `from_storage` of the store's arrays) -> features [..., L, H]."""
    f = parts["features"]
    if encoding == "bf16":
        return (f if f.dtype == torch.int16 else f.view(torch.int16)).view(torch.bfloat16).to(dtype)
    if encoding == "fp8":
        x = f.view(torch.float8_e4m3fn).to(torch.float32) * parts["scales"].to(torch.float32).unsqueeze(-1)
        return x.to(dtype)
    if encoding in INT_BITS:
        return _decode_int(f, parts["scales"], parts["outliers"], INT_BITS[encoding]).to(dtype)
    if encoding in MIXED:
        base, last = MIXED[encoding]
        head = decode({k: v for k, v in parts.items() if not k.startswith(LAST)}, base, dtype)  # [..., L-1, H]
        tail = decode({k[len(LAST):]: v for k, v in parts.items() if k.startswith(LAST)}, last, dtype)  # [..., 1, H]
        return torch.cat([head, tail], dim=-2)
    raise ValueError(f"unknown feature encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")


def _bit_weights(device) -> torch.Tensor:
    return (2 ** torch.arange(8, device=device)).to(torch.uint8)  # [8]


def _encode_int(x: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """x [..., L, H] -> the intN parts; on CUDA one Triton kernel (pipeline/int_encode_kernel.py): `_encode_int_at`
    on the CPU to the bit, at outlier channels that put the lowest channel first among equal magnitudes."""
    if x.is_cuda:
        from pipeline import int_encode_kernel

        return dict(zip(("features", "scales", "outliers"), int_encode_kernel.encode(x, n)))
    xf = x.to(torch.bfloat16).float()  # outliers are stored as bf16: take them from the bf16 values
    return _encode_int_at(xf, _top_channels(xf), n)


def _top_channels(xf: torch.Tensor) -> torch.Tensor:
    """xf [..., H] -> the channels of the OUTLIERS largest |x|, largest first [..., K] (among equal magnitudes
    torch.topk's choice is unspecified)."""
    return xf.abs().topk(OUTLIERS, dim=-1).indices


def _encode_int_at(xf: torch.Tensor, top: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """The intN parts of xf [..., H] (float32 holding bf16 values) with the outliers at channels top [..., K]: those
    kept exactly and zeroed, then the group scales and the bit planes of the offset codes."""
    H = xf.shape[-1]
    qmax = 2 ** (n - 1) - 1
    vals = xf.gather(-1, top)  # [..., K]
    xf = xf.scatter(-1, top, 0.0)
    g = xf.unflatten(-1, (H // GROUP, GROUP))  # [..., H/G, G]
    s = (g.abs().amax(-1) / qmax).clamp(_FP16_TINY, _FP16_MAX).to(torch.float16)  # [..., H/G]
    q = (g / s.float().unsqueeze(-1)).round().clamp(-qmax, qmax)
    u = (q + qmax).to(torch.uint8).flatten(-2).unflatten(-1, (H // 8, 8))  # [..., H/8, 8] offset codes
    w = _bit_weights(xf.device)
    planes = torch.stack([(((u >> b) & 1) * w).sum(-1, dtype=torch.uint8) for b in range(n)], dim=-2)  # [..., n, H/8]
    bits = vals.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return {"features": planes.flatten(-2).contiguous(), "scales": s.contiguous(),
            "outliers": ((top.to(torch.int32) << 16) | bits).contiguous()}


def _decode_int(f: torch.Tensor, scales: torch.Tensor, outliers: torch.Tensor, n: int) -> torch.Tensor:
    *lead, W = f.shape
    H = W * 8 // n
    qmax = 2 ** (n - 1) - 1
    planes = f.unflatten(-1, (n, H // 8))  # [..., n, H/8]
    w = _bit_weights(f.device)
    u = torch.zeros(*lead, H // 8, 8, dtype=torch.uint8, device=f.device)
    for b in range(n):
        u |= ((planes[..., b, :, None] & w) != 0).to(torch.uint8) << b  # [..., H/8, 8]
    q = u.flatten(-2).float() - qmax  # [..., H]
    x = (q.unflatten(-1, (H // GROUP, GROUP)) * scales.float().unsqueeze(-1)).flatten(-2)
    o = outliers.to(torch.int32)
    idx = ((o >> 16) & 0xFFFF).long()
    lo = o & 0xFFFF
    val = (lo - (lo >= 32768).to(torch.int32) * 65536).to(torch.int16).view(torch.bfloat16).float()
    return x.scatter(-1, idx, val)


def to_storage(part: torch.Tensor) -> np.ndarray:
    """A CPU part as the numpy dtype the store holds (uint16 for bf16 bits; others unchanged)."""
    arr = part.numpy()
    return arr.view(np.uint16) if arr.dtype == np.int16 else arr


def from_storage(arr: np.ndarray) -> torch.Tensor:
    """A store array -> a CPU tensor that `decode` accepts, without copying."""
    if arr.dtype == np.uint16:
        arr = arr.view(np.int16)
    return torch.from_numpy(np.ascontiguousarray(arr))
