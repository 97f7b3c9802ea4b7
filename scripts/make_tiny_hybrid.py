"""Build a tiny replica of the real target's class in code (no download): Qwen3.5/3.6's hybrid layout.

The 27B targets are `Qwen3_5ForConditionalGeneration` (model_type qwen3_5): a vision tower plus a text model
in `text_config` whose layers are three Gated-DeltaNet linear-attention layers then one gated full-attention
layer, repeated. Their checkpoints are sharded safetensors with an index, keys `model.language_model.*`,
`model.visual.*`, `lm_head.weight` and extra `mtp.*` tensors. This script writes a directory with all of that
at toy sizes, plus the shipped tiny tokenizer (data/assets/tiny-target), so ingest, extract, train, export and
both evaluations run on it:

    python scripts/make_tiny_hybrid.py OUT_DIR [--hidden 64 --layers 8 --shards 3]

`build_tiny_hybrid(out_dir, ...)` is the same as a function (the tests build one per session into a tmp dir,
~2 MB at the default size; `--hidden 1024 --ffn 4096` gives a replica of a few hundred MB for memory tests).
The weights are random, seeded: larger than the default initialisation and with non-zero norm weights, so
greedy outputs vary and Qwen3_5RMSNorm's x*(1+w) matters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "data" / "assets" / "tiny-target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tiny_hybrid_config(vocab_size: int, hidden: int = 64, layers: int = 8, ffn: int = 0, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 32, linear_heads: tuple[int, int] = (2, 4),
                       linear_head_dim: int = 16):
    """A Qwen3_5Config with the real layer pattern and the real rope layout (partial 0.25, mrope [11,11,10]
    scaled to the head) at toy widths; a 1-block vision tower."""
    from transformers import Qwen3_5Config

    rot = int(head_dim * 0.25) // 2  # rotary pairs; mrope sections must add up to it
    sections = [rot - 2 * (rot // 3), rot // 3, rot // 3]
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn or 3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=linear_heads[0], linear_num_value_heads=linear_heads[1],
        linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=4,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": sections, "mrope_interleaved": True},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=hidden, num_position_embeddings=16)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         image_token_id=vocab_size - 4, video_token_id=vocab_size - 3,
                         vision_start_token_id=vocab_size - 2, vision_end_token_id=vocab_size - 1)


def _mtp_tensors(cfg, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Stand-ins for the checkpoint's multi-token-prediction head (`mtp.*`): the loaders must skip them."""
    t = cfg.text_config
    H = t.hidden_size
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.layers.0.mlp.up_proj.weight": (t.intermediate_size, H)}
    return {k: (0.02 * torch.randn(s, generator=gen)).to(dtype) for k, s in shapes.items()}


def build_tiny_hybrid(out_dir: str | Path, *, hidden: int = 64, layers: int = 8, ffn: int = 0, shards: int = 3,
                      seed: int = 0, dtype: str = "float32") -> Path:
    """Write the replica (config.json, sharded safetensors + model.safetensors.index.json, tokenizer) to
    out_dir; returns it. Deterministic for given arguments."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_cfg = json.loads((TOKENIZER_DIR / "config.json").read_text())
    cfg = tiny_hybrid_config(tok_cfg["vocab_size"], hidden=hidden, layers=layers, ffn=ffn)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:  # zero-centred norms: x * (1 + w)
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    state = {k: v.detach().to(tdtype).contiguous() for k, v in model.state_dict().items()}
    state.update(_mtp_tensors(cfg, tdtype, gen))
    assert any(k.startswith("model.language_model.") for k in state) and any(k.startswith("model.visual.") for k in state)

    names = sorted(state)  # spread over `shards` files of similar size, like a real sharded checkpoint
    total = sum(state[k].numel() * state[k].element_size() for k in names)
    per, files, cur, size = total / shards, [], [], 0
    for k in names:
        cur.append(k)
        size += state[k].numel() * state[k].element_size()
        if size >= per * (len(files) + 1) and len(files) < shards - 1:
            files.append(cur)
            cur = []
    files.append(cur)
    weight_map = {}
    for i, keys in enumerate(f for f in files if f):
        fname = f"model-{i + 1:05d}-of-{len([f for f in files if f]):05d}.safetensors"
        save_file({k: state[k] for k in keys}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.save_pretrained(str(out))
    gen_cfg = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, out / f)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=0, help="default 3 x hidden")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    out = build_tiny_hybrid(a.out_dir, hidden=a.hidden, layers=a.layers, ffn=a.ffn, shards=a.shards, seed=a.seed,
                            dtype=a.dtype)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
