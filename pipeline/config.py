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
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.config_dflash2 import FLAT_KEYS as DFLASH2_FLAT_KEYS
from pipeline.config_dflash2 import DFlash2Config
from pipeline.config_ranges import PACK_PER_MAX_LENGTH, check_ranges
from pipeline.encoding import ENCODINGS
from pipeline.errors import ConfigError  # noqa: F401 (re-exported: pipeline.config.ConfigError)
from pipeline.fp8_block import PRECISIONS as TARGET_PRECISIONS


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


@dataclass
class TargetConfig:
    path: str = "builtin:tiny-target"  # local directory or hub id of the frozen target
    name: str = ""  # display name recorded in the store's provenance (defaults to path)
    dtype: str = "bfloat16"  # dtype of the target's forward on GPU
    cpu_dtype: str = "float32"  # dtype on CPU (bf16 matmuls are slow on most CPUs)
    attn_implementation: str = "sdpa"
    layer_ids: Optional[list[int]] = None  # None: build_target_layer_ids(num_layers, num_feature_layers)
    num_feature_layers: int = 5
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL files or `datasets` dirs saved to disk
    validation_files: list[str] = field(default_factory=list)  # optional; else split by validation_fraction
    validation_fraction: float = 0.02
    max_length: int = 3072
    enable_thinking: bool = False  # the chat template's thinking switch; must match serving
    on_bad_row: str = "error"  # error: stop with file/line/reason; skip: drop and report
    max_samples: Optional[int] = None  # cap (after the deterministic order), for quick runs


@dataclass
class StoreConfig:
    path: str = "runs/store.zarr"  # local path or fsspec URL
    encoding: str = "bf16"  # bf16 (lossless) | fp8 (e4m3, scale per token and layer) | int8/6/5/4 (group-32
    #                         scales + 4 exact outliers per token and layer); see pipeline/encoding.py
    chunk_tokens: int = 256  # rows (tokens) per Zarr chunk of the feature array
    clevel: int = 1  # zstd level inside blosc: 1 is ~2.7x faster than 3 for ~5% more bytes (docs/benchmarks.md)


@dataclass
class ExtractConfig:
    shards: int = 1
    token_budget: int = 16384  # padded tokens per target forward
    max_batch_size: int = 64
    queue_depth: int = 3  # batches in flight between forward and writer (bounds host memory)
    writer_threads: int = 4  # threads compressing and writing chunks
    fast_forward: bool = True  # the hybrid target on fused kernels (pipeline/fast_forward.py); false: transformers' forward
    # the frozen target's numerics (pipeline/fp8_block.py): auto (bf16; one line when the checkpoint is block FP8) |
    # bf16 | fp8-block (an FP8 release's FP8 GEMMs, as served) | fp8-block-from-bf16 (a bf16 checkpoint quantized)
    target_precision: str = "auto"


@dataclass
class DrafterConfig:
    num_hidden_layers: int = 5
    hidden_size: int = 5120  # must equal the target's hidden size (shared embedding and lm_head)
    intermediate_size: int = 17408
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 262144
    layer_types: Optional[list[str]] = None  # per layer: full_attention | sliding_attention
    sliding_window: Optional[int] = None
    block_size: int = 16
    mask_token_id: int = 248070
    # causal inside the block (exported as config.json `is_causal`, read as z-lab's reference model reads it):
    # null = sliding-window layers causal, full layers bidirectional (the key is left out of the export);
    # false = every layer bidirectional inside the block, sliding layers still windowed on the context (the
    # published DFlash 2 drafters: configs/qwen3.8-27b-dflash2.yaml); true = every layer causal inside the block
    is_causal: Optional[bool] = None
    arch: str = "dflash"  # dflash | dflash2 (dynamic convolutions + candidate selector)
    # an arch's own keys: a section named after it (pipeline/config_dflash2.py). The published DFlash 2 layout (5
    # sliding layers, is_causal false, its target layers, block 8) is configs/qwen3.8-27b-dflash2.yaml
    dflash2: DFlash2Config = field(default_factory=DFlash2Config)
    init_from: Optional[str] = None  # start from the weights of a trained export directory (`--init-from`)


