"""Issue 19.6: samples of 8K-16K tokens through training (blocks, masks, chunked loss, the data path) and
extraction's batch plan, on CPU at a tiny width (bench/long_bench.py measures the 27B shape on the GPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from bench.train_bench import TINY, build_case, train_step
from pipeline.config import ConfigError, load_config
from pipeline.masks import dense_mask, make_attend

S_LONG = 8192
SHAPE = {k: v for k, v in TINY.items() if k not in ("seq", "anchors", "vocab", "layers")}


@pytest.fixture(scope="module")
def long_case():
    torch.manual_seed(0)
    return build_case("dflash", 2, TINY["vocab"], S_LONG, 48, 512, torch.device("cpu"), SHAPE, prompt=3000)


@pytest.mark.slow  # ~15-35 s: eager flex on CPU over 8K context
def test_long_sample_flex_equals_sdpa(long_case):
    """At 8192 context tokens (anchors spread over the whole sample, sliding window 2048 and full attention),
    eager flex with the block tables gives the SDPA reference's outputs, as at short lengths."""
    c = long_case
    assert int(c.anchors.min()) >= 3000 and int(c.anchors.max()) > S_LONG - 1500  # blocks late in the sample
    out = {}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # eager flex_attention on CPU warns that it is not compiled
        ctx = c.drafter.project_context(c.feats)
        emb = torch.nn.functional.embedding(c.blocks.input_ids, c.embed)
        for kind in ("sdpa", "flex"):
            attend = make_attend(kind, anchors=c.anchors, block_size=c.bs, ctx_len=c.S, layer_types=c.types,
                                 sliding_window=2048, seq_lens=torch.tensor([c.S]), compile=False)
            out[kind] = c.drafter(emb, ctx, c.blocks.positions, c.ctx_pos, attend)
    assert out["sdpa"].shape == (1, c.Q, c.arch.hidden_size) and torch.isfinite(out["sdpa"]).all()
    assert torch.allclose(out["flex"], out["sdpa"], atol=1e-5)
    # the sliding window really cuts the long context: the last slot (position anchor + 15) of a late block sees
    # the 2048 - 16 context positions before its anchor that lie in its window, not thousands
    m = dense_mask(c.anchors, c.bs, c.S, window=2048)[0, 0, -1, : c.S]
    assert int(m.sum()) == 2048 - c.bs


@pytest.mark.slow  # ~10 s with the fixture
def test_long_sample_training_step(long_case):
    """One optimizer step (chunked loss over more rows than a chunk) at 8192 tokens: finite loss, and the
    weights move."""
    c = long_case
    before = [p.detach().clone() for p in c.drafter.parameters()]
    loss = float(train_step(c, "sdpa"))
    assert np.isfinite(loss) and loss > 0
    assert int((c.blocks.labels >= 0).sum()) > c.cfg.train.loss_chunk_rows  # several loss chunks
    moved = [not torch.equal(a, b) for a, b in zip(before, c.drafter.parameters())]
    assert sum(moved) >= len(moved) - 1  # (the frozen-free drafter: every trained tensor changes)


def test_long_sample_through_the_loader(tmp_path):
    """A store holding an 8,200-token sample next to a short one: the dataset reads it whole, anchors land in
    its labelled part only, collate pads both to the 128-multiple of the longest, seq_lens keep the truth."""
    from data.store_dataset import StoreDataset, collate
    from helpers_store import synthetic_store

    lengths, prompt = [8200, 150], 1000
    path = synthetic_store(str(tmp_path / "long.zarr"), lengths, prompt=lambda n: min(prompt, n // 2), hidden=32,
                           chunk_tokens=1024, max_length=16384)
    ds = StoreDataset(path, [0, 1], num_anchors=512, seed=0, anchors_per_token=512 / 16384)
    items = [ds[0], ds[1]]
    assert items[0]["tokens"].shape == (8200,) and int(items[0]["anchors"].min()) >= prompt
    assert items[0]["anchors"].numel() == round((8200 - prompt) * 512 / 16384)  # 225: proportional to labels
    assert items[1]["anchors"].numel() == round(75 * 512 / 16384)  # 2 for the short one, not 225
    batch = collate(items, pad_multiple=128, num_anchors=512)
    assert batch["tokens"].shape == (2, 8320) and batch["seq_lens"].tolist() == lengths
    assert batch["anchors"].shape == (2, 512) and int((batch["anchors"] >= 0).sum()) == 227


def test_extraction_plan_keeps_every_long_sample():
    """Samples longer than extract.token_budget are not dropped or split: each forms a batch of its own."""
    from stages.extract_worker import plan_batches

    lengths = [16384, 300, 20000, 9000, 200, 9000, 700]
    batches = plan_batches(lengths, token_budget=16384, max_batch_size=64)
    assert sorted(i for b in batches for i in b.members) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b.members)
        assert len(b.members) == 1 or len(b.members) * longest <= 16384
    assert [b.members for b in batches[:3]] == [[2], [0], [3]]  # 20000, 16384 alone; 9000 + 9000 > budget


def test_max_length_beyond_the_drafters_positions_is_refused():
    with pytest.raises(ConfigError, match=r"data.max_length \(8192\) exceeds drafter.max_position_embeddings \(512\)"):
        load_config(None, ["data.max_length=8192"])
    cfg = load_config(None, ["data.max_length=16384", "drafter.max_position_embeddings=16384"])
    assert cfg.data.max_length == 16384


