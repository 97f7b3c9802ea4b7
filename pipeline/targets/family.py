"""What dflash knows about one family of target models, as one record (`TargetFamily`).

A family is the set of checkpoints that share a config layout, a weight-key layout, a decoder layout and a cache
(dense Qwen3: `pipeline/targets/qwen3.py`; the Qwen3.5/3.6 hybrid: `pipeline/targets/qwen3_5.py`). Every place
that depends on the family asks its record, found by `pipeline/targets/registry.py` from config.json's
`model_type`; `tests/test_target_families.py` fails when one of the family-naming identifiers (`NAMES` there)
appears in a file that no family lists in `files`.

Contract (every field is plain data, so a record is read without importing the model code):
- `model_types`: config.json `model_type` values of the family (the top level's: a VLM's, not its text part's).
- `text_section`: the key of the text model's config inside a VLM's config.json, or None (the file is the text
  model's config); the reader falls back to the top level when the key is absent.
- `text_prefixes`: checkpoint key prefix -> the text-only causal LM's prefix; `skip_prefixes`: weights the text
  model never loads (vision tower, multi-token-prediction head).
- `text_model_attr`: the attribute of the loaded base model that holds the text decoder (a VLM), or None.
- `linear_layer_type`: the `layer_types` entry of a linear-attention layer (None: every layer is attention).
- `modeling_module`: transformers' modeling module of the family (the kernels it binds are reported from it).
- `fast_forward_classes`: (decoder layer, linear-attention mixer, norm) class names `pipeline/fast_forward.py`
  rebinds; empty: no fast forward.
- `rollback`: how speculative decoding forgets rejected tokens in the family's cache: "crop" (KV layers only)
  or "snapshot-replay" (linear-attention states restored and advanced, `pipeline/target_cache.py`).
- `files`: the repository files that hold this family's knowledge besides its record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TargetFamily:
    name: str
    title: str
    model_types: tuple[str, ...]
    text_section: Optional[str] = None
    text_prefixes: tuple[tuple[str, str], ...] = ()
    skip_prefixes: tuple[str, ...] = ()
    text_model_attr: Optional[str] = None
    linear_layer_type: Optional[str] = None
    modeling_module: Optional[str] = None
    fast_forward_classes: tuple[str, ...] = ()
    rollback: str = "crop"
    files: tuple[str, ...] = ()

    def text_part(self, raw: dict) -> dict:
        """The text model's section of a parsed config.json (the top level when the family has none there)."""
        section = raw.get(self.text_section) if self.text_section else None
        return section if isinstance(section, dict) else raw

    def linear_layers(self, layer_types: Optional[list]) -> int:
        """How many of `layer_types` are linear-attention layers."""
        if self.linear_layer_type is None:
            return 0
        return sum(t == self.linear_layer_type for t in (layer_types or []))


# Any other decoder-only model transformers' AutoModelForCausalLM builds: the text config is the file itself (or
# transformers' usual `text_config` section), every layer attention, no fast forward.
OTHER = TargetFamily(name="other", title="a transformers causal LM", model_types=(), text_section="text_config")
