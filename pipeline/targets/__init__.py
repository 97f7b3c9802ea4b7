"""Target families: what dflash knows about each kind of target, one record per family (`family.py`, one file per
family, `registry.py`), and the one reader of a target's config.json (`config_file.py`). Importing this package
imports no model code and no transformers (transformers_text_config imports it when called)."""

from pipeline.targets.config_file import TargetConfig, read_target_config, transformers_text_config
from pipeline.targets.family import OTHER, TargetFamily
from pipeline.targets.registry import (FAMILIES, SKIP_PREFIXES, TEXT_MODEL_ATTRS, TEXT_PREFIXES, family_for,
                                       family_named, linear_families, linear_layer_count)

__all__ = ["FAMILIES", "OTHER", "SKIP_PREFIXES", "TEXT_MODEL_ATTRS", "TEXT_PREFIXES", "TargetConfig",
           "TargetFamily", "family_for", "family_named", "linear_families", "linear_layer_count", "read_target_config",
           "transformers_text_config"]
