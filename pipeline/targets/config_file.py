"""The one reader of a target's config.json: `read_target_config(d)` (the JSON, through its family) and
`transformers_text_config(d)` (transformers' config object of the text model, to build it).

Contract:
- `read_target_config(d)` -> `TargetConfig`: the parsed file (`raw`), the text model's section (`text`), its
  family, and the fields dflash uses (layers, hidden size, vocabulary, tied head, rope theta, layer types,
  quantization). A FIFO in place of the file is refused unread (`pipeline.ckpt_io.require_regular`); a missing
  file or bad JSON raises the OSError or ValueError of the read, for the caller to word.
- Where a field is looked for: the text section first, then the top level (a VLM keeps `tie_word_embeddings`
  and `quantization_config` at the top, its text part the shapes); rope theta in `rope_parameters` when not
  flat (transformers 5).
- `transformers_text_config(d, keep_layers)`: `AutoConfig`'s text config, cut to its first keep_layers layers
  (their `layer_types` too).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline.targets.family import TargetFamily
from pipeline.targets.registry import family_for


@dataclass(frozen=True)
class TargetConfig:
    path: Path  # the config.json read
    raw: dict
    text: dict
    family: TargetFamily

    def get(self, key: str, default: Any = None) -> Any:
        """`key` from the text section, else the top level, else `default`."""
        return self.text.get(key, self.raw.get(key, default))

    @property
    def num_hidden_layers(self) -> int:
        return int(self.get("num_hidden_layers"))

    @property
    def hidden_size(self) -> int:
        return int(self.get("hidden_size"))

    @property
    def vocab_size(self) -> int:
        return int(self.get("vocab_size"))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.raw.get("tie_word_embeddings", self.text.get("tie_word_embeddings", False)))

    @property
    def rope_theta(self) -> Optional[float]:
        return self.text.get("rope_theta", (self.text.get("rope_parameters") or {}).get("rope_theta"))

    @property
    def layer_types(self) -> Optional[list]:
        return self.text.get("layer_types")

    @property
    def linear_layers(self) -> int:
        return self.family.linear_layers(self.layer_types)

    @property
    def quantization(self) -> Optional[dict]:
        """config.json's quantization_config (top level, else the text section), None when not quantized."""
        return self.raw.get("quantization_config") or self.text.get("quantization_config") or None


def read_target_config(d: str | Path) -> TargetConfig:
    """Parse `d`/config.json (see the module contract)."""
    from pipeline.ckpt_io import require_regular

    path = Path(d) / "config.json"
    require_regular(path, "target's config.json")  # a FIFO would block the read forever
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    fam = family_for(raw)
    return TargetConfig(path=path, raw=raw, text=fam.text_part(raw), family=fam)


def transformers_text_config(d: str | Path, keep_layers: Optional[int] = None):
    """The text model's transformers config (a VLM's text part), cut to its first keep_layers layers."""
    from transformers import AutoConfig

    from pipeline.ckpt_io import require_regular

    require_regular(Path(d) / "config.json", "checkpoint's config.json")
    cfg = copy.deepcopy(AutoConfig.from_pretrained(str(d)).get_text_config())
    n = int(cfg.num_hidden_layers)
    if keep_layers is not None and keep_layers < n:
        cfg.num_hidden_layers = int(keep_layers)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types)[:keep_layers]
    return cfg
