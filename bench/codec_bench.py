"""Feature codecs on the CPU: bytes per value, encode and decode MB/s per core, reconstruction error.

Inputs: (a) the tiny target's real features (layers [1, 3, 5]) on its conversation set; (b) synthetic
27B-shaped activations (5 layers x 5120) drawn with per-channel scales from a log-normal and a few
"massive activation" channels injected at 100-1000x the median magnitude, as real large models have and
random-initialised ones lack. Each lossless coder is blosc with one thread (per-core figures); lossy
encodings (fp8 e4m3 and int8, both with a scale per token and layer) report relative error and cosine.

    python bench/codec_bench.py --tokens 4096
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from numcodecs import Blosc

from pipeline.encoding import decode, encode


def synthetic(tokens: int, layers: int = 5, hidden: int = 5120, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(layers, hidden, generator=g) * 0.7)  # per-channel spread
    x = torch.randn(tokens, layers, hidden, generator=g) * scale
    med = x.abs().median()
    for layer in range(layers):  # massive activations: a few channels, most tokens, huge values
        ch = torch.randint(0, hidden, (3,), generator=g)
        x[:, layer, ch] = (torch.rand(tokens, 3, generator=g) * 900 + 100) * med
    return x.to(torch.bfloat16)


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


def int8_encode(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (xf / s).round().clamp(-127, 127) * s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    torch.set_num_threads(1)
    sets = {"tiny target (L=3, H=128)": tiny_features(a.tokens), "27B-shaped + outliers": synthetic(a.tokens // 4)}
    print(f"{'data':<26}{'encoding':<30}{'B/value':>8}{'enc MB/s':>10}{'dec MB/s':>10}{'rel err':>9}{'cosine':>8}")
    for name, x in sets.items():
        bits = x.contiguous().view(torch.int16).numpy().view(np.uint16)
        for cname, lvl, sh, label in [("zstd", 1, Blosc.SHUFFLE, "bf16 zstd-1 shuffle"),
                                      ("zstd", 3, Blosc.SHUFFLE, "bf16 zstd-3 shuffle"),
                                      ("zstd", 3, Blosc.BITSHUFFLE, "bf16 zstd-3 bitshuffle"),
                                      ("lz4", 5, Blosc.SHUFFLE, "bf16 lz4 shuffle")]:
            bpv, enc, dec = lossless(bits, cname, lvl, sh)
            print(f"{name:<26}{label:<30}{bpv:>8.3f}{enc:>10.0f}{dec:>10.0f}{0.0:>9.4f}{1.0:>8.4f}")
        xf = x.float()
        for label, y, payload in [("fp8 e4m3 /token+layer, zstd-1", None, "fp8"), ("int8 /token+layer", int8_encode(x), None)]:
            if payload == "fp8":
                t0 = time.perf_counter()
                p, s = encode(x, "fp8")
                t_enc = time.perf_counter() - t0
                y = decode(p, s, "fp8", torch.float32)
                bpv, _, dec = lossless(p.numpy(), "zstd", 1, Blosc.BITSHUFFLE)
                enc_mb = x.numel() * 2 / 1e6 / t_enc
                bpv += 4 / x.shape[-1]  # the float32 scale per token and layer
            else:
                bpv, enc_mb, dec = 1 + 4 / x.shape[-1], float("nan"), float("nan")
            rel = ((y - xf).norm() / xf.norm()).item()
            cos = torch.nn.functional.cosine_similarity(y.flatten(0, 1), xf.flatten(0, 1), dim=-1).mean().item()
            print(f"{name:<26}{label:<30}{bpv:>8.3f}{enc_mb:>10.0f}{dec:>10.0f}{rel:>9.4f}{cos:>8.4f}")


if __name__ == "__main__":
    main()
