"""Sizes stored with a drafter checked before it is built (issue 40 item 4): `check_sizes` is called by the
checkpoint loader (pipeline/archs.py `drafter_from_arch_dict`) and by both export loaders (pipeline/export1.py,
pipeline/export2.py) before anything is allocated.

Contract: each size within pipeline/config_ranges.py's range for its drafter key, the layer count that of the
weights stored, and every tensor of the drafter (built on the meta device: nothing allocated) the shape of the
stored one; otherwise `ArchError`, one line (a hidden size of 10^7 hung export and eval before). Its own module,
below the arch registry, because the export loaders that archs.py imports call it (no import circle).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .errors import UserError


class ArchError(UserError, ValueError):
    """A checkpoint's or an export's stored architecture that no drafter can be built from, or that does not fit
    the weights stored with it (a damaged or edited file); nothing was allocated for it."""


def check_sizes(values: dict, shapes: dict[str, tuple], where: str, build: Callable[[], nn.Module]) -> None:
    """Raise ArchError unless the architecture `values` fits the stored `shapes` (see the module docstring);
    `build` makes the drafter of `values` (called on the meta device, after the sizes are bounded)."""
    from .config_ranges import RANGES

    fix = "the file is damaged or was edited: use another checkpoint, or export the run again"
    for key, v in values.items():
        rng = RANGES.get(("drafter", key)) or RANGES.get(("drafter.dflash2", key))  # an arch's own keys too
        if rng is not None and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                  or not rng.allows(v)):
            raise ArchError(f"{where}: its stored architecture's {key} must be {rng.describe()}, got {v!r}; {fix}")
    layers = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    n = values.get("num_hidden_layers")
    if n != len(layers):
        raise ArchError(f"{where}: its stored architecture has num_hidden_layers {n!r}, its weights "
                        f"{len(layers)} layers; {fix}")
    try:
        with torch.device("meta"):
            expected = {k: tuple(t.shape) for k, t in build().state_dict().items()}
    except (TypeError, ValueError, KeyError) as e:
        raise ArchError(f"{where}: its stored architecture is not one a drafter can have ({e}); {fix}") from None
    bad = next(((k, shape) for k, shape in expected.items() if shapes.get(k) != shape), None)
    if bad is not None:
        sizes = ", ".join(f"{k} {values[k]}" for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                        "num_key_value_heads", "head_dim") if k in values)
        got = shapes.get(bad[0])
        raise ArchError(f"{where}: its stored architecture ({sizes}) does not fit its weights: {bad[0]} is "
                        f"{list(got) if got is not None else 'missing'}, the architecture needs {list(bad[1])}; {fix}")
