"""Feature codecs on the CPU: bytes per value, encode and decode MB/s per core, reconstruction error.

Inputs: (a) the tiny target's real features (layers [1, 3, 5]) on its conversation set; (b) synthetic
27B-shaped activations (5 layers x 5120) drawn with per-channel scales from a log-normal and a few
"massive activation" channels injected at 100-1000x the median magnitude, as real large models have and
random-initialised ones lack. Each lossless coder is blosc with one thread (per-core figures); every lossy
store encoding (fp8, int8/6/5/4: pipeline/encoding.py) reports bytes per value after zstd-1, encode/decode
MB/s on this CPU (training decodes on the GPU), relative error, the relative error of the ordinary
(non-outlier) channels, and cosine; plus the naive per-token int8 that collapses next to outliers.

    python bench/codec_bench.py --tokens 4096
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from numcodecs import Blosc

from pipeline.encoding import ENCODINGS, GROUP, OUTLIERS, decode, encode, to_storage


def synthetic(tokens: int, layers: int = 5, hidden: int = 5120, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(layers, hidden, generator=g) * 0.7)  # per-channel spread
    x = torch.randn(tokens, layers, hidden, generator=g) * scale
    med = x.abs().median()
    ch = torch.randint(0, hidden, (3,), generator=g)  # massive activations: a few channels, every token, huge
    for layer in range(layers):
        x[:, layer, ch] = (torch.rand(tokens, 3, generator=g) * 900 + 100) * med
    return x.to(torch.bfloat16), ch


def tiny_features(tokens: int) -> torch.Tensor:
    from data.ingest import ingest
    from pipeline.config import load_config
    from pipeline.target import FeatureCapture, capture_features, load_target, load_tokenizer

    cfg = load_config(None, ["data.max_samples=400"])
    tok = load_tokenizer(cfg.target.path)
    samples, _ = ingest(cfg.data, tok)
    model = load_target(cfg.target.path, torch.float32, torch.device("cpu"))
    cap = FeatureCapture(model, [1, 3, 5])
    out, n = [], 0
    for s in samples:
        ids = torch.from_numpy(s.input_ids.astype(np.int64))[None]
        out.append(capture_features(model, cap, ids, torch.ones_like(ids))[0])
        n += ids.shape[1]
        if n >= tokens:
            break
    return torch.cat(out)[:tokens].to(torch.bfloat16)


def lossless(raw: np.ndarray, cname: str, clevel: int, shuffle: int) -> tuple[float, float, float]:
    codec = Blosc(cname=cname, clevel=clevel, shuffle=shuffle, blocksize=0)
    Blosc.use_threads = False
    chunks = np.array_split(raw, max(1, raw.shape[0] // 256))
    t0 = time.perf_counter()
    enc = [codec.encode(c) for c in chunks]
    t1 = time.perf_counter()
    for e in enc:
        codec.decode(e)
    t2 = time.perf_counter()
    mb = raw.nbytes / 1e6
    return sum(len(e) for e in enc) / raw.size, mb / (t1 - t0), mb / (t2 - t1)


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """The naive format (one scale per token and layer) that collapses next to massive activations."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (xf / s).round().clamp(-127, 127) * s


def lossy_rows(name: str, x: torch.Tensor, outlier_ch: torch.Tensor | None) -> None:
    """Every store encoding: bytes/value on disk (zstd-1 over each part), encode/decode MB/s on this CPU,
    relative error and cosine overall, and relative error of the ordinary channels only."""
    xf = x.float()
    ordinary = torch.ones(x.shape[-1], dtype=torch.bool)
    if outlier_ch is not None:
        ordinary[outlier_ch] = False
    for enc in ENCODINGS[1:]:
        t0 = time.perf_counter()
        parts = encode(x, enc)
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        y = decode(parts, enc, torch.float32)
        t_dec = time.perf_counter() - t0
        size = 0
        for p in parts.values():
            arr = to_storage(p)
            bpv, _, _ = lossless(arr.reshape(arr.shape[0], -1), "zstd", 1, Blosc.SHUFFLE if arr.itemsize > 1 else Blosc.BITSHUFFLE)
            size += bpv * arr.size
        mb = x.numel() * 2 / 1e6
        row(name, f"{enc} (+zstd-1)", size / x.numel(), mb / t_enc, mb / t_dec, y, xf, ordinary)
    row(name, "int8, one scale per token+layer", 1 + 4 / x.shape[-1], float("nan"), float("nan"), per_token_int8(x), xf,
        ordinary)
    size = 5 / 8 + 2 / GROUP + OUTLIERS * 4 / x.shape[-1]  # as int5 before zstd
    row(name, "int5 + Hadamard per group (study)", size, float("nan"), float("nan"), rotated_int5(x), xf, ordinary)


