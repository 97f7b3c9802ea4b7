"""Export a DFlash drafter (pipeline/drafter.py) as the public DFlashDraftModel contract, and load it back.

The directory's layout is pipeline/export.py's docstring (the entry points `export_drafter` / `load_exported`,
which call these through the arch registry, pipeline/archs.py); its shared parts are pipeline/export_dir.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from .drafter import DFlashDrafter, DrafterArch
from .export_dir import MODELING_FILES, contract_keys, export_state, finish_load, hf_config_dict, write_files

ARCHITECTURE = "DFlashDraftModel"


def export_dflash(
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
    arch = arch or drafter.arch
    state = export_state(drafter, dtype)
    expected = contract_keys(arch.num_hidden_layers)
    if sorted(state) != expected:
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise ValueError(f"export_drafter: state_dict keys differ from the contract: extra {extra}, missing {missing}")
    cfg = hf_config_dict(arch, vocab_size=vocab_size, num_target_layers=num_target_layers,
                         tie_word_embeddings=tie_word_embeddings, dtype=dtype, for_sglang=for_sglang)
    return write_files(out_dir, state, cfg, MODELING_FILES, extra_metadata)


def load_exported1(path: Path, meta: dict, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None):
    """A DFlashDraftModel directory -> (DFlashDrafter, DrafterArch, meta) (called by pipeline.export.load_exported)."""
    from .arch_sizes import check_sizes
    from .ckpt_io import require_regular

    weights = Path(path) / "model.safetensors"
    require_regular(weights, "export's weights file")
    state = load_file(str(weights))
    check_sizes(meta, {k: tuple(v.shape) for k, v in state.items()}, str(path),
                lambda: DFlashDrafter(DrafterArch.from_exported(meta)))  # before any tensor is allocated
    arch = DrafterArch.from_exported(meta)
    expected = contract_keys(arch.num_hidden_layers)
    if sorted(state) != expected:
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise ValueError(f"{path}/model.safetensors: keys differ from the contract: extra {extra}, missing {missing}")
    return finish_load(path, meta, DFlashDrafter(arch), state, device, dtype)
