"""Seeded drafter batches, shared by the attention tests (tests/test_gpu_attention.py) and the is_causal checks
(tests/helpers_is_causal.py, whose GPU and CPU tests both use it), and the relative error they compare by."""

from __future__ import annotations

import torch

from pipeline.masks import sample_anchors, stack_anchors


def anchor_batch(device, S: int, *, vocab: int, feat_dim: int, block_size: int, prompt: int, short_by: int,
                 num_anchors: int, seed: int = 0) -> dict:
    """Two rows of S random tokens (ids below `vocab`) on `device`: tokens, loss_mask (0 on the first `prompt`
    positions and past row 1's end), seq_lens (row 1 is `short_by` shorter), anchors (num_anchors sampled per row,
    stacked to a multiple of 128 // block_size) and feats (B, S, feat_dim); all drawn from one generator of `seed`."""
    B = 2
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    loss_mask = torch.ones(B, S, dtype=torch.long)
    loss_mask[:, :prompt] = 0
    seq_lens = torch.tensor([S, S - short_by])
    loss_mask[1, S - short_by:] = 0
    anchors = stack_anchors([sample_anchors(loss_mask[b], num_anchors, g) for b in range(B)], num_anchors,
                            multiple=128 // block_size)
    feats = torch.randn(B, S, feat_dim, generator=g)
    return {k: v.to(device) for k, v in dict(tokens=tokens, loss_mask=loss_mask, anchors=anchors, feats=feats,
                                             seq_lens=seq_lens).items()}


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
