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
      drafter.py, masks.py, acceptance.py, target_cache.py   verbatim copies of pipeline/drafter.py, masks.py
                           (the same math), acceptance.py (spec_generate's greedy and rejection rules, the
                           online eval's) and target_cache.py (spec_generate's target cache rollback, hybrid
                           targets included)
      dflash_meta.json     optional provenance (`extra_metadata`), read by nobody but us
      checksums.sha256     the sha256 of every other file, in `sha256sum -c` format (`CHECKSUMS`); `load_exported`
                           (eval) and `--init-from` verify it when present (`verify_checksums`): a flipped byte
                           is refused with the file's name

The directory is written whole or not at all: into a temporary directory beside OUT, renamed into place. An OUT
that already holds an export (its config.json names a DFlash architecture) is replaced, so no stale file of
the earlier export (e.g. another arch's modeling file) survives; a non-empty OUT that is not an export is
refused (`ExportError`) before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from .drafter import DFlashDrafter, DrafterArch
from .export2 import export_dflash2, load_exported2
from .export_dir import (_SRC, CHECKSUMS, MODELING_FILE, MODELING_HELPERS, ExportError, _check,  # noqa: F401
                         _is_export, _replace_dir, contract_keys, hf_config_dict, verify_checksums,
                         write_checksums)
from .target import DTYPES

def export_drafter(
    drafter: DFlashDrafter,
    arch: Optional[DrafterArch],
    out_dir: str | Path,
    **kw,
) -> Path:
    """Write the exported drafter directory (see `_write_export` for the arguments) whole, with its checksums;
    returns its path. See the module contract for an OUT that already exists."""
    out = Path(out_dir)
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not _is_export(out)):
        raise ExportError(f"{out} is not empty and does not hold a DFlash export: refusing to mix the export with "
                          "its files; pass a new or empty directory (or an earlier export, which is replaced)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(drafter, arch, tmp, **kw)
        write_checksums(tmp)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_export(
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
    """Write the exported drafter directory into out_dir (a fresh temporary one: export_drafter).

    arch: the drafter's (None: drafter.arch); the layer ids, mask token and block size come from it.
    num_target_layers and vocab_size describe the target (its layer count and vocabulary). dtype: the saved
    weights' dtype. for_sglang: omit auto_map (SGLang rejects it); the modeling files are still written.
    """
    if hasattr(drafter, "candidate_selector"):  # DFlash 2: its own contract (pipeline/export2.py)
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
    verify_checksums(path)
    meta = json.loads((path / "config.json").read_text())
    if "partial_rotary_factor" in meta:
        raise ValueError(f"{path}/config.json has partial_rotary_factor: the drafter uses full rotary embeddings")
    if "DFlash2DraftModel" in (meta.get("architectures") or []):  # DFlash 2 (pipeline/export2.py)
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
