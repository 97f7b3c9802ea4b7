"""`dflash extract --plan`: what an extraction will take, said before any GPU work, writing nothing.

Contract:
- Runs ingest (the same samples, split and truncation the extraction would use), reads the target's config
  (no weights, no hashing, no model) and prints: sample and token counts per split; the store size for
  store.encoding; the free disk where the store goes; a time estimate on the given shards/GPUs. Exit 0.
- Writes nothing: no store directory, no logs, no locks (tested). A hub id target may download its small
  metadata files (config, tokenizer) into the hub cache, as any dflash command does.
- Store size = tokens x (feature bytes per token x compression factor + 5 B of token id and loss mask)
  + 21 B per sample (the sample index) + the frozen head (embedding, untied lm_head and final norm, in the
  extraction's dtype). Feature bytes per token follow from the encoding's parts (pipeline/encoding.py,
  `raw_bytes_per_token`): layers x hidden x bits, plus scales and outliers. The compression factor (store
  bytes / raw bytes of the feature parts, blosc zstd-1 + byte shuffle) is a measured constant per encoding
  and size class, the encoding module's (pipeline/encoding.py `COMPRESSION`, so a new encoding cannot leave
  this table behind; one without a measured factor is sized raw, and the output says so): lossy encodings
  barely compress (their codes are near random), bf16 does by ~1.25x, and how much depends on the activations
  (a real 27B's may differ from the data measured).
- Time = tokens / (rate per GPU x GPUs). The only measured rate of the real target class is the Qwen3.5/
  3.6-27B hybrid's on one H200 with flash-linear-attention (RATE_27B_H200); another target's is scaled by
  weight bytes (a forward's FLOPs follow its parameters), which for small targets is only a lower bound on
  the time (they are bound by per-batch overheads, not FLOPs); the output says which it used. On a machine
  without a GPU the built-in H200 rates are used all the same, and the output says so.
- Training time (the 27B drafter shape only, the one measured: TRAIN_STEP_MS_27B, one H200, compiled flex):
  train.epochs x the time of every row. Unpacked a row is one sample, its time interpolated by its length (a
  short sample costs far more per token: 61 ms for 512 tokens, 240 ms for 3,072); with train.packing the rows
  are data/packing.py's plan of the real train lengths, each timed as a full row of its tokens, so the estimate
  follows tokens rather than samples. Divided by the GPUs (DDP); the output says what it assumed.
- Schedules (issue 41 item 4), from those rates, E extraction GPUs, T training GPUs, N = E + T: the split
  (training follows the store on T: its first epoch cannot end before extraction does), the split with
  expansion (`dflash run`'s default: what T trained while extraction ran, then the rest on all N), and one
  stage after the other on all N (`schedules`). `dflash run --plan` takes E and T from its GPU lists (or its CPU
  shards and --devices); `dflash extract --plan` from its shards and the node: this machine's GPUs, or 8
  H200s where it has none.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline import store as st
from pipeline.config import Config
from pipeline.encoding import LARGE_HIDDEN, compression_factor, raw_bytes_per_token, size_class
from pipeline.encoding import check as check_encoding

TOKEN_BYTES = 5  # tokens int32 + loss_mask uint8, per token (pipeline/store.py)
SAMPLE_BYTES = 21  # sample_start int64 + sample_length int32 + sample_id uint64 + split uint8, per sample
# tokens/s per H200 extracting the Qwen3.5/3.6-27B hybrid (layers up to 61 of 64, flash-linear-attention 0.6):
# with dflash's fast forward (extract.fast_forward, the default) 11,398 in int5 (issue 30, docs/benchmarks.md,
# 2026-12-02 02:46: bare forward 12,101; 8 batches of 8 x 2048 with the shard's final drain, so a lower bound:
# 11,714 before it, a long shard's steady state); transformers' reference forward 8,977 (design brief
# section 2, 2 x H200, 2026-11-30: 8,903 beside training; bare 9,291), and 6,413 without flash-linear-attention
RATE_27B_H200 = 11398
RATE_27B_H200_REFERENCE = 8977
RATE_27B_H200_NO_FLA = 6413
# extract.target_precision fp8-block: int5 extraction with the block-FP8 GEMMs as shipped (the GDN's in_proj_b/a on
# the reference arithmetic), 15,370 tokens/s over 8 batches with the final drain (issue 45, 2026-12-06 10:58,
# docs/benchmarks.md; an H100, whose bf16 fast forward ran within 1.5% of the H200's; 0.944 of the bare forward's
# 16,789 before the drain)
RATE_27B_H200_FP8_BLOCK = 15370
WEIGHT_BYTES_27B = 27e9 * 2  # bf16 weights of the 27B class, the reference for scaling by size
NODE_GPUS_NO_GPU = 8  # `dflash extract --plan` on a machine without a GPU: the node assumed (8 x H200)


@dataclass
class Plan:
    samples: dict  # split -> count
    tokens: dict  # split -> tokens
    feature_bytes_per_token: float  # after compression
    raw_bytes_per_token: int
    factor: float
    factor_source: str
    head_bytes: int
    store_bytes: float
    free_bytes: Optional[int]
    free_at: str
    seconds: Optional[float]
    rate_note: str
    train_seconds: Optional[float] = None  # on train_gpus
    train_note: str = ""
    extract_gpus: int = 1
    train_gpus: int = 1
    schedules: Optional[dict] = None  # name -> seconds (`schedules`), None without a training rate
    train_where: str = ""  # where the training GPUs come from, when the command does not name them

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _target_meta(cfg: Config):
    """(the target's TargetConfig, its local directory)."""
    from pipeline.target import local_target_dir
    from pipeline.targets import read_target_config

    d = local_target_dir(cfg.target.path)
    return read_target_config(d), d


def head_bytes(meta, dtype_bytes: int) -> int:
    """embed_tokens (+ lm_head unless tied) + the final norm, in the extraction's dtype (`meta`: the target's
    TargetConfig)."""
    tied = meta.tie_word_embeddings
    V, H = meta.vocab_size, meta.hidden_size
    return (V * H * (1 if tied else 2) + H) * dtype_bytes


def free_disk(store_path: str) -> tuple[Optional[int], str]:
    """Free bytes on the filesystem the store would go to (its nearest existing parent), or None for URLs."""
    if not st.is_local(store_path):
        return None, store_path
    p = Path(store_path.removeprefix("file://"))
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free, str(p)


def estimate_time(tokens: int, gpus: int, weight_bytes: Optional[float], cuda: bool,
                  fast_forward: bool = True, fp8_block: bool = False) -> tuple[Optional[float], str]:
    rate = RATE_27B_H200 if fast_forward else RATE_27B_H200_REFERENCE
    how = ("dflash's fast forward (measured 2026-12-02" if fast_forward else
           "transformers' forward (extract.fast_forward off; measured 2026-11-30")
    if fp8_block and fast_forward:
        rate, how = RATE_27B_H200_FP8_BLOCK, ("dflash's fast forward in block FP8 (extract.target_precision: "
                                              "measured 2026-12-06 on an H100")
    src = (("no GPU here, so the built-in H200 rates: " if not cuda else "")
           + f"{rate:,} tokens/s per H200 for the Qwen3.5/3.6-27B hybrid with flash-linear-attention and {how}"
           + f"; {RATE_27B_H200_NO_FLA:,} on torch fallbacks)")
    if weight_bytes is None or weight_bytes >= 0.5 * WEIGHT_BYTES_27B:
        return tokens / (rate * gpus), f"from {src}; assumes an H200-class GPU per shard"
    scale = WEIGHT_BYTES_27B / weight_bytes
    return (tokens / (rate * scale * gpus),
            f"from {src}, scaled by weight bytes ({weight_bytes / 1e9:.3g} GB here vs 54 GB: x{scale:,.0f}); a lower "
            "bound for a small target, which per-batch overheads dominate, not FLOPs")


# one training step of the 27B drafter (configs/qwen3.6-27b.yaml) per sample length, ms: bench/train_bench.py on one
# H200, compiled flex, ~1 anchor per 6 tokens (85/171/512), measured 2026-12-01 at 896817d (issue 28)
TRAIN_STEP_MS_27B = ((512, 61.0), (1024, 94.6), (3072, 239.5))


def row_ms(tokens: int) -> float:
    """The measured step time of a row of `tokens`, piecewise linear in TRAIN_STEP_MS_27B (beyond its ends: the
    nearest segment's slope; never below 1/10 of the shortest point's time)."""
    pts = TRAIN_STEP_MS_27B
    k = 0 if tokens <= pts[1][0] else len(pts) - 2 if tokens >= pts[-2][0] else next(
        i for i in range(len(pts) - 1) if pts[i][0] <= tokens <= pts[i + 1][0])
    (x0, y0), (x1, y1) = pts[k], pts[k + 1]
    return max(pts[0][1] / 10, y0 + (tokens - x0) * (y1 - y0) / (x1 - x0))


def estimate_training(cfg: Config, train_lengths: list[int], gpus: int) -> tuple[Optional[float], str]:
    """(seconds, note) of `dflash train` over these train sample lengths (see the module docstring)."""
    from pipeline.config import pack_tokens

    if cfg.drafter.hidden_size != 5120 or not train_lengths:
        return None, ("no measured training rate for this drafter shape (only the 27B shape's, hidden 5120, "
                      "stages/plan.py TRAIN_STEP_MS_27B)")
    budget = pack_tokens(cfg)
    if budget:
        from data.packing import packed_plan

        rows = [sum(train_lengths[i] for i in row) for b in packed_plan(train_lengths, 1, cfg.train.seed, 0, budget)
                for row in b]
        fill = sum(rows) / (len(rows) * budget)
        how = (f"packed: {len(train_lengths) / len(rows):.2f} samples per {budget:,}-token row, {100 * fill:.1f}% "
               "full, each row timed by its tokens")
    else:
        rows, how = train_lengths, "one sample per row, each timed by its length (train.packing off)"
    ms = sum(row_ms(n) for n in rows) * cfg.train.epochs
    note = (f"{cfg.train.epochs} epochs of {len(rows):,} rows; {how}; from the 27B drafter's measured step times on "
            f"one H200 (stages/plan.py TRAIN_STEP_MS_27B), divided by {gpus} GPU(s) (DDP)")
    return ms / 1000 / max(1, gpus), note


def schedules(extract_gpu_s: float, train_gpu_s: float, epochs: int, E: int, T: int) -> dict:
    """Seconds of the three schedules: `extract_gpu_s` and `train_gpu_s` are the stages' work on one GPU (both
    scale by GPUs), E extraction and T training GPUs (see the module docstring).
    - split: training follows on T; its first epoch ends no sooner than extraction (x), the other epochs after it;
    - expand: by x the T GPUs trained what they could (T x, at most the first epoch), the rest on all E + T;
    - sequential: extraction on all E + T, then training on all of them."""
    N, x = E + T, extract_gpu_s / E
    later = train_gpu_s * (epochs - 1) / max(1, epochs)
    split = max(train_gpu_s / T, x + later / T) if T else float("inf")
    done = min(T * x, train_gpu_s - later)  # the first epoch is all there is to train while the store grows
    return {"split": split, "expand": x + (train_gpu_s - done) / N, "sequential": (extract_gpu_s + train_gpu_s) / N}


def _training_gpus(shards: int, train_gpus: Optional[int], cuda: bool) -> tuple[int, int, str]:
    """(training GPUs, of them beside extraction, where they come from): the command's, or for `dflash extract
    --plan` (None) the rest of the node (this machine's GPUs, or NODE_GPUS_NO_GPU H200s), else, when extraction
    takes the whole node, its own GPUs after it."""
    if train_gpus is not None:
        return train_gpus, train_gpus, ""
    import torch

    node = torch.cuda.device_count() if cuda else NODE_GPUS_NO_GPU
    where = f"{node} GPU(s) here" if cuda else f"{node} x H200 assumed: no GPU here"
    if node > shards:
        return node - shards, node - shards, f" (the rest of the node: {where})"
    return shards, 0, f" (after extraction, on its GPUs: the node has no other; {where})"


def make_plan(cfg: Config, store_path: str, shards: int, out=sys.stderr, train_gpus: Optional[int] = None) -> Plan:
    """The plan for `shards` extraction GPUs working at once and `train_gpus` training GPUs beside them (None:
    `dflash extract --plan`'s node: this machine's GPUs, or NODE_GPUS_NO_GPU, less the extraction's)."""
    from data.ingest import ingest
    from pipeline.target import DTYPES, load_tokenizer, resolve_layer_ids

    import torch

    meta, d = _target_meta(cfg)
    H, L_target = meta.hidden_size, meta.num_hidden_layers
    ids = resolve_layer_ids(cfg.target.layer_ids, L_target, cfg.target.num_feature_layers)
    enc = cfg.store.encoding
    try:
        check_encoding(enc, H)
    except ValueError as e:
        raise st.StoreError(f"store.encoding: {e}") from None
    tokenizer = load_tokenizer(cfg.target.path, cfg.target.trust_remote_code)
    samples, report = ingest(cfg.data, tokenizer)
    print(report.summary(), file=out)
    n = {"train": 0, "validation": 0}
    t = {"train": 0, "validation": 0}
    train_lengths = []
    for s in samples:
        n[s.split] += 1
        t[s.split] += len(s.input_ids)
        if s.split == "train":
            train_lengths.append(len(s.input_ids))
    tokens = sum(t.values())
    raw = raw_bytes_per_token(enc, len(ids), H)
    size = size_class(H)
    factor = compression_factor(enc, H)
    measured = factor is not None
    factor = factor if measured else 1.0  # an encoding not measured yet: its raw size (lossy codes barely compress)
    cuda = torch.cuda.is_available()
    dtype_bytes = torch.empty(0, dtype=DTYPES[cfg.target.dtype if cuda else cfg.target.cpu_dtype]).element_size()
    head = head_bytes(meta, dtype_bytes)
    total = tokens * (raw * factor + TOKEN_BYTES) + len(samples) * SAMPLE_BYTES + head
    free, at = free_disk(store_path)
    weights = sum(f.stat().st_size for f in d.glob("*.safetensors")) or None
    seconds, note = estimate_time(tokens, shards, weights, cuda, cfg.extract.fast_forward,
                                  fp8_block=cfg.extract.target_precision in ("fp8-block", "fp8-block-from-bf16"))
    where = ("the tiny target's features" if size == "tiny" else "27B-shaped synthetic activations") + \
        f" ({'hidden < ' if size == 'tiny' else 'hidden >= '}{LARGE_HIDDEN}; pipeline/encoding.py COMPRESSION)"
    if not measured:
        where = f"nothing: no factor measured for {enc} yet (pipeline/encoding.py COMPRESSION), so its raw size"
    train_gpus, beside, train_where = _training_gpus(shards, train_gpus, cuda)
    train_seconds, train_note = estimate_training(cfg, train_lengths, train_gpus)
    plan = Plan(n, t, raw * factor, raw, factor, where, head, total, free, at, seconds, note, train_seconds,
                train_note, shards, train_gpus, train_where=train_where)
    if train_seconds is not None and seconds is not None:
        plan.schedules = schedules(seconds * shards, train_seconds * train_gpus, cfg.train.epochs, shards, beside)
    return plan


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB" if x >= 1e8 else f"{x / 1e6:,.1f} MB"


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else (f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s")


def _say_schedules(p: Plan, say) -> None:
    E, T = p.extract_gpus, p.train_gpus
    if p.schedules is None:
        say("plan: schedules: n/a (they need both rates above)")
        return
    s = p.schedules
    beside = s["split"] != float("inf")
    N = E + T if beside else E
    say(f"plan: schedules on {N} GPU(s), from the rates above (the handover of an expansion, about a minute, "
        "not counted):")
    if beside:
        say(f"plan:   split, extraction on {E} and training on {T} (following the store): about "
            f"{_duration(s['split'])}")
    else:
        say(f"plan:   split: n/a (extraction takes all {E} GPUs: none is left to train beside it)")
    if beside:
        say(f"plan:   split with expansion, training on all {N} once extraction ends (`dflash run`'s default): "
            f"about {_duration(s['expand'])}")
    say(f"plan:   one stage after the other, extraction then training on all {N}: about {_duration(s['sequential'])}")


def run_plan(cfg: Config, *, store: Optional[str] = None, shards: Optional[int] = None, shard_index=None,
             train_gpus: Optional[int] = None, command: str = "extract") -> int:
    """Print the plan (stdout) and write nothing. `shards`: the GPUs working at once (one shard per GPU);
    `shard_index`: the shards of this call (one node's: `--shard-index 0-4`), which work at once; `train_gpus`:
    the training ranks of `dflash run` (None for `dflash extract`: the rest of the node, see `make_plan`)."""
    from stages.extract import parse_shard_set

    store_path = store or cfg.store.path
    num_shards = cfg.extract.shards if shards is None else shards
    shard_set = parse_shard_set(shard_index, num_shards)
    gpus = len(shard_set) if shard_set is not None else num_shards
    p = make_plan(cfg, store_path, gpus, train_gpus=train_gpus)
    say = print
    say(f"plan: {p.samples['train']:,} train samples ({p.tokens['train']:,} tokens), {p.samples['validation']:,} "
        f"validation samples ({p.tokens['validation']:,} tokens) after ingest")
    say(f"plan: store {store_path} ({cfg.store.encoding}): about {_gb(p.store_bytes)} = features "
        f"{p.raw_bytes_per_token:,} B/token raw x {p.factor:.3f} compression (measured on {p.factor_source}) "
        f"= {p.feature_bytes_per_token:,.0f} B/token, + {TOKEN_BYTES} B/token of ids and loss mask, + the "
        f"frozen head {_gb(p.head_bytes)}")
    if p.free_bytes is None:
        say(f"plan: free disk: unknown for {store_path} (not a local path)")
    else:
        short = p.store_bytes - p.free_bytes
        verdict = "enough" if short <= 0 else f"NOT enough: {_gb(short)} missing"
        say(f"plan: free disk at {p.free_at}: {_gb(p.free_bytes)} ({verdict})")
    if p.seconds is None:
        say(f"plan: time: {p.rate_note}")
    else:
        say(f"plan: time on {gpus} GPU(s): about {_duration(p.seconds)}, {p.rate_note}")
    if p.train_seconds is None:
        say(f"plan: training time: {p.train_note}")
    else:
        say(f"plan: training time on {p.train_gpus} GPU(s){p.train_where}: about {_duration(p.train_seconds)}, {p.train_note}")
    _say_schedules(p, say)
    if st.exists(store_path):
        say(f"plan: {store_path} exists: a rerun writes only what its shards have not committed (this plan counts "
            "the whole store)")
    say(f"plan: nothing was written; run the same command without --plan to {command}")
    return 0


def run_node_plan(cfg: Config, *, store: Optional[str], extract_gpus: str, train_gpus: str,
                  devices: Optional[int]) -> int:
    """`dflash run --plan`: the plan for its GPU lists (empty: its CPU shards, extract.shards, and --devices
    training processes), with the training count the command would really use."""
    from stages.run import parse_gpus

    ex, tr = parse_gpus(extract_gpus), parse_gpus(train_gpus)
    return run_plan(cfg, store=store, shards=len(ex) or None, train_gpus=len(tr) or devices or 1, command="run")
