"""Store formats against the peers' format, and the training loader against the GPU's appetite.

1. Same features (synthetic 27B-class activations: 5 layers x 5120, log-normal channel scales and a few
   massive-activation channels), N samples of S tokens, written as a dflash store in each encoding and as
   one `torch.save` bf16 file per sample (what peer trainers store). Reported: bytes per token on disk,
   write MB/s (raw bf16 MB per second, one process: encode (GPU when present, as extraction does) + compress
   + write), and random-sample read MB/s with the page cache dropped for the files first (posix_fadvise
   DONTNEED), decoding included (on the GPU when present, as training does).
2. The training loader (StoreDataset + RankBatchSampler + collate in a DataLoader with W spawn workers) on
   the default-encoding store: samples/s, vs the `--consume` samples/s the GPU trains at (train_bench).
3. Time before the first training step on a store of 100K samples: dflash opens one store (the per-sample
   index is a few arrays per shard) and reads batch 0; the per-file format has to list 100K files, and to
   batch by length, open every one of them. Samples are short (32 tokens, 5 x 256) so this measures the
   per-sample cost, not bandwidth.

    python bench/store_bench.py --root /tmp/storebench --samples 24 --seq 3072 --out $OUT/store.json
All three parts in one process need ~30 GB of RAM; on a smaller machine run them one at a time with --skip
(e.g. `--skip startup`, then `--skip formats,loader`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from pipeline import store as st
from pipeline.encoding import encode, raw_bytes_per_token
from pipeline.provenance import create_or_open_store
from pipeline.store_reader import StoreReader
from pipeline.store_writer import ShardWriter


def synthetic(tokens: int, L: int, H: int, g: torch.Generator) -> torch.Tensor:
    scale = torch.exp(torch.randn(L, H, generator=g) * 0.7)
    x = torch.randn(tokens, L, H, generator=g) * scale
    for layer in range(L):
        ch = torch.randint(0, H, (3,), generator=g)
        x[:, layer, ch] *= 300.0
    return x.to(torch.bfloat16)


def provenance(enc: str, L: int, H: int, n_shards: int = 1) -> dict:
    return {"schema_version": st.SCHEMA_VERSION, "target": {"name": "bench", "hidden_size": H, "vocab_size": 248320,
            "num_hidden_layers": 64, "tie_word_embeddings": False}, "layer_ids": list(range(1, 1 + L)),
            "hidden_size": H, "encoding": enc, "chunk_tokens": 256, "clevel": 1, "num_shards": n_shards,
            "dataset": {"fingerprint": "bench", "validation_samples": 0}, "max_length": 1 << 20}


def write_store(path: Path, enc: str, samples: list, L: int, H: int) -> float:
    shutil.rmtree(path, ignore_errors=True)
    prov = provenance(enc, L, H)
    create_or_open_store(str(path), prov)
    w = ShardWriter(str(path), 0, prov)
    w.start("bench", len(samples), sum(len(t) for t, _ in samples))
    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # extraction encodes on the GPU
    for i, (toks, x) in enumerate(samples):
        parts = {k: v.cpu().numpy() for k, v in encode(x.to(dev), enc).items()}
        parts = {k: (v.view(np.uint16) if v.dtype == np.int16 else v) for k, v in parts.items()}
        w.write_batch(np.array([i + 1], np.uint64), np.zeros(1, np.uint8), np.array([len(toks)], np.int32), toks,
                      np.ones(len(toks), np.uint8), parts)
    w.finish()
    return time.perf_counter() - t0


def drop_cache(path: Path) -> None:
    for d, _, fs in os.walk(path):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def formats(a, root: Path, samples: list, L: int, H: int) -> dict:
    n_tok = sum(len(t) for t, _ in samples)
    raw_mb = n_tok * L * H * 2 / 1e6
    order = np.random.default_rng(0).permutation(len(samples))
    rows = {}
    for enc in a.encodings.split(","):
        path = root / f"{enc}.zarr"
        w_s = write_store(path, enc, samples, L, H)
        drop_cache(path)
        reader = StoreReader(str(path))
        t0 = time.perf_counter()
        from pipeline.encoding import decode, from_storage

        dev = "cuda" if torch.cuda.is_available() else "cpu"  # training decodes on the GPU
        for i in order:
            s = reader.read(int(i))
            decode({k: from_storage(v).to(dev) for k, v in s.items() if k not in ("tokens", "loss_mask")}, enc)
        if dev == "cuda":
            torch.cuda.synchronize()
        r_s = time.perf_counter() - t0
        rows[f"dflash {enc}"] = {"bytes_per_token": disk_bytes(path) / n_tok, "write_MB_s": raw_mb / w_s,
                                 "read_MB_s": raw_mb / r_s, "raw_bytes_per_token": raw_bytes_per_token(enc, L, H)}
    pt = root / "torch_save"
    shutil.rmtree(pt, ignore_errors=True)
    pt.mkdir(parents=True)
    t0 = time.perf_counter()
    for i, (toks, x) in enumerate(samples):
        torch.save({"input_ids": torch.from_numpy(toks), "loss_mask": torch.ones(len(toks), dtype=torch.uint8),
                    "hidden_states": x.flatten(1)}, pt / f"data_{i}.ckpt")
    w_s = time.perf_counter() - t0
    drop_cache(pt)
    t0 = time.perf_counter()
    for i in order:
        torch.load(pt / f"data_{i}.ckpt", weights_only=True)
    r_s = time.perf_counter() - t0
    rows["torch.save bf16 / sample"] = {"bytes_per_token": disk_bytes(pt) / n_tok, "write_MB_s": raw_mb / w_s,
                                        "read_MB_s": raw_mb / r_s, "raw_bytes_per_token": L * H * 2}
    print(f"\nstore formats: {len(samples)} samples x {a.seq} tokens, {L} x {H} features "
          f"({raw_mb / 1e3:.1f} GB raw bf16); one process; reads with the page cache dropped")
    print(f"{'format':<26}{'B/token':>10}{'vs bf16 raw':>13}{'write MB/s':>12}{'read MB/s':>11}")
    for k, r in rows.items():
        print(f"{k:<26}{r['bytes_per_token']:>10.0f}{L * H * 2 / r['bytes_per_token']:>12.2f}x"
              f"{r['write_MB_s']:>12.0f}{r['read_MB_s']:>11.0f}")
    return rows


def loader(a, root: Path, L: int, H: int) -> dict:
    from data.store_dataset import RankBatchSampler, StoreDataset, collate, worker_init

    path = str(root / f"{a.loader_encoding}.zarr")
    reader = StoreReader(path)
    idx = list(range(len(reader.samples)))
    lengths = [reader.samples[i].length for i in idx]
    out = {}
    print(f"\nloader: {a.loader_encoding} store, batch 1 x {a.seq} tokens, {a.anchors} anchors; the GPU consumes "
          f"{a.consume:.2f} samples/s (train_bench); page cache warm (the store is re-read every epoch)")
    print(f"{'workers':>8}{'samples/s':>11}{'raw MB/s':>10}{'vs consumption':>16}")
    for w in map(int, a.workers.split(",")):
        ds = StoreDataset(path, idx, a.anchors, 0)
        sampler = RankBatchSampler(lengths, 1, 0, 1, 0, shuffle=True)
        dl = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=w,
                                         worker_init_fn=worker_init, multiprocessing_context="spawn" if w else None,
                                         persistent_workers=w > 0, pin_memory=torch.cuda.is_available(),
                                         prefetch_factor=4 if w else None)
        it = iter(dl)
        next(it)  # workers started
        n, t0 = 0, time.perf_counter()
        for _ in range(a.loader_epochs):
            for batch in (it if n == 0 else iter(dl)):
                n += 1
        dt = time.perf_counter() - t0
        rate = n / dt
        out[w] = {"samples_s": rate, "raw_MB_s": rate * a.seq * L * H * 2 / 1e6, "vs_consumption": rate / a.consume}
        print(f"{w:>8}{rate:>11.2f}{out[w]['raw_MB_s']:>10.0f}{rate / a.consume:>15.2f}x")
        del dl, it
    return out


def startup(a, root: Path) -> dict:
    """Time to the first batch on 100K short samples: one dflash store vs one file per sample."""
    from data.store_dataset import StoreDataset, collate

    n, T, L, H = a.startup_samples, 32, 5, 256
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * T, L, H, generator=g).to(torch.bfloat16)
    toks = np.arange(n * T, dtype=np.int32) % 1000
    path = root / "startup.zarr"
    shutil.rmtree(path, ignore_errors=True)
    prov = provenance("bf16", L, H)
    create_or_open_store(str(path), prov)
    w = ShardWriter(str(path), 0, prov)
    w.start("bench", n, n * T)
    per = 2000
    t0 = time.perf_counter()
    for b in range(0, n, per):
        sl = slice(b * T, (b + per) * T)
        w.write_batch(np.arange(b + 1, b + per + 1, dtype=np.uint64), np.zeros(per, np.uint8),
                      np.full(per, T, np.int32), toks[sl], np.ones(per * T, np.uint8),
                      {"features": x[sl].view(torch.int16).numpy().view(np.uint16)})
    w.finish()
    write_store_s = time.perf_counter() - t0
    pt = root / "startup_pt"
    shutil.rmtree(pt, ignore_errors=True)
    pt.mkdir()
    t0 = time.perf_counter()
    for i in range(n):
        torch.save({"input_ids": torch.from_numpy(toks[i * T:(i + 1) * T]),
                    "hidden_states": x[i * T:(i + 1) * T].flatten(1).clone()}, pt / f"data_{i}.ckpt")
    write_pt_s = time.perf_counter() - t0
    drop_cache(path)
    drop_cache(pt)
    t0 = time.perf_counter()
    reader = StoreReader(str(path))
    ds = StoreDataset(str(path), list(range(len(reader.samples))), 64, 0)
    collate([ds[i] for i in range(8)])
    dflash_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    files = sorted(os.listdir(pt))
    collate_pt = [torch.load(pt / f, weights_only=True) for f in files[:8]]
    list_s = time.perf_counter() - t0
    drop_cache(pt)
    t0 = time.perf_counter()
    files = sorted(os.listdir(pt))
    lengths = [len(torch.load(pt / f, weights_only=True)["input_ids"]) for f in files]
    index_s = time.perf_counter() - t0
    del collate_pt, lengths
    r = {"samples": n, "dflash_first_batch_s": dflash_s, "files_list_and_first_batch_s": list_s,
         "files_open_all_for_lengths_s": index_s, "write_store_s": write_store_s, "write_files_s": write_pt_s}
    print(f"\nstartup on {n:,} samples (cold page cache): dflash store open + first batch {dflash_s:.2f} s; "
          f"one file per sample: list + first batch {list_s:.2f} s, open every file for its length {index_s:.1f} s "
          f"(writing them: store {write_store_s:.1f} s, files {write_pt_s:.1f} s)")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/dflash-storebench")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--encodings", default="bf16,fp8,int6,int5,int4")
    ap.add_argument("--loader-encoding", default="int5")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--loader-epochs", type=int, default=2)
    ap.add_argument("--consume", type=float, default=3.74, help="samples/s the GPU trains at (train_bench)")
    ap.add_argument("--startup-samples", type=int, default=100_000)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: formats,loader,startup")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    skip = set(a.skip.split(","))
    L, H = a.layers, a.hidden
    results = {"machine_cores": os.cpu_count()}
    if "formats" not in skip or "loader" not in skip:
        g = torch.Generator().manual_seed(0)
        samples = [(np.random.default_rng(i).integers(0, 248320, a.seq).astype(np.int32), synthetic(a.seq, L, H, g))
                   for i in range(a.samples)]
        results["formats"] = formats(a, root, samples, L, H)
        del samples
    if "loader" not in skip:
        results["loader"] = loader(a, root, L, H)
    if "startup" not in skip:
        results["startup"] = startup(a, root)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
