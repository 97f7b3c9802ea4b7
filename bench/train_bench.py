"""Stage-two benchmark: one training step of the 27B-class drafter, compiled flex vs SDPA with a dense mask.

Shape: 5 layers (4 sliding-window 2048 + 1 full), hidden 5120, 32/8 heads x 128, FFN 17408, frozen
248,320 x 5120 embedding and head, one sequence of 3072 tokens, 512 anchors x block 16. The step is the
one `dflash train` runs (pipeline.masks blocks and masks, pipeline.drafter, pipeline.loss chunked CE),
bf16 autocast over fp32 weights, AdamW. Useful FLOPs: drafter body fwd+bwd (fc: fwd + weight grad),
attention over visible pairs only, lm_head fwd + input grad over labelled rows.

    python bench/train_bench.py --steps 10 --out $OUT/train.json
    python bench/train_bench.py --modes flex --cache-dir DIR   # twice: cold, then warm compile cache
    python bench/train_bench.py --attention-only               # one attention layer, flex vs SDPA dense
    python bench/train_bench.py --modes flex --profile         # top CUDA kernels of two steps
    python bench/train_bench.py --modes flex --arch dflash2    # the DFlash 2 drafter's step (issue 20)
    python bench/train_bench.py --device cpu --tiny --modes sdpa --steps 2 --arch dflash2   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/train_bench.py` puts bench/ on the path, not the repository
    sys.path.insert(0, str(ROOT))

from bench.timing import device_sync, timed  # noqa: E402
from pipeline.archs import ARCHS  # noqa: E402
from pipeline.compile_setup import inductor_workarounds
from pipeline.config import Config, DrafterConfig, TrainConfig
from pipeline.config_dflash2 import DFlash2Config
from pipeline.train_step import build_drafter, step_loss
from pipeline.drafter import DrafterArch
from pipeline.masks import build_blocks, dense_mask, make_attend, sample_anchors

TINY = dict(seq=256, anchors=16, vocab=1000, layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, selector_rank=16)  # --tiny: a CPU-sized check of the script


def useful_flops(a: DrafterArch, S: int, Q: int, rows: int, vocab: int, visible_pairs: dict) -> float:
    H, d, h, kv, F_ = a.hidden_size, a.head_dim, a.num_attention_heads, a.num_key_value_heads, a.intermediate_size
    fc = 2 * S * a.num_features * H * H * 2  # fwd + weight grad (features need no gradient)
    per_layer = 0.0
    for t in a.layer_types:
        lin = 2 * Q * H * (h * d) * 2 + 2 * (S + Q) * H * (kv * d) * 2 + 3 * 2 * Q * H * F_
        attn = 2 * 2 * visible_pairs[t] * d * h
        per_layer += 3 * (lin + attn)
    head = 2 * rows * H * vocab * 2  # logits + input gradient
    if hasattr(a, "selector_rank"):  # DFlash 2: kernel projections (2 per layer) and the selector's matmuls
        per_layer += len(a.layer_types) * 2 * 3 * 2 * Q * H * (2 * a.conv_kernel_size * a.conv_groups)
        K, r = a.selector_top_k, a.selector_rank
        head += 3 * 2 * rows * (H * r + K * H + K * r)  # P(h), the candidates' unary logits, the edge scores
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
    ap.add_argument("--cache-dir", default=None, help="inductor/triton cache (what `dflash train` keys per run)")
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compile", choices=["layers", "whole"], default="layers", help="regional (dflash train) or whole")
    ap.add_argument("--arch", choices=list(ARCHS), default="dflash", help="drafter.arch (DFlash 2: issue 20)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (with --tiny --modes sdpa: a smoke test)")
    ap.add_argument("--tiny", action="store_true", help=f"a tiny shape instead of the 27B one: {TINY}")
    a = ap.parse_args()
    shape = {k: v for k, v in TINY.items() if k not in vars(a)} if a.tiny else {}
    if a.tiny:
        a.seq, a.anchors, a.vocab, a.layers = TINY["seq"], TINY["anchors"], TINY["vocab"], TINY["layers"]
    if a.cache_dir:
        from pipeline.preflight import use_compile_cache

        use_compile_cache(a.cache_dir)
        print(f"compile cache {a.cache_dir}: {'warm' if os.path.isdir(os.path.join(a.cache_dir, 'inductor')) else 'cold'}")
    dev = torch.device(a.device)
    c = build_case(a.arch, a.layers, a.vocab, a.seq, a.anchors, a.chunk, dev, shape)
    drafter, arch, types, S, bs, anchors, blocks, Q = c.drafter, c.arch, c.types, c.S, c.bs, c.anchors, c.blocks, c.Q
    rows = int((blocks.labels >= 0).sum())
    vis = {t: int(dense_mask(anchors, bs, S, window=(2048 if t == "sliding_attention" else None)).sum())
           for t in set(types)}
    flops = useful_flops(arch, S, Q, rows, a.vocab, vis)
    results = {"arch": a.arch, "params": sum(p.numel() for p in drafter.parameters()),
               "useful_tflop_per_step": flops / 1e12, "rows": rows, "Q": Q, "S": S,
               "sparsity": {t: 1 - v / (Q * (S + Q)) for t, v in vis.items()}, "modes": {}}
    if a.attention_only:
        results["attention"] = attention_only(arch, anchors, bs, S, types, vis, a.peak_tflops)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
        return
    import torch._dynamo.utils as dyn_utils

    mask_kw = dict(anchors=anchors, block_size=bs, ctx_len=S, layer_types=types, sliding_window=2048,
                   seq_lens=torch.tensor([S], device=dev))
    sync = device_sync(dev)
    if dev.type == "cuda":  # both layer types' BlockMasks, as every step builds them
        results["mask_build_ms"] = timed(lambda: make_attend("flex", **mask_kw), sync, n=20, warmup=3) / 20 * 1e3
        print(f"block masks for one step ({len(set(types))} layer types): {results['mask_build_ms']:.2f} ms")

    for mode in a.modes.split(","):
        model = drafter
        if mode == "flex" and a.compile == "whole":
            model = torch.compile(drafter)
        elif mode == "flex":
            inductor_workarounds()  # as `dflash train` (pipeline/compile_setup.py)
            drafter.compile_layers()  # what `dflash train` does
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

        step = partial(train_step, c, mode, model)
        first = timed(step, sync)
        try:  # where the first step's time went (dynamo / aot / inductor phases)
            ctimes = dyn_utils.compile_times(repr="str", aggregate=True)[:3000] if mode == "flex" else ""
        except Exception as e:  # noqa: BLE001 - diagnostics only; the API moves between torch versions
            ctimes = f"compile_times unavailable: {e}"
        print(ctimes)
        step()
        sync()
        frames = sum(dyn_utils.counters["frames"].values())
        dt = timed(step, sync, n=a.steps) / a.steps
        recompiles = sum(dyn_utils.counters["frames"].values()) - frames
        if a.profile:
            profile(step)
        results["modes"][mode] = {"step_ms": dt * 1e3, "first_step_s": first, "mfu": flops / dt / (a.peak_tflops * 1e12),
                                  "samples_s": 1 / dt, "tokens_s": S / dt,
                                  "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
                                  "frames_compiled_after_warmup": recompiles, "compile_times": ctimes}
    print(f"\n{a.arch} step ({results['params'] / 1e6:.1f}M parameters): {a.layers} layers, S={S}, {a.anchors} anchors x {bs}, vocab {a.vocab}; "
          f"useful {flops / 1e12:.1f} TFLOP/step; mask sparsity {results['sparsity']}")
    print(f"{'mode':<8}{'step ms':>9}{'MFU':>7}{'samples/s':>11}{'tokens/s':>10}{'first step s':>14}{'peak GiB':>10}"
          f"{'recompiles':>12}")
    for m, r in results["modes"].items():
        print(f"{m:<8}{r['step_ms']:>9.1f}{100 * r['mfu']:>6.1f}%{r['samples_s']:>11.2f}{r['tokens_s']:>10.0f}"
              f"{r['first_step_s']:>14.1f}{r['peak_mem_gib']:>10.1f}{r['frames_compiled_after_warmup']:>12}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def build_case(arch: str, layers: int, vocab: int, S: int, n_anchors: int, chunk: int, dev: torch.device,
               shape: dict, prompt: int = 200) -> SimpleNamespace:
    """The 27B-class drafter (or `shape`'s tiny one) that `dflash train` builds, one sequence of S tokens whose
    first `prompt` are unlabelled, n_anchors anchors x block 16, random features, frozen embedding/head, AdamW.
    Shared with bench/long_bench.py."""
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    own = {k: v for k, v in shape.items() if k in DFlash2Config.__dataclass_fields__}  # drafter.dflash2's keys
    rest = {k: v for k, v in shape.items() if k not in own}
    cfg = Config(drafter=DrafterConfig(num_hidden_layers=layers, layer_types=types, sliding_window=2048,
                                       block_size=16, arch=arch, max_position_embeddings=max(262144, S),
                                       mask_token_id=248070 % vocab, dflash2=DFlash2Config(**own), **rest),
                 train=TrainConfig(loss_chunk_rows=chunk, gamma=7.0))
    with torch.device(dev):
        drafter = build_drafter(cfg, [1, 16, 31, 46, 61], vocab)  # what `dflash train` builds
    H = drafter.arch.hidden_size
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # CPU: fp32, no autocast
    g = torch.Generator().manual_seed(0)
    bs = 16
    tokens = torch.randint(0, vocab, (1, S), generator=g).to(dev)
    loss_mask = torch.ones(1, S, dtype=torch.bool, device=dev)
    loss_mask[:, :prompt] = False
    anchors = sample_anchors(loss_mask[0].cpu(), n_anchors, g)[None].to(dev)
    blocks = build_blocks(tokens, loss_mask, anchors, bs, cfg.drafter.mask_token_id, cfg.train.gamma)  # FLOP count
    return SimpleNamespace(
        cfg=cfg, drafter=drafter, arch=drafter.arch, types=types, S=S, bs=bs, dev=dev, tokens=tokens, anchors=anchors,
        loss_mask=loss_mask, seq_lens=torch.tensor([S], device=dev),
        blocks=blocks, Q=anchors.shape[1] * bs, ctx_pos=torch.arange(S, device=dev)[None],
        embed=torch.randn(vocab, H, device=dev, dtype=dtype) * 0.02, head=torch.randn(vocab, H, device=dev, dtype=dtype) * 0.02,
        feats=(torch.randn(1, S, 5 * H, generator=g) * 0.5).to(dev, dtype),
        opt=torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=dev.type == "cuda"))


def train_step(c: SimpleNamespace, mode: str, model=None) -> torch.Tensor:
    """One optimizer step of `dflash train` on the case (mode flex or sdpa; model: a compiled drafter); the loss.
    The forward is training's own (pipeline.train_step.step_loss: blocks, attention, drafter, loss)."""
    with torch.autocast(c.dev.type, dtype=torch.bfloat16, enabled=c.dev.type == "cuda"):
        loss_sum, _, blocks, _ = step_loss(c.drafter, c.tokens, c.loss_mask, c.anchors, c.seq_lens, c.feats, c.embed,
                                           c.head, c.cfg, mode, model=model)  # DFlash or DFlash 2
    loss = loss_sum / blocks.weights.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(c.drafter.parameters(), 1.0)
    c.opt.step()
    c.opt.zero_grad(set_to_none=True)
    return loss.detach()  # a tensor: no host sync inside timed loops


def attention_only(arch: DrafterArch, anchors, bs: int, S: int, types: list, vis: dict, peak: float) -> dict:
    """One attention call (fwd+bwd) per layer type at the step's shape: compiled flex vs SDPA + dense mask."""
    dev = anchors.device
    h, kv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    Q = anchors.shape[1] * bs
    out = {}
    print(f"\nattention alone: q [1, {h}, {Q}, {d}], k/v [1, {kv}, {S + Q}, {d}], fwd+bwd")
    print(f"{'layer type':<20}{'mode':<6}{'ms':>8}{'useful TFLOP/s':>16}")
    sync = device_sync(dev)
    for t in sorted(set(types)):
        for mode in ("flex", "sdpa") if dev.type == "cuda" else ("sdpa",):  # flex has no CPU backward (smoke runs)
            attend = make_attend(mode, anchors=anchors, block_size=bs, ctx_len=S, layer_types=[t],
                                 sliding_window=2048, seq_lens=torch.tensor([S], device=dev))
            q = torch.randn(1, h, Q, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, kv, S + Q, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, kv, S + Q, d, device=dev, dtype=torch.bfloat16, requires_grad=True)

            def run():
                attend(q, k, v, t).sum().backward()

            ms = timed(run, sync, n=20, warmup=3) / 20 * 1e3
            useful = 3 * 2 * 2 * vis[t] * d * h  # fwd (QK^T, PV) + bwd (2x), visible pairs only
            out[f"{t}/{mode}"] = {"ms": ms, "useful_tflops": useful / ms / 1e9}
            print(f"{t:<20}{mode:<6}{ms:>8.2f}{useful / ms / 1e9:>16.0f}")
    return out


def profile(step) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    cuda = torch.cuda.is_available()  # the CPU's ops in a smoke run
    with prof(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        for _ in range(2):
            step()
        if cuda:
            torch.cuda.synchronize()
    print(p.key_averages().table(sort_by=f"{'cuda' if cuda else 'cpu'}_time_total", row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