def rotated_int5(x: torch.Tensor) -> torch.Tensor:
    """Not a store encoding: int5 with each group of 32 channels rotated by a sign-flipped Hadamard matrix
    before quantising (QuaRot-style), which spreads channels of different scale across the group. Returns
    the reconstruction; the outliers are kept exactly as in int5."""
    xf = x.float()
    top = xf.abs().topk(OUTLIERS, dim=-1).indices
    vals = xf.gather(-1, top)
    g = xf.scatter(-1, top, 0.0).unflatten(-1, (x.shape[-1] // GROUP, GROUP))  # [..., H/G, G]
    h = torch.ones(1, 1)
    while h.shape[0] < GROUP:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (GROUP,), generator=torch.Generator().manual_seed(1)).float() * 2 - 1
    rot = h * signs[:, None] / GROUP**0.5  # orthogonal
    gr = g @ rot
    s = gr.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 15
    y = ((gr / s).round().clamp(-15, 15) * s) @ rot.T
    return y.flatten(-2).scatter(-1, top, vals)


def row(name, label, bpv, enc_mb, dec_mb, y, xf, ordinary) -> None:
    rel = ((y - xf).norm() / xf.norm()).item()
    rel_o = ((y - xf)[..., ordinary].norm() / xf[..., ordinary].norm()).item()
    cos = torch.nn.functional.cosine_similarity(y.flatten(0, 1), xf.flatten(0, 1), dim=-1).mean().item()
    print(f"{name:<24}{label:<34}{bpv:>8.3f}{2 / bpv:>7.2f}x{enc_mb:>10.0f}{dec_mb:>10.0f}{rel:>9.4f}{rel_o:>10.4f}{cos:>8.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    torch.set_num_threads(1)
    syn, ch = synthetic(a.tokens // 4)
    sets = {"tiny target (3 x 128)": (tiny_features(a.tokens), None), "27B-shaped + outliers": (syn, ch)}
    print(f"{'data':<24}{'encoding':<34}{'B/value':>8}{'vs bf16':>8}{'enc MB/s':>10}{'dec MB/s':>10}{'rel err':>9}"
          f"{'ordinary':>10}{'cosine':>8}")
    for name, (x, outlier_ch) in sets.items():
        bits = x.contiguous().view(torch.int16).numpy().view(np.uint16)
        for cname, lvl, sh, label in [("zstd", 1, Blosc.SHUFFLE, "bf16 zstd-1 shuffle"),
                                      ("zstd", 3, Blosc.SHUFFLE, "bf16 zstd-3 shuffle"),
                                      ("zstd", 3, Blosc.BITSHUFFLE, "bf16 zstd-3 bitshuffle"),
                                      ("lz4", 5, Blosc.SHUFFLE, "bf16 lz4 shuffle")]:
            bpv, enc, dec = lossless(bits, cname, lvl, sh)
            print(f"{name:<24}{label:<34}{bpv:>8.3f}{2 / bpv:>7.2f}x{enc:>10.0f}{dec:>10.0f}{0.0:>9.4f}{0.0:>10.4f}{1.0:>8.4f}")
        lossy_rows(name, x, outlier_ch)


if __name__ == "__main__":
    main()
