"""The target families dflash knows (`FAMILIES`), and the lookups every other module uses instead of a family's
names: a new family is its own file in this folder plus one entry here.

Contract:
- `family_for(raw)` -> the family of a parsed config.json (by its top-level `model_type`), `OTHER` for a model
  type no family lists (any transformers causal LM still loads, without a family's extras).
- `TEXT_PREFIXES`, `SKIP_PREFIXES`, `TEXT_MODEL_ATTRS`: the union over the families (a checkpoint key is mapped
  without knowing its family: no two families' prefixes collide).
- `linear_families()`: the families with linear-attention layers; `linear_layer_count(layer_types)`: how many
  of a target's layers are linear-attention ones (the store's root record keeps layer_types).
"""

from __future__ import annotations

from pipeline.targets.family import OTHER, TargetFamily
from pipeline.targets.qwen3 import QWEN3
from pipeline.targets.qwen3_5 import QWEN3_5

FAMILIES: dict[str, TargetFamily] = {f.name: f for f in (QWEN3, QWEN3_5)}

TEXT_PREFIXES = tuple(p for f in FAMILIES.values() for p in f.text_prefixes)
SKIP_PREFIXES = tuple(p for f in FAMILIES.values() for p in f.skip_prefixes)
TEXT_MODEL_ATTRS = tuple(dict.fromkeys(f.text_model_attr for f in FAMILIES.values() if f.text_model_attr))


def family_for(raw: dict) -> TargetFamily:
    """The family whose model_types hold config.json's `model_type`, else OTHER."""
    model_type = raw.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    return OTHER


def family_named(model_type: str) -> TargetFamily:
    """The family of a model_type string (as the store's root record keeps it)."""
    return family_for({"model_type": model_type})


def linear_families() -> list[TargetFamily]:
    return [f for f in FAMILIES.values() if f.linear_layer_type]


def linear_layer_count(layer_types) -> int:
    """How many entries of a target's `layer_types` name a linear-attention layer of any family."""
    names = {f.linear_layer_type for f in linear_families()}
    return sum(t in names for t in (layer_types or []))
