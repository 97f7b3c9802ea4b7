"""Stage-two benchmark: one training step of the 27B-class drafter, compiled flex vs SDPA with a dense mask.

Shape: 5 layers (4 sliding-window 2048 + 1 full), hidden 5120, 32/8 heads x 128, FFN 17408, frozen
248,320 x 5120 embedding and head, one sequence of 3072 tokens, 512 anchors x block 16. The step is the
one `dflash train` runs (pipeline.masks blocks and masks, pipeline.drafter, pipeline.loss chunked CE),
bf16 autocast over fp32 weights, AdamW. Useful FLOPs: drafter body fwd+bwd (fc: fwd + weight grad),
attention over visible pairs only, lm_head fwd + input grad over labelled rows.

    python bench/train_bench.py --steps 10 --out $OUT/train.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pipeline.config import DrafterConfig
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.loss import chunked_weighted_ce
from pipeline.masks import build_blocks, dense_mask, make_attend, sample_anchors


def useful_flops(a: DrafterArch, S: int, Q: int, rows: int, vocab: int, visible_pairs: dict) -> float:
    H, d, h, kv, F_ = a.hidden_size, a.head_dim, a.num_attention_heads, a.num_key_value_heads, a.intermediate_size
    fc = 2 * S * a.num_features * H * H * 2  # fwd + weight grad (features need no gradient)
    per_layer = 0.0
    for t in a.layer_types:
        lin = 2 * Q * H * (h * d) * 2 + 2 * (S + Q) * H * (kv * d) * 2 + 3 * 2 * Q * H * F_
        attn = 2 * 2 * visible_pairs[t] * d * h
        per_layer += 3 * (lin + attn)
    head = 2 * rows * H * vocab * 2  # logits + input gradient
    return fc + per_layer + head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak of the GPU")
    ap.add_argument("--modes", default="flex,sdpa")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    types = ["sliding_attention"] * (a.layers - 1) + ["full_attention"]
    cfg = DrafterConfig(num_hidden_layers=a.layers, layer_types=types, sliding_window=2048, block_size=16)
    arch = DrafterArch.from_config(cfg, [1, 16, 31, 46, 61])
    drafter = DFlashDrafter(arch).to(dev)
    H = arch.hidden_size
    embed = torch.randn(a.vocab, H, device=dev, dtype=torch.bfloat16) * 0.02
    head = torch.randn(a.vocab, H, device=dev, dtype=torch.bfloat16) * 0.02
    g = torch.Generator().manual_seed(0)
    S, bs = a.seq, 16
    tokens = torch.randint(0, a.vocab, (1, S), generator=g).to(dev)
    loss_mask = torch.ones(1, S, dtype=torch.bool, device=dev)
    loss_mask[:, :200] = False
    anchors = sample_anchors(loss_mask[0].cpu(), a.anchors, g)[None].to(dev)
    feats = (torch.randn(1, S, 5 * H, generator=g) * 0.5).to(dev, torch.bfloat16)
    blocks = build_blocks(tokens, loss_mask, anchors, bs, 248070 % a.vocab, 7.0)
    Q = anchors.shape[1] * bs
    rows = int((blocks.labels >= 0).sum())
    vis = {t: int(dense_mask(anchors, bs, S, window=(2048 if t == "sliding_attention" else None)).sum())
           for t in set(types)}
    flops = useful_flops(arch, S, Q, rows, a.vocab, vis)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    ctx_pos = torch.arange(S, device=dev)[None]
    results = {"useful_tflop_per_step": flops / 1e12, "rows": rows, "Q": Q, "S": S,
               "sparsity": {t: 1 - v / (Q * (S + Q)) for t, v in vis.items()}, "modes": {}}
    for mode in a.modes.split(","):
        model = torch.compile(drafter) if mode == "flex" else drafter
        torch.cuda.reset_peak_memory_stats()

        def step():
            attend = make_attend(mode, anchors=anchors, block_size=bs, ctx_len=S, layer_types=types,
                                 sliding_window=2048, seq_lens=torch.tensor([S], device=dev))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ctx = drafter.project_context(feats)
                emb = F.embedding(blocks.input_ids, embed)
                h = model(emb, ctx, blocks.positions, ctx_pos, attend)
                loss_sum, _ = chunked_weighted_ce(h, head, blocks.labels, blocks.weights, a.chunk)
            (loss_sum / blocks.weights.sum()).backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / a.steps
        results["modes"][mode] = {"step_ms": dt * 1e3, "first_step_s": first, "mfu": flops / dt / (a.peak_tflops * 1e12),
                                  "samples_s": 1 / dt, "tokens_s": S / dt,
                                  "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(f"\nDFlash step: {a.layers} layers, S={S}, {a.anchors} anchors x {bs}, vocab {a.vocab}; "
          f"useful {flops / 1e12:.1f} TFLOP/step; mask sparsity {results['sparsity']}")
    print(f"{'mode':<8}{'step ms':>9}{'MFU':>7}{'samples/s':>11}{'tokens/s':>10}{'first step s':>14}{'peak GiB':>10}")
    for m, r in results["modes"].items():
        print(f"{m:<8}{r['step_ms']:>9.1f}{100 * r['mfu']:>6.1f}%{r['samples_s']:>11.2f}{r['tokens_s']:>10.0f}"
              f"{r['first_step_s']:>14.1f}{r['peak_mem_gib']:>10.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
