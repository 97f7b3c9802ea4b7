"""DFlash 2's own config keys: the `drafter.dflash2` section (pipeline/drafter2.py is the drafter they shape).

    drafter:
      arch: dflash2
      dflash2: {conv_kernel_size: 2, conv_group_size: 16, selector_rank: 256, selector_top_k: 16}

Contract:
- `DFlash2Config` holds the keys with the published 27B drafter's defaults; pipeline/config_sections.py nests it
  under `DrafterConfig.dflash2`; pipeline/config_parse.py validates its types like any section, its ranges through
  pipeline/config_ranges.py (section "drafter.dflash2"), and calls `check` when `drafter.arch` is dflash2 (the
  keys that relate to the drafter's other keys). A DrafterConfig field whose type is an arch's config class is how
  the config knows the archs (`DRAFTER_ARCHS`): the section's name is the arch's name (tests/test_archs.py holds
  them equal to pipeline/archs.py).
- `FLAT_KEYS`: the keys as they were written before (flat in `drafter:`); pipeline/config_parse.py still reads
  them, with a one-line deprecation, until the next release.
- Imports nothing of the project but the error type (config_sections.py and config_parse.py import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.errors import ConfigError


@dataclass
class DFlash2Config:
    conv_kernel_size: int = 2  # taps of the grouped dynamic convolution, within one block
    conv_group_size: int = 16  # channels sharing one dynamic kernel value (must divide drafter.hidden_size)
    selector_rank: int = 256  # rank of the selector's predecessor/successor codebooks
    selector_top_k: int = 16  # candidates per slot the selector walks through
    output_multiplier: float = 1.0  # unary logits = output_multiplier * (h @ lm_head^T) ...
    final_logit_softcapping: Optional[float] = None  # ... then cap * tanh(logits / cap) when set

    def check(self, drafter, src: str) -> None:
        """The keys against the drafter's shape (`drafter`: the DrafterConfig holding this section)."""
        if not 1 <= self.conv_kernel_size <= drafter.block_size:
            raise ConfigError(f"{src}: drafter.dflash2.conv_kernel_size = {self.conv_kernel_size} must be between 1 "
                              f"and drafter.block_size ({drafter.block_size}): the convolution stays inside one block")
        if self.conv_group_size <= 0 or drafter.hidden_size % self.conv_group_size:
            raise ConfigError(f"{src}: drafter.dflash2.conv_group_size = {self.conv_group_size} must divide "
                              f"drafter.hidden_size ({drafter.hidden_size})")


FLAT_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
             "final_logit_softcapping")
