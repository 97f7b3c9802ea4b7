"""Regeneration throughput: the embedded engine's batched generation vs the per-prompt `generate` loop a user
would otherwise write, on the same model in the same run.

The target is a random-initialised model of the real Qwen3.5/3.6-27B text layout in bf16 on one GPU:
`Qwen3_5ForCausalLM(Qwen3_5TextConfig(...))`, 64 layers = 16 x [linear_attention x 3, full_attention], hidden
5120, FFN 17408, gated attention 24/4 heads x 256, Gated DeltaNet 16 key / 48 value heads x 128, conv 4,
vocab 248,320. Random weights never emit EOS reliably, so both runs generate exactly --new-tokens per prompt
(min_new_tokens = max_new_tokens). Prompts are random ids with lengths in [--min-len, --max-len].

    python bench/regen_bench.py --out $OUT/regen.json     # one H200: 64 prompts batched vs 4 one by one
    python bench/regen_bench.py --tiny                    # CPU smoke run of the same code at a tiny size

The batched run is `stages.regen_worker.generate_ids` over the batches `plan_batches` makes (what `dflash
regenerate` runs); output tokens/s counts generated tokens over wall time, prefill included. The first lines
say which linear-attention path ran: flash-linear-attention's kernels or transformers' torch fallbacks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import time

import torch


def build_qwen3_5(layers: int, hidden: int, ffn: int, vocab: int, heads: tuple, linear_heads: tuple,
                  head_dim: int, device: str, dtype: torch.dtype):
    """A random-initialised Qwen3.5 hybrid text model (layer_types: [linear x 3, full] repeated), eval, no grad.
    (bench/extract_bench.py gains a `build_model(arch="qwen3_5")` in the hybrid work; one of them is enough.)"""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=head_dim,
        linear_num_key_heads=linear_heads[0], linear_num_value_heads=linear_heads[1], linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=8192)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def kernel_path() -> dict:
    """What is installed, and the modeling module's own verdict where it has one (`is_fast_path_available`)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    fla = importlib.util.find_spec("fla") is not None
    conv = importlib.util.find_spec("causal_conv1d") is not None
    path = ("flash-linear-attention kernels" if fla else "transformers' torch fallbacks (no flash-linear-attention)")
    return {"fla": fla, "causal_conv1d": conv, "gated_delta_rule": path,
            "conv1d": "causal-conv1d kernels" if conv else "torch fallback (no causal-conv1d)",
            "is_fast_path_available": getattr(modeling, "is_fast_path_available", None)}


class FallbackLog(logging.Handler):
    """Records the kernels transformers reports "falling back to its reference PyTorch implementation" for, at
    the call that falls back: which path really ran, whatever is installed."""

    def __init__(self):
        super().__init__()
        self.fell_back: list[str] = []
        logging.getLogger("transformers").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "falling back to its reference PyTorch implementation" in msg:
            self.fell_back.append(msg.split("`")[1] if "`" in msg else msg[:60])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model with a small vocab on the CPU")
    ap.add_argument("--prompts", type=int, default=64, help="prompts of the batched run")
    ap.add_argument("--loop-prompts", type=int, default=4, help="prompts of the per-prompt loop (the first ones)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--token-budget", type=int, default=262144)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from stages.extract_worker import plan_batches
    from stages.regen_worker import generate_ids, neutral_generation_config

    cuda = torch.cuda.is_available() and not a.tiny
    device = "cuda" if cuda else "cpu"
    if a.tiny:
        shape = dict(layers=4, hidden=128, ffn=256, vocab=1024, heads=(4, 2), linear_heads=(2, 4), head_dim=32)
        a.prompts, a.loop_prompts, a.new_tokens, a.min_len, a.max_len = min(a.prompts, 8), min(a.loop_prompts, 2), \
            min(a.new_tokens, 16), min(a.min_len, 8), min(a.max_len, 40)
    else:
        shape = dict(layers=64, hidden=5120, ffn=17408, vocab=248320, heads=(24, 4), linear_heads=(16, 48), head_dim=256)
    paths, fallbacks = kernel_path(), FallbackLog()
    print(f"regen bench: linear attention via {paths['gated_delta_rule']}; conv1d via {paths['conv1d']}"
          + (f"; modeling_qwen3_5.is_fast_path_available={paths['is_fast_path_available']}"
             if paths["is_fast_path_available"] is not None else ""), flush=True)
    t = time.perf_counter()
    model = build_qwen3_5(**shape, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e6:,.0f}M-parameter Qwen3_5ForCausalLM on {device} "
          f"in {time.perf_counter() - t:.0f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.min_len, a.max_len + 1, (a.prompts,), generator=g).tolist()
    prompts = [torch.randint(10, shape["vocab"] - 10, (n,), generator=g).tolist() for n in lengths]
    stop, pad, new = {shape["vocab"] - 1}, 0, a.new_tokens  # min_new_tokens = new: the stop id never wins

    def sync():
        if cuda:
            torch.cuda.synchronize()

    generate_ids(model, [p[:16] for p in prompts[:2]], 4, stop, pad, min_new_tokens=4)  # warm-up (untimed)
    sync()
    t = time.perf_counter()
    batched_tokens = 0
    plan = plan_batches([len(p) + new for p in prompts], a.token_budget, a.max_batch_size)
    for batch in plan:
        out = generate_ids(model, [prompts[m] for m in batch.members], new, stop, pad, min_new_tokens=new)
        batched_tokens += sum(len(toks) for toks, _ in out)
    sync()
    batched_s = time.perf_counter() - t
    model.generation_config = neutral_generation_config(stop, pad)
    t = time.perf_counter()
    loop_tokens = 0
    for p in prompts[: a.loop_prompts]:  # the plain loop: one prompt per generate call, greedy
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False)
        loop_tokens += out.shape[1] - ids.shape[1]
    sync()
    loop_s = time.perf_counter() - t
    assert batched_tokens == new * a.prompts and loop_tokens == new * a.loop_prompts, (batched_tokens, loop_tokens)
    res = {"shape": shape, "device": torch.cuda.get_device_name() if cuda else "cpu", "kernels": paths,
           "new_tokens": new, "prompt_lengths": [a.min_len, a.max_len], "batches": [len(b.members) for b in plan],
           "batched": {"prompts": a.prompts, "seconds": batched_s, "tok_s": batched_tokens / batched_s},
           "loop": {"prompts": a.loop_prompts, "seconds": loop_s, "tok_s": loop_tokens / loop_s},
           "torch_fallbacks_called": sorted(set(fallbacks.fell_back)),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "torch": torch.__version__}
    res["speedup"] = res["batched"]["tok_s"] / res["loop"]["tok_s"]
    print(f"\n{'engine':<34}{'prompts':>8}{'new tok':>9}{'seconds':>9}{'out tok/s':>11}")
    print(f"{'batched (dflash regenerate)':<34}{a.prompts:>8}{new:>9}{batched_s:>9.1f}{res['batched']['tok_s']:>11.1f}")
    print(f"{'per-prompt generate loop':<34}{a.loop_prompts:>8}{new:>9}{loop_s:>9.1f}{res['loop']['tok_s']:>11.1f}")
    ran = res["torch_fallbacks_called"]
    print(f"transformers reported torch fallbacks for: {', '.join(ran) if ran else 'none'}")
    print(f"batched / loop: {res['speedup']:.1f}x; batches {res['batches']}"
          + (f"; peak {res['peak_gib']:.1f} GiB" if cuda else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
