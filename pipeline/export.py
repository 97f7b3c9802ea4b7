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
      dflash_tau.json      what eval measured of this drafter, or why nothing was (pipeline/tau_record.py; who
                           writes it: stages/eval_record.py)
      checksums.sha256     the sha256 of every other file, in `sha256sum -c` format (`CHECKSUMS`); `load_exported`
                           (eval) and `--init-from` verify it when present (`verify_checksums`): a flipped byte
                           is refused with the file's name

That is DFlash's (pipeline/export1.py); DFlash 2's (pipeline/export2.py) adds its keys, weights and modeling file.
Which arch's files a drafter writes, and which loader an export's config.json `architectures` names, is the arch
registry's (pipeline/archs.py); all of them write through pipeline/export_dir.py's `write_files`.

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

from .archs import architectures, spec_for_export, spec_of
from .drafter import DFlashDrafter, DrafterArch
from .export_dir import (CHECKSUMS, ExportError, _replace_dir, contract_keys, hf_config_dict,  # noqa: F401
                         verify_checksums, write_checksums)


def _is_export(d: Path) -> bool:
    """d/config.json names an architecture of ours (pipeline/archs.py)."""
    if not (d / "config.json").is_file():  # a FIFO (require_regular) or nothing: not an export
        return False
    try:
        return any(a in architectures() for a in json.loads((d / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def export_drafter(
    drafter: DFlashDrafter,
    arch: Optional[DrafterArch],
    out_dir: str | Path,
    tau: Optional[dict] = None,
    **kw,
) -> Path:
    """Write the exported drafter directory whole, with its checksums; returns its path. The files are the
    drafter's arch's (pipeline/archs.py `export`: pipeline/export1.py's `export_dflash` describes the arguments,
    arch None: drafter.arch); `tau`: the τ record written as dflash_tau.json (pipeline/tau_record.py; `dflash
    export` always passes one, stages/eval_record.py). See the module contract for an OUT that already exists."""
    out = Path(out_dir)
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not _is_export(out)):
        raise ExportError(f"{out} is not empty and does not hold a DFlash export: refusing to mix the export with "
                          "its files; pass a new or empty directory (or an earlier export, which is replaced)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        spec_of(drafter).export(drafter, arch, tmp, **kw)
        if tau is not None:
            from .tau_record import write_tau

            write_tau(tmp, tau)  # before the checksums: they cover it
        write_checksums(tmp)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_exported(path: str | Path, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None):
    """Load an exported directory into our own module: (DFlashDrafter, DrafterArch, meta: the config dict,
    plus dflash_meta.json's content under "dflash_meta" when present). Keys must match the contract exactly."""
    path = Path(path)
    verify_checksums(path)
    meta = _export_config(path)
    if "partial_rotary_factor" in meta:
        raise ValueError(f"{path}/config.json has partial_rotary_factor: the drafter uses full rotary embeddings")
    check_weights_header(path / "model.safetensors")
    return spec_for_export(meta).load_export(path, meta, device, dtype)  # its arch's loader (pipeline/archs.py)


_REEXPORT = "the export is damaged or was edited: export the run again (`dflash export RUN DIR`)"


def _export_config(path: Path) -> dict:
    """config.json of an export as a dict, else one ExportError naming the file and the fix (its sizes are the
    arch loader's to check: pipeline/archs.py `check_sizes`)."""
    from .ckpt_io import require_regular

    require_regular(path / "config.json", "export's config.json")  # a FIFO would block the read forever
    try:
        meta = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}/config.json is not readable JSON ({str(e).splitlines()[0]}); {_REEXPORT}") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{path}/config.json is not a JSON object; {_REEXPORT}")
    return meta


def check_weights_header(f: Path, what: str = "", fix: str = _REEXPORT) -> None:
    """model.safetensors' header parses and every tensor it lists lies inside the file, else one ExportError
    (`what` heads the message, `fix` ends it; eval's loading and --init-from's check, stages/init_from.py)."""
    from safetensors import safe_open

    from .ckpt_io import require_regular

    require_regular(f, "export's weights file")  # safetensors would block on a FIFO, beyond any signal's reach

    try:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                fh.get_slice(k).get_shape()
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (no public base)
        raise ExportError(f"{what}{f} is not a readable safetensors file ({str(e).splitlines()[0]}): truncated or "
                          f"damaged; {fix}") from None
