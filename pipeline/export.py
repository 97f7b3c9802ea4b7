"""Export a trained drafter as the serving contract (design brief section 6) and load it back.

    out_dir/
      config.json          architectures ["DFlashDraftModel"], model_type "qwen3", block_size, num_target_layers,
                           dflash_config {mask_token_id, target_layer_ids, block_size}, the Qwen3 shape fields,
                           layer_types (+ use_sliding_window/sliding_window when used), no partial_rotary_factor,
                           is_causal only when drafter.is_causal is set (absent: sliding layers causal inside the
                           block, full layers bidirectional, as z-lab's reference model reads it),
                           auto_map (unless for_sglang)
      model.safetensors    exactly the contract keys (`contract_keys`): no embedding, no lm_head
      modeling_dflash.py   pipeline/modeling_dflash.py: transformers PreTrainedModel wrapper (trust_remote_code) with
                           our forward and z-lab's (forward(position_ids, noise_embedding=, target_hidden=,
                           past_key_values=), spec_generate), importing:
      drafter.py, masks.py, target_cache.py   verbatim copies of pipeline/drafter.py, masks.py (the same math)
                           and target_cache.py (spec_generate's target cache rollback, hybrid targets included)
      dflash_meta.json     optional provenance (`extra_metadata`), read by nobody but us
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from .drafter import DFlashDrafter, DrafterArch
from .target import DTYPES

_SRC = Path(__file__).resolve().parent

_LAYER_KEYS = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def contract_keys(num_layers: int) -> list[str]:
    """The safetensors keys the public DFlash loaders expect (sorted)."""
    keys = [f"layers.{i}.{k}" for i in range(num_layers) for k in _LAYER_KEYS]
    return sorted(keys + ["fc.weight", "hidden_norm.weight", "norm.weight"])


# transformers wrapper (trust_remote_code) with the serving contract's and z-lab's calling conventions and
# spec_generate; it imports drafter.py, masks.py and target_cache.py, copied beside it
MODELING_FILE = (_SRC / "modeling_dflash.py").read_text()
MODELING_HELPERS = ("drafter.py", "masks.py", "target_cache.py")


def _check(name: str, given, expected) -> None:
    if given is not None and given != expected:
        raise ValueError(f"export_drafter: {name}={given!r} differs from the drafter's arch ({expected!r})")


def hf_config_dict(
    arch: DrafterArch,
    *,
    vocab_size: int,
    num_target_layers: int,
    tie_word_embeddings: bool = False,
    dtype: str = "bfloat16",
    for_sglang: bool = False,
) -> dict:
    sliding = arch.uses_sliding()
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": arch.block_size,
        "num_target_layers": int(num_target_layers),
        "dflash_config": {
            "mask_token_id": int(arch.mask_token_id),
            "target_layer_ids": [int(i) for i in arch.target_layer_ids],
            "block_size": arch.block_size,
        },
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": arch.num_hidden_layers,
        "vocab_size": int(vocab_size),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_parameters": {"rope_theta": arch.rope_theta, "rope_type": "default"},
        "max_position_embeddings": arch.max_position_embeddings,
        "initializer_range": arch.initializer_range,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "layer_types": list(arch.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": arch.sliding_window if sliding else None,
        "max_window_layers": arch.num_hidden_layers,
        "use_cache": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch.is_causal is not None:  # absent = z-lab's default (sliding layers causal in the block, full not)
        cfg["is_causal"] = bool(arch.is_causal)
    if not for_sglang:
        cfg["auto_map"] = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    return cfg


def export_drafter(
    drafter: DFlashDrafter,
    arch: Optional[DrafterArch],
    out_dir: str | Path,
    *,
    vocab_size: int,
    num_target_layers: int,
    tie_word_embeddings: bool = False,
    dtype: str = "bfloat16",
    for_sglang: bool = False,
    extra_metadata: Optional[dict] = None,
) -> Path:
    """Write the exported drafter directory; returns its path.

    arch: the drafter's (None: drafter.arch); the layer ids, mask token and block size come from it.
    num_target_layers and vocab_size describe the target (its layer count and vocabulary). dtype: the saved
    weights' dtype. for_sglang: omit auto_map (SGLang rejects it); the modeling files are still written.
    """
    if hasattr(drafter, "candidate_selector"):  # DFlash 2: its own contract (pipeline/export2.py)
        from .export2 import export_dflash2

        return export_dflash2(drafter, out_dir, vocab_size=vocab_size, num_target_layers=num_target_layers,
                              tie_word_embeddings=tie_word_embeddings, dtype=dtype, for_sglang=for_sglang,
                              extra_metadata=extra_metadata)
    arch = arch or drafter.arch
    if dtype not in DTYPES:
        raise ValueError(f"export_drafter: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    state = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in drafter.state_dict().items()}
    expected = contract_keys(arch.num_hidden_layers)
    if sorted(state) != expected:
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise ValueError(f"export_drafter: state_dict keys differ from the contract: extra {extra}, missing {missing}")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    cfg = hf_config_dict(arch, vocab_size=vocab_size, num_target_layers=num_target_layers,
                         tie_word_embeddings=tie_word_embeddings, dtype=dtype, for_sglang=for_sglang)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "modeling_dflash.py").write_text(MODELING_FILE)
    for helper in MODELING_HELPERS:
        shutil.copyfile(_SRC / helper, out / helper)
    if extra_metadata is not None:
        (out / "dflash_meta.json").write_text(json.dumps(extra_metadata, indent=2, default=str) + "\n")
    return out


def load_exported(path: str | Path, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None):
    """Load an exported directory into our own module: (DFlashDrafter, DrafterArch, meta: the config dict,
    plus dflash_meta.json's content under "dflash_meta" when present). Keys must match the contract exactly."""
    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    if "partial_rotary_factor" in meta:
        raise ValueError(f"{path}/config.json has partial_rotary_factor: the drafter uses full rotary embeddings")
    if "DFlash2DraftModel" in (meta.get("architectures") or []):  # DFlash 2 (pipeline/export2.py)
        from .export2 import load_exported2

        return load_exported2(path, meta, device, dtype)
    arch = DrafterArch.from_exported(meta)
    state = load_file(str(path / "model.safetensors"))
    expected = contract_keys(arch.num_hidden_layers)
    if sorted(state) != expected:
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise ValueError(f"{path}/model.safetensors: keys differ from the contract: extra {extra}, missing {missing}")
    drafter = DFlashDrafter(arch)
    drafter.load_state_dict(state, strict=True)
    drafter.to(device=device, dtype=dtype or state["fc.weight"].dtype)
    if (path / "dflash_meta.json").exists():
        meta["dflash_meta"] = json.loads((path / "dflash_meta.json").read_text())
    return drafter.eval(), arch, meta
