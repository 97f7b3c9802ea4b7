"""Raw config input (a YAML file's mapping, a checkpoint's embedded dict, `--set` strings) checked and built into
the typed sections of pipeline/config_sections.py.

Contract:
- `config_from_dict(raw, source)` returns a `Config` or raises `ConfigError` naming `source` and the key: an unknown
  section or key (with the nearest valid name), a value of the wrong type (`_check_type`; ints are accepted for
  floats, YAML 1.1's `3e-4` string read as a number, `on`/`off` given back their words for an on/off choice), a
  value outside its choices (`_CHOICES`) or its range (pipeline/config_ranges.py, checked first), then the checks
  that relate keys to each other (`_validate`; an arch's own section runs its `check`).
- The deprecated flat arch keys (`drafter.selector_rank`, `DEPRECATED_FLAT`) are moved into their section
  (`drafter.dflash2.selector_rank`) with one deprecation line on stderr; a key given both ways is refused.
- `--set section.key=value` (`parse_override`; the value parsed as YAML) is applied to the raw dict
  (`_apply_overrides`) before it is built; an unknown section or key is blamed on the --set, and so is a refused
  value that came from it (`_from_dict_blaming_set`), never the file.
- `_UniqueKeyLoader`: the YAML loader pipeline/config.py's `load_config` reads a file with; a key given twice in one
  mapping raises `_DuplicateKey`.
- Reads files of no kind and resolves no path (pipeline/config.py does both). Imports the sections' classes from
  pipeline/config_sections.py and is imported by pipeline/config.py, which re-exports `config_from_dict`,
  `parse_override` and the private names other modules and tests use (`_check_type`, `_CHOICES`): one direction,
  no import circle.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

import yaml

from pipeline.config_dflash2 import FLAT_KEYS as DFLASH2_FLAT_KEYS
from pipeline.config_ranges import PACK_PER_MAX_LENGTH, check_ranges
from pipeline.config_sections import DRAFTER_ARCHS, Config, TrainConfig
from pipeline.encoding import ENCODINGS
from pipeline.errors import ConfigError
from pipeline.fp8_block import PRECISIONS as TARGET_PRECISIONS


# drafter.KEY (flat, as written before the arch sections) -> its section: read with a deprecation line
DEPRECATED_FLAT = {key: "dflash2" for key in DFLASH2_FLAT_KEYS}


_CHOICES = {
    ("store", "encoding"): ENCODINGS,
    ("data", "on_bad_row"): ("error", "skip"),
    ("train", "anchor_rule"): ("fixed", "proportional"),
    ("train", "compile"): ("auto", "on", "off"),
    ("train", "precision"): ("bf16-mixed", "32-true", "bf16-true"),
    ("target", "dtype"): ("bfloat16", "float16", "float32"),
    ("target", "cpu_dtype"): ("bfloat16", "float32"),
    ("drafter", "arch"): DRAFTER_ARCHS,
    ("extract", "target_precision"): TARGET_PRECISIONS,
    ("eval", "target_precision"): TARGET_PRECISIONS,
    ("train", "export_checkpoint"): ("best", "last"),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Validate `value` against a dataclass field type; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover - a programming error


def _nearest(word: str, choices) -> str:
    """" (did you mean 'X'?)" for the closest of `choices` (difflib), else ""."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _build_section(cls: type, raw: Any, section: str, source: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{source}: unknown key '{section}.{unknown[0]}'{_nearest(unknown[0], names)} (valid keys "
                          f"of '{section}': {', '.join(sorted(names))})")
    kwargs = {k: (_build_section(hints[k], v, f"{section}.{k}", source) if dataclasses.is_dataclass(hints[k]) else
                  _check_type(_on_off(section, k, v), hints[k], f"{source}: {section}.{k}")) for k, v in raw.items()}
    return cls(**kwargs)


def _on_off(section: str, key: str, value: Any) -> Any:
    """YAML 1.1 reads `on`/`off` (and yes/no) as booleans: give an on/off choice its word back."""
    if isinstance(value, bool) and "on" in _CHOICES.get((section, key), ()):
        return "on" if value else "off"
    return value


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "source"}


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in _SECTIONS}


def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    classes = _section_classes()
    unknown = sorted(set(raw) - set(classes))
    if unknown:
        raise ConfigError(f"{source}: unknown section '{unknown[0]}' (valid: {', '.join(classes)})")
    _move_flat_keys(raw, source)
    cfg = Config(**{name: _build_section(cls, raw.get(name), name, source) for name, cls in classes.items()})
    cfg.source = source
    _validate(cfg)
    return cfg


