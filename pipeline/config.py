"""Typed run configuration: one YAML file describes a whole run (target, data, store, extract, drafter, train).

Contract:
- `load_config(path, overrides)` returns a `Config`; every section is a frozen-ish dataclass whose fields
  have types. Unknown keys, wrong types and bad values raise `ConfigError` naming the key and the file; every
  numeric key has its allowed range in pipeline/config_ranges.py (checked first, naming the value too).
- Overrides are `section.field=value` strings (`--set train.lr=3e-4`, `--set drafter.dflash2.selector_rank=64`);
  the value is parsed as YAML and validated exactly like the file.
- A drafter arch's own keys are a section inside `drafter`, named after the arch (`drafter.dflash2`: its class in
  pipeline/config_dflash2.py, its `check` run when it is the arch trained); the flat keys of before
  (`drafter.selector_rank`) are moved into it with one deprecation line on stderr, for one release.
- Relative paths (data files, store, run dir) are relative to the current directory, where the user runs
  the command; a target path that exists relative to the config file's directory is resolved there.
- Paths starting with `builtin:` refer to assets shipped inside the package (`data/assets/...`).
- A config comes only from a file the user names (`--config`) and `--set`: the keys that load code (`CODE_KEYS`:
  target.path, trust_remote_code, attn_implementation, drafter.init_from) are never taken from a checkpoint's
  embedded config, and a run's config.yaml found by `resolve_config` is refused when it would run the target's
  code unless `--set` says so too (issue 40 item 1).

Three modules, one direction of import (no circle, lazy imports included: tests/test_layering.py):
pipeline/config_sections.py (the dataclasses: the config's shape) <- pipeline/config_parse.py (raw YAML and `--set`
checked and built into them) <- this one, the public face: where the shipped configs and assets are, files read
(`load_config`), paths resolved, the config's source chosen (`resolve_config`) and the code-loading keys guarded
(`CODE_KEYS`), the config written back (`dump_config`, `write_config`), the values derived from it
(`build_target_layer_ids`, `anchors_per_token`, `pack_tokens`, `gamma_for_block`). The sections' classes and the
parser's names are re-exported here: callers import everything from `pipeline.config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.config_parse import (_apply_overrides, _DuplicateKey, _from_dict_blaming_set, _UniqueKeyLoader,
                                   parse_override)
# re-exported, so that every caller imports the config from here: the sections' classes, the parser's public names,
# and the private ones read from this module (stages/init_from.py: _check_type; tests/test_archs.py: _CHOICES,
# _arch_sections)
from pipeline.config_parse import _CHOICES, DEPRECATED_FLAT, _check_type, config_from_dict  # noqa: F401
from pipeline.config_sections import DRAFTER_ARCHS, Config, DataConfig, DrafterConfig, EvalConfig  # noqa: F401
from pipeline.config_sections import ExtractConfig, RegenerateConfig, StoreConfig, TargetConfig  # noqa: F401
from pipeline.config_sections import TrainConfig, _arch_sections  # noqa: F401
from pipeline.errors import ConfigError  # noqa: F401 (re-exported: pipeline.config.ConfigError)


ASSETS_DIR = Path(__file__).resolve().parent.parent / "data" / "assets"


def _configs_dir() -> Path:
    """The shipped run configs: configs/ beside pipeline/ in a checkout (or an editable install), else the copy
    an installed dflash carries (pyproject.toml's data-files: PREFIX/share/dflash/configs), found through the
    installed distribution's file list so that venv, --user and --prefix installs all work."""
    checkout = Path(__file__).resolve().parent.parent / "configs"
    if (checkout / "tiny.yaml").is_file():
        return checkout
    from importlib import metadata

    try:
        files = metadata.distribution("dflash").files or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "tiny.yaml" and f.parent.name == "configs":
            return Path(f.locate()).resolve().parent
    return checkout  # neither: load_config's "does not exist" error names this path


CONFIGS_DIR = _configs_dir()


def resolve_path(value: str, base: Path) -> str:
    """Resolve a config path: `builtin:NAME` -> shipped asset; relative -> against `base`; URLs unchanged."""
    if value.startswith("builtin:"):
        return str(ASSETS_DIR / value[len("builtin:"):])
    if "://" in value or Path(value).is_absolute():
        return value
    candidate = (base / value).resolve()
    return str(candidate)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML run config (default: the embedded tiny config) and apply `section.key=value` overrides."""
    path = Path(path) if path is not None else CONFIGS_DIR / "tiny.yaml"
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; pass --config PATH (see configs/ for examples)")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    given = _apply_overrides(raw, overrides)
    cfg = _from_dict_blaming_set(raw, str(path), given)
    base = path.resolve().parent
    cfg.target.path = _resolve_target(cfg.target.path, base)
    cwd = Path.cwd()
    cfg.data.train_files = [resolve_path(p, cwd) for p in cfg.data.train_files]
    cfg.data.validation_files = [resolve_path(p, cwd) for p in cfg.data.validation_files]
    if not cfg.target.name:
        cfg.target.name = cfg.target.path
    if cfg.train.gamma is None:  # follows the block size (7 for 16, 5 for 10, 4 for 8) unless set
        cfg.train.gamma = gamma_for_block(cfg.drafter.block_size)
    return cfg


# Keys that choose code to load or run (a target directory or hub id, its own modeling code, an attention kernel
# fetched by name), or a path of weights. Only a config the user names (--config FILE, --set) sets them: a
# checkpoint's embedded config never does (`resolve_config` drops them), and a run directory's config.yaml that
# was found, not named, may not turn trust_remote_code on or pick another attention (`_refuse_found_code`).
CODE_KEYS = (("target", "path"), ("target", "trust_remote_code"), ("target", "attn_implementation"),
             ("drafter", "init_from"))  # (data files are read as data: JSONL or a saved `datasets` dir)
PLAIN_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def on_command_line(overrides, section: str, key: str) -> bool:
    """Whether a `--set section.key=...` among `overrides` sets this key."""
    return any(parse_override(t)[:2] == (section, key) for t in overrides)


def embedded_code_values(embedded: Optional[dict]) -> dict[str, Any]:
    """The CODE_KEYS values a checkpoint's embedded config holds that `resolve_config` ignores (`section.key` ->
    value), left out where they equal what the shipped defaults resolve to (the tiny target, sdpa, false, none)."""
    defaults = Config()
    defaults.target.path = _resolve_target(defaults.target.path, Path.cwd())
    out = {}
    for section, key in CODE_KEYS:
        value = ((embedded or {}).get(section) or {}).get(key)
        if value not in (None, [], getattr(getattr(defaults, section), key)):
            out[f"{section}.{key}"] = value
    return out


def _refuse_found_code(cfg: Config, path: Path, overrides) -> None:
    """A run directory's config.yaml found by itself (a shared run could be planted) does not get to run the
    target's own code: trust_remote_code or another attention implementation needs the command line to say so."""
    t, how = cfg.target, f"pass --config {path} to use that file as it is"
    if t.trust_remote_code and not on_command_line(overrides, "target", "trust_remote_code"):
        raise ConfigError(f"{path}: target.trust_remote_code is true in a run directory's config.yaml that was not "
                          f"named on the command line, and would run code from {t.path}; if you trust it pass --set "
                          f"target.trust_remote_code=true (or {how})")
    if t.attn_implementation not in PLAIN_ATTENTION and not on_command_line(overrides, "target", "attn_implementation"):
        raise ConfigError(f"{path}: target.attn_implementation = {t.attn_implementation!r} in a run directory's "
                          "config.yaml that was not named on the command line may load kernel code; pass --set "
                          f"target.attn_implementation={t.attn_implementation} if you trust it (or {how})")


