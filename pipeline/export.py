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
from .errors import UserError
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


CHECKSUMS = "checksums.sha256"
_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


class ExportError(UserError, ValueError):
    """An export directory that cannot be written (a non-empty OUT that is not an export) or that fails its
    checksums (a damaged file); the message names the directory or the file and the fix."""


def _is_export(d: Path) -> bool:
    try:
        return any(a in _ARCHITECTURES for a in json.loads((d / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def write_checksums(d: Path) -> None:
    from .checkpoint import sha256_file

    names = sorted(f.name for f in Path(d).iterdir() if f.is_file() and f.name != CHECKSUMS)
    (Path(d) / CHECKSUMS).write_text("".join(f"{sha256_file(Path(d) / n)}  {n}\n" for n in names))


def verify_checksums(d: str | Path, what: str = "") -> bool:
    """Check every file listed in d/checksums.sha256 (False when the export has none: an older or foreign one);
    raise ExportError naming the first file that is missing or differs."""
    from .checkpoint import sha256_file

    d = Path(d)
    listed = d / CHECKSUMS
    if not listed.is_file():
        return False
    for n, line in enumerate(listed.read_text().splitlines(), 1):
        digest, _, name = line.partition("  ")
        if not name or "/" in name or len(digest) != 64:
            raise ExportError(f"{what}{listed}:{n}: not a '<sha256>  <file>' line; re-export the drafter")
        f = d / name
        if not f.is_file():
            raise ExportError(f"{what}{f} is missing (listed in {listed}); the export is incomplete: copy it again")
        if sha256_file(f) != digest:
            raise ExportError(f"{what}{f} is damaged: its sha256 differs from {listed}'s; copy the export again "
                              f"or re-export it (`dflash export RUN DIR`); edited on purpose: remove {listed}")
    return True


def _replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished directory `tmp` at `out`, replacing an earlier export there (never a half-written one)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


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
    verify_checksums(path)
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