@dataclass
class TrainConfig:
    run_dir: str = "runs/train"
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.04
    epochs: int = 6
    max_steps: int = -1  # -1: run all epochs
    grad_clip: Optional[float] = 1.0  # max gradient norm; 0 or null: no clipping
    num_anchors: int = 512  # anchors per sample (rule fixed), or the cap (rule proportional)
    anchor_rule: str = "fixed"  # fixed: num_anchors per sample | proportional: ~anchors_per_token per labelled token
    anchors_per_token: Optional[float] = None  # proportional: None = num_anchors / data.max_length
    gamma: Optional[float] = None  # loss decay over block slots; None: the paper's value for drafter.block_size
    selector_loss_alpha: float = 1.0  # dflash2: weight of the selector's K-way cross-entropy (0: no selector)
    batch_size: int = 1  # sequences per micro-batch per rank
    accumulate_grad_batches: int = 1
    # a resume on another number of ranks keeps the checkpoint's samples per optimizer step by recomputing
    # accumulate_grad_batches (stages/train_batch.py); false: the global batch grows with the ranks
    keep_global_batch: bool = True
    loss_chunk_rows: int = 4096  # rows of logits materialised at once
    precision: str = "bf16-mixed"  # on GPU; CPU always runs fp32
    compile: str = "auto"  # auto (on CUDA) | on | off
    num_workers: int = 2
    checkpoint_every: int = 500
    val_every: int = 500
    log_every: int = 10
    seed: int = 0
    export_checkpoint: str = "best"  # which checkpoint the end of training exports: best (by val tau) | last
    follow_buffer: int = 1024  # a following run's first epoch draws each batch at random from the next N committed samples
    # a following run that waits this many seconds without a new commit stops with one line (the extraction looks
    # stopped: resume it, or train on what is committed with --committed-only); null: wait as long as it takes
    follow_timeout_s: Optional[float] = None
    # a finished store's epoch: 0 = batches of the plain shuffled order; N > 0 = sorted by length inside windows
    # of batch_size * N shuffled samples (less padding when batch_size > 1, but lower tau: docs/benchmarks.md)
    length_group_factor: int = 0
    # sequence packing (data/packing.py): several samples share one row of up to pack_tokens tokens (None:
    # data.max_length), each seeing only itself; turn on when most samples are much shorter than pack_tokens
    packing: bool = False
    pack_tokens: Optional[int] = None
    # DistributedDataParallel's own options (torch's defaults; issue 22 measures them in bench/device_run.sh ddpopts)
    ddp_bucket_cap_mb: float = 25.0  # gradient bucket size of the all-reduce
    ddp_gradient_as_bucket_view: bool = False  # gradients are views into the buckets: no copy, less memory
    ddp_static_graph: bool = False  # the same parameters get gradients every step (lets DDP skip its per-step search)
    # multi-node (stages/train_nodes.py): nodes of the job; --gpus/--devices are the ranks per node
    num_nodes: int = 1
    rendezvous_timeout_s: float = 300.0  # every rank must join the process group and pass the start-up check by then
    collective_timeout_s: float = 1800.0  # after the start-up check: a collective that waits longer fails (NCCL's watchdog)
    # [first, last): optimizer steps profiled with torch.profiler (stages/train_profile.py): where a step's wall
    # time goes (GPU busy and idle, kernel families, host ops) -> RUN/logs/profile-rank{R}.txt/.json; null: off
    profile_steps: Optional[list[int]] = None


@dataclass
class EvalConfig:
    max_new_tokens: int = 64
    num_prompts: int = 32
    max_anchors_per_sample: int = 256
    temperature: float = 0.0  # online: 0 = greedy (token-for-token lossless check); > 0 = sampling, drafts
    #                           verified with the lossless rejection rule as serving does (stages/sampling.py)
    top_p: float = 1.0  # online sampling: nucleus; 1 = off
    seed: int = 0  # online sampling: draws are seeded per prompt from this
    # online: the hybrid target on fused kernels (pipeline/fast_forward.py) where it applies (CUDA with fla); its
    # cached-call GPU test passed on the H200 (2026-12-02; docs/benchmarks.md); false: transformers' forward
    fast_forward: bool = True
    # online: the target's numerics as served (pipeline/fp8_block.py, as extract.target_precision): fp8-block
    # evaluates a drafter against an FP8 release's FP8 GEMMs; auto: bf16
    target_precision: str = "auto"


@dataclass
class RegenerateConfig:
    """`dflash regenerate`: the target writes its own responses to the prompts (stages/regenerate.py)."""

    max_new_tokens: Optional[int] = None  # per response; None: data.max_length, so a response cut here is cut by
    #                                      extraction's truncation too (no false end of turn); cuts are listed
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0  # sampling seed (per batch embedded, per request with --server)
    max_batch_size: int = 64  # rows per generate call (embedded engine)
    token_budget: int = 262144  # rows x (prompt + max_new_tokens) per generate call: bounds the KV cache
    max_prompt_tokens: Optional[int] = None  # longer prompts are skipped and listed; None: data.max_length
    keep_truncated: bool = True  # keep responses cut at max_new_tokens (false: drop them and later turns)
    concurrency: int = 32  # --server: requests in flight per server URL
    request_timeout: float = 1800.0  # --server: seconds per request
    retries: int = 6  # --server: attempts after the first, with exponential backoff
    retry_backoff: float = 1.0  # --server: first wait in seconds (doubles, capped at 60 s)
    # embedded engine: the hybrid target on fused kernels (pipeline/fast_forward.py) where it applies (CUDA with
    # fla); its cached-call GPU test passed on the H200 (2026-12-02); false: transformers' forward
    fast_forward: bool = True


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    source: str = "<defaults>"  # the file it came from (not a YAML key)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


def _arch_sections() -> dict[str, type]:
    """drafter.arch -> the class of its own keys' section (`drafter.NAME`), for the archs that have keys."""
    hints = typing.get_type_hints(DrafterConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(DrafterConfig) if dataclasses.is_dataclass(hints[f.name])}


# The drafter archs the config accepts: DFlash (no keys of its own) and one per arch section. The arch registry is
# pipeline/archs.py (its drafter, loss, export, loader); this file cannot import it (pipeline/export2.py ->
# pipeline/target.py -> here), so tests/test_archs.py holds these names equal to the registry's.
DRAFTER_ARCHS = ("dflash", *_arch_sections())
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


def resolve_path(value: str, base: Path) -> str:
    """Resolve a config path: `builtin:NAME` -> shipped asset; relative -> against `base`; URLs unchanged."""
    if value.startswith("builtin:"):
        return str(ASSETS_DIR / value[len("builtin:"):])
    if "://" in value or Path(value).is_absolute():
        return value
    candidate = (base / value).resolve()
    return str(candidate)


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


def _validate_anchors(t: TrainConfig, src: str) -> None:
    if t.anchors_per_token is not None and t.anchor_rule != "proportional":
        raise ConfigError(f"{src}: train.anchors_per_token is only used with train.anchor_rule=proportional; "
                          "set that too, or drop anchors_per_token")


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
