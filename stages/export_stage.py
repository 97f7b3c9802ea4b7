"""`dflash export CKPT OUT`: turn a training checkpoint into the serving directory (see pipeline/export.py).

Contract: reads only the checkpoint (which records the drafter's arch, the target's layer count, vocabulary
and tie flag); writes OUT/config.json, OUT/model.safetensors and the modeling file for transformers'
trust_remote_code. `for_sglang=True` leaves out `auto_map`. Also loads a checkpoint's drafter for eval.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.drafter import DFlashDrafter
from pipeline.drafter2 import build_from_arch_dict
from pipeline.export import export_drafter


def load_checkpoint_drafter(ckpt_path: str, device: str | torch.device = "cpu") -> tuple[DFlashDrafter, dict]:
    """(drafter in eval mode, the checkpoint's dflash metadata: config, layer ids, target, store)."""
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    meta = ckpt.get("dflash")
    if meta is None:
        raise FileNotFoundError(f"{ckpt_path} is not a dflash training checkpoint (no 'dflash' metadata)")
    drafter = build_from_arch_dict(meta["arch"])  # DFlash or DFlash 2, as recorded
    state = {k.removeprefix("drafter."): v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    drafter.load_state_dict(state)
    return drafter.to(device).eval(), meta


def export_checkpoint(ckpt_path: str, out_dir: str, for_sglang: bool = False, dtype: str = "bfloat16") -> Path:
    drafter, meta = load_checkpoint_drafter(ckpt_path)
    target = meta["target"]
    return export_drafter(
        drafter, drafter.arch, out_dir, vocab_size=int(meta["vocab_size"]),
        num_target_layers=int(target["num_hidden_layers"]), tie_word_embeddings=bool(target.get("tie_word_embeddings")),
        dtype=dtype, for_sglang=for_sglang,
        extra_metadata={"target": target.get("name"), "store": meta.get("store"), "checkpoint": str(ckpt_path)},
    )