def resolve_config(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
                   run_config: Optional[Path] = None, embedded: Optional[dict] = None,
                   embedded_source: str = "(embedded config)") -> tuple[Config, str]:
    """The config of a command that reads a trained drafter (`dflash eval`), and where it came from: `--config`
    when given; else the run's RUN/config.yaml (`run_config`, when it exists; refused by `_refuse_found_code`
    when it would run the target's code); else the config a checkpoint carries (`embedded`, named
    `embedded_source`) without its CODE_KEYS, which take their defaults unless `--set`; else the shipped tiny
    config. `--set` overrides apply to whichever it is."""
    if config_path:
        return load_config(config_path, overrides), str(config_path)
    if run_config is not None and Path(run_config).exists():
        cfg = load_config(run_config, overrides)
        _refuse_found_code(cfg, Path(run_config), overrides)
        return cfg, str(run_config)
    if embedded is not None:
        import json

        raw = json.loads(json.dumps(embedded))  # a copy: the checkpoint's dict stays as it was
        for section, key in CODE_KEYS:  # a checkpoint carries the drafter, never what loads code
            (raw.get(section) or {}).pop(key, None)
        given = _apply_overrides(raw, overrides)
        cfg = _from_dict_blaming_set(raw, embedded_source, given)
        cwd = Path.cwd()
        cfg.target.path = _resolve_target(cfg.target.path, cwd)  # the default or --set's, never the checkpoint's
        cfg.data.train_files = [resolve_path(p, cwd) for p in cfg.data.train_files]
        cfg.data.validation_files = [resolve_path(p, cwd) for p in cfg.data.validation_files]
        return cfg, embedded_source
    return load_config(None, overrides), "configs/tiny.yaml (default)"