def _move_flat_keys(raw: dict, source: str) -> None:
    """Move the deprecated flat arch keys (`drafter.conv_kernel_size`) into their section
    (`drafter.dflash2.conv_kernel_size`), with one line on stderr naming them; a key given both ways is refused."""
    d = raw.get("drafter")
    flat = [k for k in DEPRECATED_FLAT if isinstance(d, dict) and k in d]
    if not flat:
        return
    for key in flat:
        if d.get(DEPRECATED_FLAT[key]) is None:
            d[DEPRECATED_FLAT[key]] = {}
        section = d[DEPRECATED_FLAT[key]]
        if not isinstance(section, dict):
            return  # the section's own type check names it
        if key in section:
            raise ConfigError(f"{source}: drafter.{key} and drafter.{DEPRECATED_FLAT[key]}.{key} are both given; keep "
                              f"drafter.{DEPRECATED_FLAT[key]}.{key}")
        section[key] = d.pop(key)
    import sys

    names = ", ".join(f"drafter.{k}" for k in flat)
    print(f"config: {source}: {names} moved to drafter.{DEPRECATED_FLAT[flat[0]]}.*; write them there (the flat "
          "keys are read until the next release)", file=sys.stderr, flush=True)


def _validate(cfg: Config) -> None:
    src = cfg.source
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(f"{src}: {section}.{key} = {value!r} is not one of {', '.join(choices)}")
    check_ranges(cfg)  # every numeric key in its range, before the checks that relate keys to each other
    d = cfg.drafter
    if d.layer_types is not None:
        if len(d.layer_types) != d.num_hidden_layers:
            raise ConfigError(
                f"{src}: drafter.layer_types has {len(d.layer_types)} entries but drafter.num_hidden_layers is "
                f"{d.num_hidden_layers}; give one type per layer"
            )
        for t in d.layer_types:
            if t not in _LAYER_TYPES:
                raise ConfigError(f"{src}: drafter.layer_types entry {t!r} is not one of {', '.join(_LAYER_TYPES)}")
        if "sliding_attention" in d.layer_types and not d.sliding_window:
            raise ConfigError(f"{src}: drafter.layer_types uses sliding_attention; set drafter.sliding_window")
    if d.num_attention_heads % d.num_key_value_heads:
        raise ConfigError(f"{src}: drafter.num_attention_heads must be a multiple of drafter.num_key_value_heads")
    own = getattr(d, d.arch, None)  # the arch's own keys (DFlash 2's convolution shape)
    if own is not None:
        own.check(d, src)
    _validate_anchors(cfg.train, src)
    if cfg.data.max_length > d.max_position_embeddings:
        raise ConfigError(f"{src}: data.max_length ({cfg.data.max_length}) exceeds drafter.max_position_embeddings "
                          f"({d.max_position_embeddings}): the drafter would train on positions its exported config "
                          "says it does not have; raise drafter.max_position_embeddings (long samples: 8K-16K)")
    if cfg.train.pack_tokens is not None and not cfg.train.packing:
        raise ConfigError(f"{src}: train.pack_tokens is only used with train.packing=true; set that too, or drop "
                          "pack_tokens")
    if cfg.train.packing and cfg.train.length_group_factor:
        raise ConfigError(f"{src}: train.length_group_factor={cfg.train.length_group_factor} has no effect with "
                          "train.packing=true (rows are planned by length already); set it to 0")
    if cfg.train.pack_tokens is not None and cfg.train.pack_tokens < cfg.data.max_length:
        raise ConfigError(f"{src}: train.pack_tokens ({cfg.train.pack_tokens}) is below data.max_length "
                          f"({cfg.data.max_length}): a sample of max_length tokens must fit one packed row; raise "
                          "pack_tokens or leave it unset (= data.max_length)")
    if cfg.train.pack_tokens is not None and cfg.train.pack_tokens > PACK_PER_MAX_LENGTH * cfg.data.max_length:
        raise ConfigError(f"{src}: train.pack_tokens ({cfg.train.pack_tokens}) is more than {PACK_PER_MAX_LENGTH} x "
                          f"data.max_length ({cfg.data.max_length}): rows that long cost memory without filling; use "
                          f"at most {PACK_PER_MAX_LENGTH * cfg.data.max_length}")
    if cfg.target.layer_ids is not None and sorted(set(cfg.target.layer_ids)) != cfg.target.layer_ids:
        raise ConfigError(f"{src}: target.layer_ids must be strictly increasing, got {cfg.target.layer_ids}")
    ps = cfg.train.profile_steps
    if ps is not None and not ps[0] < ps[1]:
        raise ConfigError(f"{src}: train.profile_steps = {ps} must be [first, last) with first < last, e.g. [20, 30]")


