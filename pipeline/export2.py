"""Export a DFlash 2 drafter (pipeline/drafter2.py) as the public DFlash2DraftModel contract, and load it back.

    out_dir/
      config.json          DFlash's config (pipeline/export.py `hf_config_dict`) with architectures
                           ["DFlash2DraftModel"] and dflash_config += conv_kernel_size, conv_group_size,
                           selector_rank, selector_top_k (+ output_multiplier / final_logit_softcapping only
                           when they differ from 1 / none: engines default them so); vocab_size = the codebooks'
                           rows; `is_causal` as DFlash's (written only when drafter.is_causal is set: false for
                           the published layout, bidirectional inside the block); auto_map -> modeling_dflash2
                           (unless for_sglang)
      model.safetensors    exactly `contract_keys2`: DFlash's keys + layers.N.{attention,mlp}_conv.{base_kernel
                           [2, T, H], kernel_projection.weight [2*T*G, H]} + candidate_selector.{hidden_projection
                           .weight [r, H], predecessor_codebook [V, r], successor_codebook [V, r]}
      modeling_dflash2.py  pipeline/modeling_dflash2.py: the transformers wrapper (trust_remote_code), DFlash's
                           (modeling_dflash.py, copied alongside) with the DFlash 2 modules and `select` (the walk)
      drafter.py, drafter2.py, masks.py, acceptance.py, target_cache.py   verbatim copies (the same math as
                           training; acceptance.py: spec_generate's verify rules)
Contract sources: see pipeline/drafter2.py's docstring (z-lab's checkpoint header and config, vLLM PR #52816,
SGLang PR #35371's loader names, SpecForge PR #772's export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from .drafter2 import DFLASH2_KEYS, DFlash2Arch, DFlash2Drafter
from .export_dir import MODELING_FILES, _check, contract_keys, export_state, finish_load, hf_config_dict, write_files

ARCHITECTURE = "DFlash2DraftModel"
_CONV_KEYS = ("base_kernel", "kernel_projection.weight")
_SELECTOR_KEYS = ("hidden_projection.weight", "predecessor_codebook", "successor_codebook")


def contract_keys2(num_layers: int) -> list[str]:
    """The safetensors keys of a DFlash2DraftModel (sorted)."""
    conv = [f"layers.{i}.{side}.{k}" for i in range(num_layers) for side in ("attention_conv", "mlp_conv")
            for k in _CONV_KEYS]
    return sorted(contract_keys(num_layers) + conv + [f"candidate_selector.{k}" for k in _SELECTOR_KEYS])


def contract_shapes2(arch: DFlash2Arch) -> dict[str, tuple]:
    """The DFlash 2 tensors' shapes (the DFlash ones are the backbone's)."""
    H, T, G, r, V = arch.hidden_size, arch.conv_kernel_size, arch.conv_groups, arch.selector_rank, arch.vocab_size
    shapes = {f"layers.{i}.{side}.{k}": s for i in range(arch.num_hidden_layers) for side in ("attention_conv", "mlp_conv")
              for k, s in (("base_kernel", (2, T, H)), ("kernel_projection.weight", (2 * T * G, H)))}
    shapes.update({"candidate_selector.hidden_projection.weight": (r, H), "candidate_selector.predecessor_codebook": (V, r),
                   "candidate_selector.successor_codebook": (V, r)})
    return shapes


# the transformers wrapper (pipeline/modeling_dflash2.py) and the DFlash 2 math it imports, beside DFlash's files
FILES2 = (*MODELING_FILES, "modeling_dflash2.py", "drafter2.py")


def export_dflash2(drafter: DFlash2Drafter, arch: Optional[DFlash2Arch], out_dir: str | Path, *, vocab_size: int,
                   num_target_layers: int, tie_word_embeddings: bool = False, dtype: str = "bfloat16",
                   for_sglang: bool = False, extra_metadata: Optional[dict] = None) -> Path:
    """As pipeline/export1.py's `export_dflash` (pipeline.export.export_drafter calls this for a DFlash 2 drafter,
    through the arch registry)."""
    arch = arch or drafter.arch
    _check("vocab_size", int(vocab_size), arch.vocab_size)
    state = export_state(drafter, dtype)
    _require_contract(state, arch, "export_drafter: the drafter's state_dict")
    cfg = hf_config_dict(arch, vocab_size=vocab_size, num_target_layers=num_target_layers,
                         tie_word_embeddings=tie_word_embeddings, dtype=dtype, for_sglang=for_sglang)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["dflash_config"].update({k: int(getattr(arch, k)) for k in DFLASH2_KEYS})
    if arch.output_multiplier != 1.0:
        cfg["dflash_config"]["output_multiplier"] = float(arch.output_multiplier)
    if arch.final_logit_softcapping:
        cfg["dflash_config"]["final_logit_softcapping"] = float(arch.final_logit_softcapping)
    if not for_sglang:
        cfg["auto_map"] = {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}
    return write_files(out_dir, state, cfg, FILES2, extra_metadata)


def _require_contract(state: dict, arch: DFlash2Arch, what: str) -> None:
    expected = contract_keys2(arch.num_hidden_layers)
    if sorted(state) != expected:
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise ValueError(f"{what}: keys differ from the DFlash 2 contract: extra {extra}, missing {missing}")
    bad = [f"{k} {tuple(state[k].shape)} (expected {s})" for k, s in contract_shapes2(arch).items()
           if tuple(state[k].shape) != s]
    if bad:
        raise ValueError(f"{what}: shapes differ from the config: {'; '.join(bad[:4])}")


def load_exported2(path: Path, meta: dict, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None):
    """A DFlash2DraftModel directory -> (DFlash2Drafter, DFlash2Arch, meta) (pipeline.export.load_exported calls
    this through the arch registry)."""
    from .arch_sizes import check_sizes
    from .ckpt_io import require_regular

    weights = Path(path) / "model.safetensors"
    require_regular(weights, "export's weights file")
    state = load_file(str(weights))
    check_sizes(meta, {k: tuple(v.shape) for k, v in state.items()}, str(path),
                lambda: DFlash2Drafter(DFlash2Arch.from_exported(meta)))  # before any tensor is allocated
    arch = DFlash2Arch.from_exported(meta)
    _require_contract(state, arch, f"{path}/model.safetensors")
    return finish_load(path, meta, DFlash2Drafter(arch), state, device, dtype)
