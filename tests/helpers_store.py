"""A synthetic one-shard store for loader tests: int5 features of 2 layers, token ids i % 100, a prompt of
unlabelled tokens at the start of each sample. Shared by tests/test_loader.py and tests/test_long_samples.py."""

from __future__ import annotations

import numpy as np
import torch

from pipeline import store as st
from pipeline.encoding import encode
from pipeline.provenance import create_or_open_store
from pipeline.store_writer import ShardWriter


def synthetic_provenance(hidden: int = 64, chunk_tokens: int = 64, max_length: int = 256,
                         fingerprint: str = "t") -> dict:
    """The root record of a one-shard int5 store of an 8-layer target (features of layers 1 and 3)."""
    return {"schema_version": st.SCHEMA_VERSION, "target": {"name": "t", "hidden_size": hidden, "vocab_size": 100,
            "num_hidden_layers": 8, "tie_word_embeddings": False}, "layer_ids": [1, 3], "hidden_size": hidden,
            "encoding": "int5", "chunk_tokens": chunk_tokens, "clevel": 1, "num_shards": 1,
            "dataset": {"fingerprint": fingerprint, "validation_samples": 0}, "max_length": max_length}


def synthetic_store(path: str, lengths: list[int], prompt, hidden: int = 64, chunk_tokens: int = 64,
                    max_length: int = 256, seed: int = 0) -> str:
    """Write a finished store at `path`, sample i of lengths[i] tokens with id i + 1, its first prompt(n) tokens
    unlabelled (prompt: a function of the length). Features are seeded random, encoded int5."""
    prov = synthetic_provenance(hidden, chunk_tokens, max_length)
    create_or_open_store(path, prov)
    w = ShardWriter(path, 0, prov)
    w.start("plan", len(lengths), sum(lengths))
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate(lengths):
        parts = {k: v.numpy() for k, v in encode(torch.randn(n, 2, hidden, generator=g), "int5").items()}
        mask = np.ones(n, np.uint8)
        mask[: prompt(n)] = 0
        w.write_batch(np.array([i + 1], np.uint64), np.zeros(1, np.uint8), np.array([n], np.int32),
                      np.arange(n, dtype=np.int32) % 100, mask, parts)
    w.finish()
    return path
