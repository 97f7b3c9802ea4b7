"""Tiny drafter builders shared by the drafter, export and DFlash 2 tests: one toy shape (hidden 16, two layers
of 4 query / 2 key-value heads of 8, a sliding-window layer then a full one), varied per test by keyword."""

from __future__ import annotations

import torch

from pipeline.drafter import DFlashDrafter, DrafterArch

TINY_ARCH = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                 rope_theta=10000.0)


def tiny_arch(**overrides) -> DrafterArch:
    """TINY_ARCH with `overrides` (target_layer_ids is required); num_hidden_layers follows layer_types."""
    kw = {**TINY_ARCH, **overrides}
    kw["num_hidden_layers"] = len(kw["layer_types"])
    return DrafterArch(**kw)


def tiny_drafter(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> DFlashDrafter:
    """A seeded tiny drafter whose norm weights are moved off their initial ones, so every parameter matters."""
    torch.manual_seed(seed)
    d = DFlashDrafter(tiny_arch(**overrides)).to(dtype)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return d
