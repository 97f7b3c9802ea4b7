"""The allowed range of every numeric config key: one table, checked when the config loads, before anything is made.

Contract:
- `RANGES` maps (section, key) to a `Range` for every int and float field of pipeline/config_sections.py's sections (a
  list field is checked per entry; an arch's section inside drafter is section "drafter.dflash2");
  tests/test_config_ranges.py holds that every numeric field is in it, so a
  new numeric key comes with its range.
- `check_ranges(cfg)` (called by `config_parse._validate` before its checks that relate keys to each other) raises
  `ConfigError` for the first value outside its range, as one line naming the file, the key, the allowed range
  and the value: `FILE: train.warmup_ratio must be in [0, 1], got 7.0`. Floats must be finite: NaN and inf are
  outside every range. None passes where the field's type allows it (the range text says what null means).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from pipeline.errors import ConfigError

U32 = 2**32 - 1  # seeds: numpy's and Lightning's seed_everything's range
MAX_BLOCK = 128  # drafter.block_size: the paper's blocks are 8-16; each block slot is a row of the loss per anchor
# train.pack_tokens: one packed row is a single sequence through the drafter (its target features, attention and
# logits): 131072 tokens of the 27B target's 5 bf16 feature layers are already ~6.7 GB; 10^6 ran out of memory
MAX_PACK_TOKENS = 131072
PACK_PER_MAX_LENGTH = 64  # and at most this many samples of data.max_length per row (config_parse._validate)


@dataclass(frozen=True)
class Range:
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False  # lo itself is out
    hi_open: bool = False  # hi itself is out
    also: tuple = ()  # allowed values outside [lo, hi] (train.max_steps: -1)
    text: str = ""  # what the message says after "must be" (derived from the bounds when empty)
    length: Optional[int] = None  # a list key: the number of entries

    def allows(self, v: Any) -> bool:
        if v in self.also:
            return True
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and not (v > self.lo if self.lo_open else v >= self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def describe(self) -> str:
        if self.text:
            return self.text
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        if self.lo == 0:
            return "positive" if self.lo_open else "0 or more"
        return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


POSITIVE = Range(0, lo_open=True)  # > 0 (floats)
COUNT = Range(1, text="1 or more")  # ints
ZERO_UP = Range(0)  # >= 0
RATIO = Range(0, 1, hi_open=True)  # [0, 1)
TOP_P = Range(0, 1, lo_open=True)  # (0, 1]
SEED = Range(0, U32)
TEMPERATURE = Range(0, text=">= 0 (0 = greedy)")

RANGES: dict[tuple[str, str], Range] = {
    ("target", "layer_ids"): Range(0, text="0 or more (ids of target decoder layers)"),
    ("target", "num_feature_layers"): COUNT,
    ("data", "validation_fraction"): RATIO,
    ("data", "max_length"): COUNT,
    ("data", "max_samples"): Range(1, text="1 or more, or null for all"),
    ("store", "chunk_tokens"): COUNT,
    ("store", "clevel"): Range(0, 9),
    ("extract", "shards"): COUNT,
    ("extract", "token_budget"): COUNT,
    ("extract", "max_batch_size"): COUNT,
    ("extract", "queue_depth"): COUNT,
    ("extract", "writer_threads"): COUNT,
    ("drafter", "num_hidden_layers"): COUNT,
    ("drafter", "hidden_size"): COUNT,
    ("drafter", "intermediate_size"): COUNT,
    ("drafter", "num_attention_heads"): COUNT,
    ("drafter", "num_key_value_heads"): COUNT,
    ("drafter", "head_dim"): Range(2, text="2 or more"),
    ("drafter", "rms_norm_eps"): POSITIVE,
    ("drafter", "rope_theta"): POSITIVE,
    ("drafter", "max_position_embeddings"): COUNT,
    ("drafter", "sliding_window"): Range(1, text="1 or more, or null"),
    ("drafter", "block_size"): Range(2, MAX_BLOCK, text=f"in [2, {MAX_BLOCK}] (DFlash drafts 8 to 16 tokens per block)"),
    ("drafter", "mask_token_id"): ZERO_UP,
    ("drafter.dflash2", "conv_kernel_size"): COUNT,
    ("drafter.dflash2", "conv_group_size"): COUNT,
    ("drafter.dflash2", "selector_rank"): COUNT,
    ("drafter.dflash2", "selector_top_k"): COUNT,
    ("drafter.dflash2", "output_multiplier"): POSITIVE,
    ("drafter.dflash2", "final_logit_softcapping"): Range(0, lo_open=True, text="positive, or null for none"),
    ("train", "lr"): Range(0, text="0 or more"),  # 0: the weights stay as they are (a warm-start check)
    ("train", "weight_decay"): ZERO_UP,
    ("train", "betas"): Range(0, 1, hi_open=True, length=2),
    ("train", "warmup_ratio"): Range(0, 1),  # 1: warm up over the whole run (the LR rises to its peak at the end)
    ("train", "epochs"): COUNT,
    ("train", "max_steps"): Range(1, also=(-1,), text="-1 (run all epochs) or 1 or more"),
    ("train", "grad_clip"): Range(0, text="0 or more, or null (0 and null: no clipping)"),
    ("train", "num_anchors"): COUNT,
    ("train", "anchors_per_token"): Range(0, 1, lo_open=True),
    ("train", "gamma"): Range(0, lo_open=True, text="positive, or null for the paper's value for the block size"),
    ("train", "selector_loss_alpha"): ZERO_UP,
    ("train", "batch_size"): COUNT,
    ("train", "accumulate_grad_batches"): COUNT,
    ("train", "loss_chunk_rows"): COUNT,
    ("train", "num_workers"): ZERO_UP,
    ("train", "checkpoint_every"): COUNT,
    ("train", "val_every"): COUNT,
    ("train", "log_every"): COUNT,
    ("train", "seed"): SEED,
    ("train", "follow_buffer"): Range(0, text="0 or more (samples)"),
    ("train", "follow_timeout_s"): Range(0, lo_open=True, text="positive (seconds), or null to wait as long as it takes"),
    ("train", "length_group_factor"): Range(0, text="0 (no grouping by length) or more (batches per window)"),
    ("train", "pack_tokens"): Range(1, MAX_PACK_TOKENS, text=f"in [1, {MAX_PACK_TOKENS}] (tokens of one packed row, "
                                    "its features and logits on one GPU), or null for data.max_length"),
    ("train", "ddp_bucket_cap_mb"): POSITIVE,
    ("train", "num_nodes"): COUNT,
    ("train", "rendezvous_timeout_s"): Range(0, lo_open=True, text="positive (seconds)"),
    ("train", "collective_timeout_s"): Range(0, lo_open=True, text="positive (seconds)"),
    ("train", "profile_steps"): Range(0, length=2, text="two optimizer steps [first, last), 0 or more"),
    ("eval", "max_new_tokens"): COUNT,
    ("eval", "num_prompts"): COUNT,
    ("eval", "max_anchors_per_sample"): COUNT,
    ("eval", "temperature"): TEMPERATURE,
    ("eval", "top_p"): TOP_P,
    ("eval", "seed"): SEED,
    ("regenerate", "max_new_tokens"): Range(1, text="1 or more, or null for data.max_length"),
    ("regenerate", "temperature"): TEMPERATURE,
    ("regenerate", "top_p"): TOP_P,
    ("regenerate", "top_k"): Range(0, text="0 (off) or more"),
    ("regenerate", "seed"): SEED,
    ("regenerate", "max_batch_size"): COUNT,
    ("regenerate", "token_budget"): COUNT,
    ("regenerate", "max_prompt_tokens"): Range(1, text="1 or more, or null for data.max_length"),
    ("regenerate", "concurrency"): COUNT,
    ("regenerate", "request_timeout"): Range(0, lo_open=True, text="positive (seconds)"),
    ("regenerate", "retries"): ZERO_UP,
    ("regenerate", "retry_backoff"): Range(0, text="0 or more (seconds)"),
}


def check_ranges(cfg: Any) -> None:
    """Raise ConfigError for the first value outside its range (see the module contract)."""
    for (section, key), rng in RANGES.items():
        owner = cfg
        for part in section.split("."):  # "drafter.dflash2": an arch's section inside drafter
            owner = getattr(owner, part)
        value = getattr(owner, key)
        if value is None:  # the type said whether null is allowed
            continue
        where = f"{cfg.source}: {section}.{key}"
        if isinstance(value, list):
            if rng.length is not None and len(value) != rng.length:
                raise ConfigError(f"{where} must have {rng.length} entries, got {len(value)}: {value!r}")
            for i, v in enumerate(value):
                if not rng.allows(v):
                    raise ConfigError(f"{where}[{i}] must be {rng.describe()}, got {v!r}")
        elif not rng.allows(value):
            raise ConfigError(f"{where} must be {rng.describe()}, got {value!r}")
