"""The export directory every drafter arch writes (pipeline/export.py, pipeline/export2.py): the serving contract's
weight names (`contract_keys`), the transformers config.json fields (`hf_config_dict`), the one writer of the
directory's files (`write_files`: weights, config.json, the modeling file and its helpers copied beside them,
dflash_meta.json) and the one tail of loading them back (`finish_load`: non-finite weights are refused by tensor
name, `refuse_non_finite`), the checksum file (`write_checksums` / `verify_checksums`: when present it must
list every weight, config and code file, `COVERED_SUFFIXES`) and the whole-directory replace (`_replace_dir`). The layout and its rules are in
pipeline/export.py's docstring.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from .drafter import DrafterArch
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


# the transformers wrapper (trust_remote_code) with the serving contract's and z-lab's calling conventions and
# spec_generate (pipeline/modeling_dflash.py), and what it imports (acceptance.py: spec_generate's verify rules),
# copied beside it; DFlash 2 adds its own (checksums.sha256 lists every file of the directory)
MODELING_FILES = ("modeling_dflash.py", "drafter.py", "masks.py", "acceptance.py", "target_cache.py")


def _check(name: str, given, expected) -> None:
    if given is not None and given != expected:
        raise ValueError(f"export_drafter: {name}={given!r} differs from the drafter's arch ({expected!r})")


def export_state(drafter: nn.Module, dtype: str) -> dict:
    """The drafter's weights as saved: on the CPU, in `dtype` (a DTYPES name), contiguous."""
    if dtype not in DTYPES:
        raise ValueError(f"export_drafter: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in drafter.state_dict().items()}


def write_files(out_dir: str | Path, state: dict, cfg: dict, files: Sequence[str],
                extra_metadata: Optional[dict] = None) -> Path:
    """The one writer of an export directory's files, into a fresh directory (pipeline.export.export_drafter adds
    the checksums and renames it into place): model.safetensors (state), config.json (cfg), `files` copied from
    pipeline/ (the modeling file and the torch-only modules it imports), dflash_meta.json (extra_metadata)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in files:
        shutil.copyfile(_SRC / name, out / name)
    if extra_metadata is not None:
        (out / "dflash_meta.json").write_text(json.dumps(extra_metadata, indent=2, default=str) + "\n")
    return out


def finish_load(path: str | Path, meta: dict, drafter: nn.Module, state: dict,
                device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None):
    """The end of loading an export (its keys checked against the arch's contract): the weights into `drafter`
    (strict), on `device` in `dtype` (None: the saved one), dflash_meta.json into meta["dflash_meta"] ->
    (drafter in eval mode, its arch, meta)."""
    refuse_non_finite(state.items(), f"{path}/model.safetensors")
    drafter.load_state_dict(state, strict=True)
    drafter.to(device=device, dtype=dtype or state["fc.weight"].dtype)
    if (Path(path) / "dflash_meta.json").exists():
        from .ckpt_io import require_regular

        require_regular(Path(path) / "dflash_meta.json", "export's dflash_meta.json")
        meta["dflash_meta"] = json.loads((Path(path) / "dflash_meta.json").read_text())
    return drafter.eval(), drafter.arch, meta


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


class ExportError(UserError, ValueError):
    """An export directory that cannot be written (a non-empty OUT that is not an export) or that fails its
    checksums (a damaged file); the message names the directory or the file and the fix."""


def write_checksums(d: Path) -> None:
    from .checkpoint import sha256_file

    names = sorted(f.name for f in Path(d).iterdir() if f.is_file() and f.name != CHECKSUMS)
    (Path(d) / CHECKSUMS).write_text("".join(f"{sha256_file(Path(d) / n)}  {n}\n" for n in names))


def add_checksum(d: Path, name: str) -> None:
    """Put d/name's entry into d/checksums.sha256 (replacing an older one), when the export has checksums: a file
    written into a verified export afterwards (`dflash eval`'s dflash_tau.json, stages/eval_record.py)."""
    from .checkpoint import sha256_file

    listed = Path(d) / CHECKSUMS
    if not listed.is_file():
        return
    lines = [line for line in listed.read_text().splitlines() if line.partition("  ")[2] != name]
    lines = sorted(lines + [f"{sha256_file(Path(d) / name)}  {name}"], key=lambda line: line.partition("  ")[2])
    tmp = listed.with_name(f".{CHECKSUMS}.tmp{os.getpid()}")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, listed)


# the files an export's checksums must list when present: weights, configs and records, and code it runs
COVERED_SUFFIXES = (".safetensors", ".json", ".py", ".bin", ".pt", ".pth")


def verify_checksums(d: str | Path, what: str = "") -> bool:
    """Check every file listed in d/checksums.sha256 (False when the export has none: an older or foreign one);
    raise ExportError naming the first file that is missing or differs, or a weight, config or code file
    (`COVERED_SUFFIXES`) of the directory that the list leaves out (a checksum file that protects nothing)."""
    from .checkpoint import sha256_file

    d = Path(d)
    listed = d / CHECKSUMS
    if not listed.is_file():
        return False
    names = {line.partition("  ")[2] for line in listed.read_text().splitlines()}
    unlisted = sorted(f.name for f in d.iterdir() if f.name not in names and f.name != CHECKSUMS
                      and f.suffix in COVERED_SUFFIXES and not f.is_dir())
    if unlisted:
        raise ExportError(f"{what}{d / unlisted[0]} is not covered by {listed} (the list must name every weight, "
                          "config and code file); copy the export again or re-export it (`dflash export RUN DIR`)")
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


def refuse_non_finite(tensors, where: str, what: str = "") -> None:
    """(name, tensor) pairs of a weights file `where`: ExportError naming the first tensor that holds a NaN or an
    inf (checksums pass a file written that way; training from it would stop at its first step)."""
    for name, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ExportError(f"{what}{where}: tensor {name} holds {bad} non-finite value(s) (NaN or inf): the drafter "
                              "diverged or the file was damaged; export it again from a good checkpoint "
                              "(`dflash export RUN DIR`)")


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


