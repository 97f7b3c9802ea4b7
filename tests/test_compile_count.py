"""Issue 46 item 2: one compile per run, packed or not. The compiled step's graphs are counted on the CPU (a
counting backend in place of Inductor; the guards and recompiles are dynamo's, the same as on the GPU): a packed
run whose batches change their anchor width and row length compiles each layer variant once, in training (SDPA
with its backward: flex has no CPU backward) and with flex attention's BlockMask (no grad, as validation runs);
the table builder likewise. Torch's default (static first) recompiles on the same batches, so the counts can fail.
`shapes_vary` decides, from the data plan, when a run's compile is dynamic from its first step."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

import pipeline.masks as masks
from data.packing import collate_packed
from data.sampler import FixedSamples, RankBatchSampler, shapes_vary
from helpers_drafters import tiny_drafter  # noqa: F401  (the shared toy shapes live there)
from pipeline.compile_setup import no_duck_shapes
from pipeline.config import load_config
from pipeline.train_step import build_drafter, step_loss
from test_packing import _doc

# rows of document lengths, two rows a batch: anchor width and row length change from batch to batch
# (every batch at least two 128-tiles long: a size of one tile is specialised by dynamo, dynamic or not)
BATCHES = [[[90, 17], [130]], [[40, 7, 200], [50]], [[60], [120, 100]], [[250], [30, 9, 100, 40]],
           [[500], [30, 9, 100, 40]], [[300], [64, 30]]]


class Counter:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, inputs):
        self.graphs += 1
        return gm.forward


def _batches(hidden: int, block_size: int, n: int = len(BATCHES)):
    g = torch.Generator().manual_seed(3)
    for rows in BATCHES[:n]:
        docs = []
        for r, lens in enumerate(rows):
            for n in lens:
                d = _doc(n, g, n % 2 == 0, vocab=60, hidden=hidden)
                d["row"] = r
                docs.append(d)
        # what stages/train_store.py does on the GPU: rows padded to 128, anchors to a multiple of 128 // block size
        yield collate_packed(docs, pack_tokens=512, pad_multiple=128, anchor_multiple=max(1, 128 // block_size))


@pytest.fixture(autouse=True)
def _no_duck_shapes():
    """What prepare_compile(dynamic=True) sets for the run, undone after each test."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(use_duck_shape=fx_config.use_duck_shape):
        assert no_duck_shapes()
        yield


def _graphs_per_step(dynamic, kind: str, n: int = len(BATCHES)) -> list[int]:
    torch._dynamo.reset()
    cfg = load_config(None, [])
    torch.manual_seed(0)
    drafter = build_drafter(cfg, [1, 3, 5], 60)
    hid = cfg.drafter.hidden_size
    g = torch.Generator().manual_seed(4)
    embed, head = torch.randn(60, hid, generator=g), torch.randn(60, hid, generator=g)
    count = Counter()
    drafter.compile_layers(backend=count, options=None, dynamic=dynamic)
    seen, shapes = [], set()
    for b in _batches(hid, cfg.drafter.block_size, n):
        shapes.add((tuple(b["tokens"].shape), tuple(b["anchors"].shape)))
        grad = kind == "sdpa"
        with contextlib.nullcontext() if grad else torch.no_grad():
            loss, *_ = step_loss(drafter, b["tokens"], b["loss_mask"], b["anchors"], b["seq_lens"], b["features"],
                                 embed, head, cfg, kind, doc_ids=b["doc_ids"])
        if grad:
            loss.backward()
        seen.append(count.graphs)
    assert len(shapes) >= min(n, 5)  # the batches do change shape
    torch._dynamo.reset()
    return seen


@pytest.mark.parametrize("kind", ["sdpa", pytest.param("flex", marks=pytest.mark.slow)])  # flex: eager on the CPU
def test_a_packed_run_compiles_once(kind):
    dynamic = _graphs_per_step(True, kind)
    assert dynamic[0] > 0 and dynamic[-1] == dynamic[0], dynamic  # every graph at step 1, none after
    static_first = _graphs_per_step(None, kind, n=3)
    assert static_first[-1] > static_first[0], static_first  # torch's default recompiles on these batches


def test_the_table_builder_compiles_once_when_dynamic(monkeypatch):
    count = Counter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=count, **kw))
    monkeypatch.setattr(masks, "_COMPILED", {})
    torch._dynamo.reset()
    try:
        masks.set_dynamic_shapes(True)
        tables = []
        for b in _batches(16, 8):
            bm = masks.flex_block_mask(b["anchors"], 8, b["tokens"].shape[1], b["seq_lens"], None, compile=True,
                                       doc_ids=b["doc_ids"])
            ref = masks.flex_block_mask(b["anchors"], 8, b["tokens"].shape[1], b["seq_lens"], None, compile=False,
                                        doc_ids=b["doc_ids"])
            assert torch.equal(bm.kv_indices, ref.kv_indices) and torch.equal(bm.full_kv_num_blocks,
                                                                             ref.full_kv_num_blocks)
            tables.append(count.graphs)
        assert tables == [1] * len(tables)
        masks.set_dynamic_shapes(None)  # torch's default on the same batches: static, then recompiled
        for b in _batches(16, 8):
            masks.flex_block_mask(b["anchors"], 8, b["tokens"].shape[1], b["seq_lens"], None, compile=True,
                                  doc_ids=b["doc_ids"])
        assert count.graphs > 2
    finally:
        masks.set_dynamic_shapes(None)
        torch._dynamo.reset()


def test_shapes_vary_follows_the_data_plan():
    def sampler(lengths, **kw):
        return RankBatchSampler(FixedSamples(list(range(len(lengths))), lengths), 2, 0, 1, 0, **kw)

    assert not shapes_vary(sampler([3072] * 6), 128)  # one padded length: static kernels stay
    assert not shapes_vary(sampler([3000, 3072, 2950]), 128)  # all pad to 3,072
    assert shapes_vary(sampler([3000, 3072, 2950]), 1)  # the CPU pads nothing
    assert shapes_vary(sampler([100, 3072]), 128)
    assert shapes_vary(sampler([3072] * 6, pack_tokens=8192), 128)  # packed: the anchor width varies
    assert shapes_vary(None, 128)
