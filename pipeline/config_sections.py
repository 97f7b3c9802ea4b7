"""The typed run config's sections: one dataclass per YAML section (target, data, store, extract, drafter, train,
eval, regenerate) and `Config`, which holds them; each field's type, default and meaning (the comment beside it).

Contract:
- The single owner of the config's shape: the keys a section accepts are its dataclass's fields, the types
  pipeline/config_parse.py checks are their annotations, the defaults are theirs; nothing else lists them.
- `DRAFTER_ARCHS`: the drafter archs the config accepts, read off `DrafterConfig` (an arch with keys of its own has
  a field whose type is its section's class: `dflash2: DFlash2Config`, pipeline/config_dflash2.py).
- The bottom of the config modules: it imports only pipeline/config_dflash2.py; pipeline/config_parse.py builds
  these classes from raw YAML, and pipeline/config.py (the public face) re-exports them, so every caller keeps
  importing them from `pipeline.config`. (Here and not in config.py because the parser needs them and config.py
  needs the parser: the import graph has no circle, lazy imports included; tests/test_layering.py.)
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Optional

from pipeline.config_dflash2 import DFlash2Config


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
# pipeline/target.py -> pipeline/config.py -> here), so tests/test_archs.py holds these names equal to the
# registry's.
DRAFTER_ARCHS = ("dflash", *_arch_sections())