def startup_line(stage: str, cfg: Config, config_path: Optional[str], store: Optional[str] = None) -> str:
    """A stage's first line: which config (saying when it is the tiny default because no --config was given),
    target, store and run directory it works with."""
    source = cfg.source if config_path else f"{cfg.source} (no --config given: the tiny demo config)"
    return (f"{stage}: config {source}; target {cfg.target.path}; store {store or cfg.store.path}; "
            f"run dir {cfg.train.run_dir}")


def _resolve_target(value: str, base: Path) -> str:
    if value.startswith("builtin:") or value.startswith(".") or Path(value).is_absolute():
        return resolve_path(value, base)
    local = base / value
    return str(local.resolve()) if local.exists() else value  # else: a hub id such as Qwen/Qwen3.6-27B


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def write_config(cfg: Config, path: Path) -> Path:
    """Write the resolved config (every --set applied, paths absolute) where `load_config` reads it back as the
    same config: the one shape a parent hands its workers (`--config FILE`, no --set strings). Atomic."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_config(cfg))
    tmp.replace(path)
    return path


def build_target_layer_ids(num_layers: int, n: int) -> list[int]:
    """The DFlash rule: [L//2] for one layer, else round(1 + i*(L-4)/(n-1)). Id k = output of decoder layer k."""
    if n <= 0:
        raise ValueError("need at least one target layer")
    if n == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (n - 1))) for i in range(n)]


def anchors_per_token(cfg: Config) -> Optional[float]:
    """The training anchor rate: None for rule `fixed`; for `proportional` the configured rate, else
    num_anchors / data.max_length (a sample labelled over its whole max_length gets the cap)."""
    t = cfg.train
    if t.anchor_rule != "proportional":
        return None
    return t.anchors_per_token if t.anchors_per_token is not None else min(1.0, t.num_anchors / cfg.data.max_length)


def pack_tokens(cfg: Config) -> Optional[int]:
    """Tokens per packed row with train.packing on (train.pack_tokens, default data.max_length); None when off."""
    t = cfg.train
    return (t.pack_tokens or cfg.data.max_length) if t.packing else None


def gamma_for_block(block_size: int) -> float:
    """The paper's loss-decay constant: 7 for B=16, 5 for B=10, 4 for B=8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))
