"""Stage-one benchmark: extraction tokens/s vs the same model's bare forward on the same batches.

A random-initialised target of the real 27B class (Qwen3 dense layout: 64 layers, hidden 5120, FFN 17408,
40/8 heads x 128, vocab 248,320) in bf16 on one GPU, a length mix of 200-3072 tokens, 5 captured layers
[1, 16, 31, 46, 61]. Both runs use the truncated model (layers 0..61, no lm_head): the bare forward does no
capture, copy or write; the extraction runs dflash's real pipeline (`pipelined_extract`: capture, GPU encode,
pinned side-stream copy, writer thread, Zarr chunks compressed with blosc-zstd + crc32c) into a local store.

    python bench/extract_bench.py --tokens 150000 --out $OUT/extract.json
Prints a short table; `--layers 8` gives a quick smoke run. "before drain" leaves out the writer finishing
the last queued batches after the final forward: paid once per shard, so it is what a long shard sees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch


def build_model(a):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=128,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False), cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--ffn", type=int, default=17408)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--tokens", type=int, default=150000)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--encodings", default="bf16,fp8")
    ap.add_argument("--store-dir", default=None)
    ap.add_argument("--clevel", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from pipeline import store as st
    from pipeline.config import build_target_layer_ids
    from pipeline.target import FeatureCapture, truncate_layers
    from stages.extract_worker import pipelined_extract, plan_batches

    model, cfg = build_model(a)
    layer_ids = build_target_layer_ids(a.layers, 5)
    truncate_layers(model, max(layer_ids) + 1)
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < a.tokens:
        lengths.append(int(rng.integers(200, 3073)))
    plan = plan_batches(lengths, a.token_budget, 64)
    batches = []
    for b in plan:
        lens = [lengths[m] for m in b.members]
        ids = torch.randint(0, a.vocab, (len(lens), max(lens)))
        batches.append((b.members, ids, lens))
    n_tok = sum(lengths)
    padded = sum(max(l) * len(l) for _, _, l in batches)
    base = model.get_decoder()

    def bare(batches=batches):
        for _, ids, lens in batches:
            S = ids.shape[1]
            att = (torch.arange(S)[None] < torch.tensor(lens)[:, None]).long().cuda()
            base(input_ids=ids.cuda(), attention_mask=att, use_cache=False)

    def time_bare() -> float:
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bare()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

    # warm-up: one whole untimed pass. A first pass over new batch shapes pays the caching allocator's growth
    # (cudaMalloc, which synchronises); timing it made extraction look faster than the bare forward (ratio 1.06)
    time_bare()
    bare_before = time_bare()
    n_linear = sum(p.numel() for n, p in base.named_parameters() if p.ndim == 2 and "embed" not in n)
    results = {"tokens": n_tok, "padded_tokens": padded, "batches": len(batches), "bare_s_before": bare_before,
               "encodings": {}}
    root = a.store_dir or tempfile.mkdtemp(prefix="dflash-bench-")
    for enc in a.encodings.split(","):
        path = os.path.join(root, f"{enc}.zarr")
        shutil.rmtree(path, ignore_errors=True)
        prov = {"schema_version": st.SCHEMA_VERSION, "target": {"name": "bench", "hidden_size": a.hidden,
                "vocab_size": a.vocab, "num_hidden_layers": a.layers, "tie_word_embeddings": False},
                "layer_ids": layer_ids, "hidden_size": a.hidden, "encoding": enc, "chunk_tokens": 256, "clevel": a.clevel,
                "num_shards": 1, "dataset": {"fingerprint": "bench"}, "max_length": 3072}
        st.create_or_open_store(path, prov)
        writer = st.ShardWriter(path, 0, prov)
        busy = [0.0]

        def on_batch(members, parts, bad, writer=writer):
            t = time.perf_counter()
            T = parts["features"].shape[0]
            writer.write_batch(np.arange(len(members), dtype=np.uint64), np.zeros(len(members), np.uint8),
                               np.array([0] * (len(members) - 1) + [T], np.int32), np.zeros(T, np.int32),
                               np.ones(T, np.uint8), parts)
            busy[0] += time.perf_counter() - t

        capture = FeatureCapture(model, layer_ids)
        drained = [None]

        def feed():  # the time the loop asks past the last batch = its forward is done (the drain starts)
            yield from batches
            drained[0] = time.perf_counter()

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipelined_extract(model, capture, enc, torch.device("cuda"), feed(), on_batch, queue_depth=3)
        torch.cuda.synchronize()
        ext_s = time.perf_counter() - t0
        fwd_s = drained[0] - t0  # excludes only the writer's drain of the last batches (once per shard)
        capture.remove()
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        bpt = disk / n_tok
        results["encodings"][enc] = {"tok_s": n_tok / ext_s, "bytes_per_token": bpt, "drain_s": ext_s - fwd_s,
                                     "writer_busy_s": busy[0], "wall_s": ext_s,
                                     "write_MB_s": n_tok * len(layer_ids) * a.hidden * 2 / busy[0] / 1e6}  # bf16-equivalent MB/s
        shutil.rmtree(path, ignore_errors=True)
    bare_after = time_bare()  # the bare forward brackets the extractions: drift of the GPU's clock shows here
    bare_s = (bare_before + bare_after) / 2
    results.update(bare_s_after=bare_after, bare_s=bare_s, bare_tok_s=n_tok / bare_s,
                   linear_tflops_bare=2 * n_linear * padded / bare_s / 1e12)
    rows = [("bare forward", n_tok / bare_s, 1.0, None, 2 * n_linear * padded / bare_s / 1e12)]
    for enc, r in results["encodings"].items():
        r.update(ratio_vs_bare=bare_s / r["wall_s"], ratio_before_drain=bare_s / (r["wall_s"] - r["drain_s"]))
        rows.append((f"extract {enc}", r["tok_s"], r["ratio_vs_bare"], r["bytes_per_token"], r["ratio_before_drain"]))
    print(f"\nbare forward before the extractions {n_tok / bare_before:.0f} tokens/s, after {n_tok / bare_after:.0f}; "
          "ratios use their mean")
    print(f"\n{a.layers}-layer target, hidden {a.hidden}, {n_tok} tokens in {len(batches)} batches "
          f"({100 * (1 - n_tok / padded):.1f}% padding), layers {layer_ids}")
    print(f"{'run':<16}{'tokens/s':>10}{'vs bare':>9}{'B/token':>10}{'before drain':>14}   (bare: linear TFLOP/s)")
    for name, tps, ratio, bpt, x in rows:
        print(f"{name:<16}{tps:>10.0f}{ratio:>9.3f}{(f'{bpt:.0f}' if bpt else '-'):>10}"
              f"{(f'{x:.3f}' if bpt else f'({x:.0f} TFLOP/s)'):>14}")
    for enc, r in results["encodings"].items():
        print(f"writer {enc}: busy {r['writer_busy_s']:.1f}s of {r['wall_s']:.1f}s wall ({r['write_MB_s']:.0f} MB/s of bf16-equivalent features)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