def _validate_anchors(t: TrainConfig, src: str) -> None:
    if t.anchors_per_token is not None and t.anchor_rule != "proportional":
        raise ConfigError(f"{src}: train.anchors_per_token is only used with train.anchor_rule=proportional; "
                          "set that too, or drop anchors_per_token")


def parse_override(text: str) -> tuple[str, str, Any]:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.lr=3e-4")
    key, value = text.split("=", 1)
    section, name = key.strip().split(".", 1)
    try:
        parsed = yaml.safe_load(value) if value.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {e}") from None
    return section, name, parsed


def _apply_overrides(raw: dict, overrides) -> dict[str, str]:
    """Apply `--set section.key=value` strings to a raw config dict; a section or key that does not exist is
    blamed on the --set option (not on the YAML file), with the nearest valid name. Returns 'section.key' -> the
    --set text, so that a refused value names the --set that gave it."""
    classes, given = _section_classes(), {}
    for text in overrides:
        section, name, value = parse_override(text)
        if section not in classes:
            raise ConfigError(f"--set {text!r}: unknown section '{section}'{_nearest(section, classes)} (valid: "
                              f"{', '.join(classes)})")
        target = _override_target(raw, section, name, classes[section], text)
        target[name.rsplit(".", 1)[-1]] = value
        given[f"{section}.{name}"] = text
        if section == "drafter" and name in DEPRECATED_FLAT:  # moved at load: a refusal names the section's key
            given[f"drafter.{DEPRECATED_FLAT[name]}.{name}"] = text
    return given


def _override_target(raw: dict, section: str, name: str, cls: type, text: str) -> dict:
    """The dict of `raw` that `--set section.name=...` writes into (a nested arch section for `dflash2.KEY`),
    created where missing; an unknown key is refused with the nearest valid one."""
    parts = name.split(".")
    hints = typing.get_type_hints(cls)
    names = list(hints) + (list(DEPRECATED_FLAT) if section == "drafter" else [])
    inner = hints.get(parts[0])
    valid = [f"{section}.{n}" for n in hints] + [f"{section}.{parts[0]}.{n}" for n in
                                                 (typing.get_type_hints(inner) if dataclasses.is_dataclass(inner) else ())]
    nested_ok = len(parts) == 2 and dataclasses.is_dataclass(inner) and parts[1] in typing.get_type_hints(inner)
    if not ((len(parts) == 1 and parts[0] in names and not dataclasses.is_dataclass(inner)) or nested_ok):
        raise ConfigError(f"--set {text!r}: unknown key '{section}.{name}'{_nearest(f'{section}.{name}', valid)} "
                          f"(valid keys of '{section}': {', '.join(sorted(hints))})")
    if not isinstance(raw.get(section), dict):
        raw[section] = {}
    out = raw[section]
    if nested_ok:
        if not isinstance(out.get(parts[0]), dict):
            out[parts[0]] = {}
        out = out[parts[0]]
    return out


def _from_dict_blaming_set(raw: dict, source: str, given: dict[str, str]) -> Config:
    """config_from_dict, with a refused value that came from --set named as that --set, not as the file."""
    try:
        return config_from_dict(raw, source=source)
    except ConfigError as e:
        msg = str(e)
        for key, text in given.items():
            head = f"{source}: {key}"
            if msg.startswith(head) and msg[len(head):len(head) + 1] in (":", " ", "["):
                raise ConfigError(f"--set {text!r}: {key}{msg[len(head):]}") from None
        raise


class _DuplicateKey(Exception):
    """A YAML mapping names one key twice (PyYAML's safe loader silently keeps the last)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: which value was meant is unknowable."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (list, dict)):
                continue  # unhashable: SafeLoader's own error names it
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"key '{key}' is given twice in one mapping (lines {seen[key]} and {line}); "
                                    "keep one of them")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)