@pytest.mark.slow  # extraction + two training steps at 8K tokens on the tiny target: 6 min on the loaded 2-core machine
def test_extract_and_train_an_8k_sample_end_to_end(tmp_path):
    """`dflash extract` and `dflash train` on conversations of ~8.3K and ~10 tokens with data.max_length 8192:
    the long one is stored whole (truncated to max_length, not dropped), training steps over it."""
    import json

    from helpers_cli import TINY, dflash
    from pipeline.store_reader import StoreReader

    words = "the list is violin , bottle , umbrella . so the first item is violin .".split()
    long_text = " ".join(words[i % len(words)] for i in range(5000))
    rows = [{"messages": [{"role": "user", "content": long_text[:20000]},
                          {"role": "assistant", "content": long_text}]}]
    rows += [{"messages": [{"role": "user", "content": f"what is {i} plus one ?"},
                           {"role": "assistant", "content": f"it is {i + 1} ."}]} for i in range(8)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store, run = str(tmp_path / "s.zarr"), tmp_path / "run"
    sets = ["data.max_length=8192", "drafter.max_position_embeddings=8192", f"data.train_files=[{data}]",
            "data.validation_files=[]", "data.validation_fraction=0.0"]
    dflash("extract", "--config", TINY, "--shards", "1", "--store", store, *[x for s in sets for x in ("--set", s)])
    lengths = sorted(s.length for s in StoreReader(store).samples)
    assert lengths[-1] == 8192 and len(lengths) == 9  # the long sample truncated to max_length, kept
    dflash("train", "--config", TINY, "--store", store, *[x for s in [*sets, f"train.run_dir={run}",
           "train.max_steps=2", "train.batch_size=2", "train.num_workers=0", "train.num_anchors=64",
           "train.anchor_rule=proportional"] for x in ("--set", s)])
    assert (run / "summary.json").exists()


@pytest.mark.slow  # two bench subprocesses, ~20-50 s
def test_device_run_long_parts_at_tiny_size(tmp_path):
    """bench/device_run.sh's `long` and `longdiag` parts (issue 28.1; built by bench/parts.py) are the command lines
    the GPU run uses; here
    at a tiny width on CPU: long_bench writes a row per point with step time, MFU and the useful FLOPs, and
    compile_diag one JSON line per point (ok, no failing kernel) plus the dumped Inductor sources."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    import sys

    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "bench.parts", "run", "--tiny", "long", "longdiag"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and "unknown part" not in r.stdout and "FAILED" not in r.stdout, r.stdout + r.stderr
    rows = json.loads((tmp_path / "long.json").read_text())["points"]
    assert [(p["S"], p["anchors"]) for p in rows] == [(256, 16), (1024, 32)]
    for p in rows:
        assert p["step_ms"] > 0 and p["useful_tflop"] > 0 and 0 < p["mfu"] < 1, p
    assert rows[1]["useful_tflop"] > rows[0]["useful_tflop"]  # more anchors, more context: more useful work
    diag = [json.loads(x) for x in (tmp_path / "longdiag.jsonl").read_text().splitlines()]
    assert [(d["S"], d["ok"], d["failing_kernels"], d["layer_options"]) for d in diag] == [(256, True, [], "{}")]
    assert "def get_block_shape(" in (tmp_path / "inductor_src.txt").read_text()


def test_ordered_tables_equal_a_stable_descending_argsort():
    """pipeline/masks.py `_ordered` (one cumsum through the `dflash::row_cumsum` op, issue 28.1): each row's
    set columns first, ascending, then the unset ones, as a stable descending argsort; counts per row; also on
    a transposed (non-contiguous) view, as the q-side tables are built."""
    from pipeline.masks import _ordered

    g = torch.Generator().manual_seed(0)
    tiles = torch.rand(2, 1, 24, 40, generator=g) > 0.6
    for t in (tiles, tiles.transpose(-2, -1)):
        count, order = _ordered(t)
        ref = torch.sort(t.to(torch.int8), dim=-1, descending=True, stable=True).indices
        assert count.dtype == order.dtype == torch.int32
        assert torch.equal(count, t.sum(-1).to(torch.int32)) and torch.equal(order, ref.to(torch.int32))


@pytest.mark.slow  # an Inductor (C++) compile of the table builder, ~30-60 s on a loaded 2-core machine
def test_compiled_table_builder_equals_eager_on_cpu():
    """The table builder compiled (as on CUDA) with `row_cumsum` as an opaque op inside the graph gives the
    eager builder's eight tables exactly; tests/test_gpu_long.py checks the same at 8K/16K tokens on the GPU."""
    from pipeline import masks

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    lm = torch.ones(700, dtype=torch.bool)
    lm[:50] = False
    anchors = masks.sample_anchors(lm, 40, g)[None]
    lens = torch.tensor([700])
    comp = torch.compile(masks._all_tables, fullgraph=True)  # one graph: no break around the op
    for window in (96, None):
        got, ref = comp(anchors, lens, 16, 700, window), masks._all_tables(anchors, lens, 16, 700, window)
        assert all(x.dtype == torch.int32 and torch.equal(x, y) for x, y in zip(got, ref))
