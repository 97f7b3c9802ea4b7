"""Warm start: `dflash train --init-from EXPORT_DIR` (or `drafter.init_from`) begins from an exported drafter.

Contract:
- EXPORT_DIR is a serving directory (config.json + model.safetensors): ours (pipeline/export.py,
  pipeline/export2.py) or a published DFlash checkpoint in the same public format (z-lab's). Only the
  weights are taken: the optimizer, the LR schedule and the data position start fresh (unlike `--resume`,
  which continues a run of this run directory from its last.ckpt; the two are refused together).
- `check_init_from(cfg, attrs, layer_ids, path)` runs before anything is written (no run directory yet) and
  raises one ConfigError naming every difference between the export and this config/store, each with its fix:
  the target side (hidden size, target layer ids, vocabulary), the drafter side (layers, block size, heads,
  FFN, head_dim, attention layer types and window, mask token, `is_causal`: the attention rule inside the
  block, so a fine-tune never changes it silently) and, for DFlash 2, its extra shape keys.
  Before that, the export's files are checked (`check_weights_file`): its checksums.sha256 when present (a
  flipped byte names the file; a weight, config or code file it leaves out is refused), model.safetensors'
  header and length (a truncated or damaged file) and its values (a NaN or inf named by tensor), one line.
- Which exports fit which drafter (`drafter.arch`; each arch's `warm_start_from` in pipeline/archs.py):
    DFlash export   -> dflash:  every weight (strict);
    DFlash export   -> dflash2: the backbone (pipeline.train_step.warm_start: convolutions identity,
                                selector fresh);
    DFlash 2 export -> dflash2: every weight (strict);
    DFlash 2 export -> dflash:  refused (a DFlash drafter has no place for the convolutions and selector;
                                set drafter.arch=dflash2).
- The weights are copied by pipeline.train_step.init_weights, from build_drafter on every rank (DDP then
  starts all ranks from the same weights).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.archs import ARCHS, architectures, spec_for, spec_for_export
from pipeline.config import Config, ConfigError

# the shape keys an arch adds live in its export's dflash_config (with mask_token_id)
_DFLASH_CONFIG_KEYS = ("mask_token_id", *(k for spec in ARCHS.values() for k in spec.config_keys))


def read_export_config(path: str) -> dict:
    """config.json of an export directory, or a ConfigError saying what an export directory holds."""
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise ConfigError(f"--init-from {path}: not an exported drafter (needs config.json and model.safetensors, "
                          "as RUN/export or a published DFlash checkpoint has); for a training checkpoint run "
                          "`dflash export CKPT DIR` first")
    try:
        meta = json.loads((p / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--init-from {path}: config.json is not readable JSON ({e})") from None
    archs = meta.get("architectures") or []
    if not any(a in archs for a in architectures()):
        raise ConfigError(f"--init-from {path}: config.json names architectures {archs}, not "
                          f"{' or '.join(architectures())}: not a DFlash drafter export")
    return meta


def _export_value(meta: dict, key: str):
    d = meta.get("dflash_config") or {}
    if key == "target_layer_ids":
        return [int(i) for i in d.get("target_layer_ids", [])]
    if key in _DFLASH_CONFIG_KEYS:
        return d.get(key, meta.get(key))
    if key == "block_size":
        return int(d.get("block_size", meta.get("block_size", 16)))
    if key == "layer_types":
        return list(meta.get("layer_types") or ["full_attention"] * int(meta["num_hidden_layers"]))
    if key == "sliding_window":
        types = _export_value(meta, "layer_types")
        return meta.get("sliding_window") if "sliding_attention" in types and meta.get("use_sliding_window", True) else None
    return meta.get(key)


def _wrong_type(key: str, value, section: type) -> str:
    """"" when an export's value fits KEY's type in its config section (DrafterConfig, or an arch's section
    class), else what that type is."""
    import typing

    from pipeline.config import _check_type

    try:
        _check_type(value, typing.get_type_hints(section)[key], key)
    except ConfigError as e:
        return str(e).split(": ", 1)[1].split(", got ")[0].replace("expected", "not", 1)
    return ""


def differences(cfg: Config, attrs: dict, layer_ids: list[int], meta: dict) -> list[str]:
    """One line per field where the export does not fit, each with its fix."""
    d, target = cfg.drafter, attrs["target"]
    diffs = []
    # the target side: fixed by the store, so the fix is another export (or another store)
    other = "warm-start from a drafter trained for this target (or train without --init-from)"
    if _export_value(meta, "hidden_size") != attrs["hidden_size"]:
        diffs.append(f"hidden size: the export has {_export_value(meta, 'hidden_size')}, the store's target "
                     f"{attrs['hidden_size']}; {other}")
    if _export_value(meta, "target_layer_ids") != list(layer_ids):
        diffs.append(f"target layer ids: the export conditions on {_export_value(meta, 'target_layer_ids')}, the "
                     f"store holds {list(layer_ids)}; extract a store with target.layer_ids="
                     f"{_export_value(meta, 'target_layer_ids')}, or {other}")
    if _export_value(meta, "vocab_size") != target["vocab_size"]:
        diffs.append(f"vocabulary: the export was made for {_export_value(meta, 'vocab_size')} tokens, the store's "
                     f"target has {target['vocab_size']}; {other}")
    # the drafter side: the config can follow the export
    fields = ["num_hidden_layers", "block_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "mask_token_id", "layer_types", "sliding_window", "is_causal"]
    own, theirs = spec_for(d.arch), spec_for_export(meta)
    keys = [(key, d, key) for key in fields]  # (key, the config section holding it, its name under drafter.)
    if theirs is own:
        keys += [(key, getattr(d, own.name), f"{own.name}.{key}") for key in own.config_keys]
    want_types = list(d.layer_types or ["full_attention"] * d.num_hidden_layers)
    for key, section, name in keys:
        ours = want_types if key == "layer_types" else getattr(section, key)
        if key == "sliding_window" and "sliding_attention" not in want_types:
            ours = None
        try:
            value = _export_value(meta, key)
            if value is not None and key in _DFLASH_CONFIG_KEYS:
                value = int(value)
            wrong = _wrong_type(key, value, type(section))
        except (TypeError, ValueError):  # e.g. layer_types 5: not even readable as the key
            value, wrong = meta.get(key, (meta.get("dflash_config") or {}).get(key)), f"not readable as drafter.{name}"
        if wrong:  # a damaged or edited config.json: no --set makes a drafter of it
            diffs.append(f"drafter.{name}: the export's config.json has {json.dumps(value)}, {wrong}: the export is "
                         "damaged or was edited; export its run again (`dflash export RUN DIR`)")
        elif value != ours:
            shown = json.dumps(value)
            diffs.append(f"drafter.{name}: the export has {shown}, the config {json.dumps(ours)}; set drafter.{name}: "
                         f"{shown} (--set drafter.{name}={shown.replace(' ', '')})")
    if theirs is not own and theirs.name not in own.warm_start_from:
        diffs.append(f"drafter.arch: the export is a {theirs.title} drafter ({theirs.adds}), the config trains "
                     f"{own.title}; set drafter.arch: {theirs.name} (--set drafter.arch={theirs.name}) to start from "
                     "all of it")
    return diffs


def check_weights_file(path: str) -> None:
    """The export's files are intact: its checksums when it has them (pipeline.export.verify_checksums: a flipped
    byte is named), and model.safetensors readable as safetensors (a truncated or damaged header), else one line."""
    from safetensors import safe_open

    from pipeline.export import verify_checksums
    from pipeline.export_dir import refuse_non_finite

    verify_checksums(path, what="--init-from: ")
    f = Path(path) / "model.safetensors"
    try:
        with safe_open(str(f), "pt") as fh:  # the header, and that the file covers every tensor it lists
            for k in fh.keys():
                fh.get_slice(k).get_shape()
            names = list(fh.keys())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (no public base)
        raise ConfigError(f"--init-from {path}: {f} is not a readable safetensors file ({str(e).splitlines()[0]}): "
                          "truncated or damaged; copy the export again or re-export it (`dflash export RUN DIR`)") from None
    with safe_open(str(f), "pt") as fh:  # a NaN or inf weight by name, not a loss that fails at step 0
        refuse_non_finite(((k, fh.get_tensor(k)) for k in names), str(f), what="--init-from: ")


def check_init_from(cfg: Config, attrs: dict, layer_ids: list[int], path: str) -> None:
    """Raise a ConfigError naming every difference between the export at `path` and this config and store, or
    a UserError for a damaged weights file."""
    meta = read_export_config(path)
    check_weights_file(path)
    diffs = differences(cfg, attrs, layer_ids, meta)
    if diffs:
        raise ConfigError(f"--init-from {path} does not fit this config/store:\n  " + "\n  ".join(diffs))
