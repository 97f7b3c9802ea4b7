"""Issue 28 items 2-3: sequence packing (train.packing) is right. Each document of a packed row gets exactly the
drafter output, labels and loss weights it gets alone (dense anchors, sliding-window layers, documents ending
mid-block); a packed batch's loss equals the unpacked batch's; the packing plan (data/packing.py) is
deterministic, fits the budget, trains every sample once per epoch, and resumes on another number of ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from data.packing import collate_packed, pack_rows, packed_plan, padding_stats
from data.sampler import RankBatchSampler
from data.store_dataset import collate
from helpers_drafters import tiny_drafter
from pipeline.config import ConfigError, load_config, pack_tokens
from pipeline.masks import anchor_candidates, build_blocks, dense_mask, make_attend, sample_anchors
from pipeline.train_step import build_drafter, step_loss

BS, W, L, H = 8, 6, 3, 16  # block size, sliding window, target layers, hidden


def _doc(n: int, g: torch.Generator, dense: bool, vocab: int = 50, hidden: int = H) -> dict:
    """A document of n tokens: loss mask on most positions, anchors (every candidate when dense, else a few,
    always including the last candidate so a block runs past the document's end), features [n, L*hidden]."""
    m = torch.rand(n, generator=g) > 0.15
    m[-2:] = True  # the last candidate is n - 2: its block ends mid-block, past the document
    cand = anchor_candidates(m)
    anchors = cand if dense else torch.unique(torch.cat([sample_anchors(m, 3, g), cand[-1:]]))
    return {"tokens": torch.randint(4, vocab, (n,), generator=g), "loss_mask": m, "anchors": anchors,
            "features": torch.randn(n, L * hidden, generator=g), "sample_id": n}


def _run(drafter, tokens, loss_mask, anchors, feats, embed, seq_lens, doc_ids=None):
    """The training forward's pieces (as pipeline.train_step.step_loss): -> (hidden [B, Q, H], blocks)."""
    B, S = tokens.shape
    blocks = build_blocks(tokens, loss_mask, anchors, BS, 3, 4.0, doc_ids)
    attend = make_attend("sdpa", anchors=anchors, block_size=BS, ctx_len=S, layer_types=drafter.arch.layer_types,
                         sliding_window=drafter.arch.sliding_window, seq_lens=seq_lens, doc_ids=doc_ids)
    ctx_pos = torch.arange(S).expand(B, S)
    if doc_ids is not None:
        starts = torch.stack([torch.tensor([int((doc_ids[b] == doc_ids[b, p]).nonzero()[0]) if doc_ids[b, p] >= 0 else p
                                            for p in range(S)]) for b in range(B)])  # a slow, obvious reference
        ctx_pos = ctx_pos - starts
    h = drafter(F.embedding(blocks.input_ids, embed), drafter.project_context(feats), blocks.positions, ctx_pos, attend)
    return h, blocks


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], ["full_attention", "full_attention"]])
def test_each_document_in_a_packed_row_equals_it_alone(dense, layer_types):
    g = torch.Generator().manual_seed(7 + dense)
    drafter = tiny_drafter(target_layer_ids=[1, 2, 3], layer_types=layer_types, sliding_window=W, block_size=BS)
    embed = torch.randn(50, H, generator=g)
    docs = [_doc(n, g, dense) for n in (37, 5, 21, 12, 3)]  # 3 and 5: shorter than a block
    rows = [docs[:3], docs[3:]]
    items = [dict(d, row=r) for r, row in enumerate(rows) for d in row]
    batch = collate_packed(items, pack_tokens=80, pad_multiple=16)
    assert batch["tokens"].shape == (2, 64) and batch["seq_lens"].tolist() == [63, 15]
    assert batch["docs_per_row"].tolist() == [3, 2]
    assert batch["doc_ids"][0, :63].tolist() == [0] * 37 + [1] * 5 + [2] * 21 and (batch["doc_ids"][0, 63:] == -1).all()
    with torch.no_grad():
        h, blk = _run(drafter, batch["tokens"], batch["loss_mask"], batch["anchors"], batch["features"], embed,
                      batch["seq_lens"], batch["doc_ids"])
    checked_blocks, cut_blocks = 0, 0
    for r, row in enumerate(rows):
        a0 = 0
        for d in row:
            A, n = len(d["anchors"]), len(d["tokens"])
            with torch.no_grad():
                h1, b1 = _run(drafter, d["tokens"][None], d["loss_mask"][None], d["anchors"][None], d["features"][None],
                              embed, torch.tensor([n]))
            sl = slice(a0 * BS, (a0 + A) * BS)
            torch.testing.assert_close(h[r, sl], h1[0], rtol=1e-5, atol=1e-5)  # the drafter's output per block row
            assert torch.equal(blk.labels[r, sl], b1.labels[0]) and torch.equal(blk.weights[r, sl], b1.weights[0])
            assert torch.equal(blk.positions[r, sl], b1.positions[0])  # RoPE positions restart per document
            assert torch.equal(blk.input_ids[r, sl], b1.input_ids[0])
            cut_blocks += int(((d["anchors"] + BS) > n).sum())  # blocks that run past the document's end
            checked_blocks += A
            a0 += A
    assert cut_blocks >= len(docs) and checked_blocks == sum(len(d["anchors"]) for d in docs)
    # without the document ids the same row leaks: the packed mask is what makes these equal
    with torch.no_grad():
        leak, _ = _run(drafter, batch["tokens"], batch["loss_mask"], batch["anchors"], batch["features"], embed,
                       batch["seq_lens"])
    assert not torch.allclose(leak, h, atol=1e-4)


def test_the_mask_sees_only_the_anchors_document():
    doc_ids = torch.tensor([[0] * 10 + [1] * 6 + [2] * 4 + [-1] * 4])  # S = 24
    anchors = torch.tensor([[3, 12, 15, 18]])
    for window in (None, 3):
        m = dense_mask(anchors, 4, 24, torch.tensor([20]), window, doc_ids=doc_ids)[0, 0]  # [16, 24 + 16]
        for j, (a, start) in enumerate([(3, 0), (12, 10), (15, 10), (18, 16)]):
            for k in range(4):
                lo = start if window is None else max(start, a + k - window + 1)
                assert m[j * 4 + k, :24].nonzero().flatten().tolist() == list(range(lo, a)), (window, j, k)


def test_full_loss_of_a_packed_batch_equals_the_unpacked_batch():
    """step_loss (THE training forward) on the same documents: packed rows vs one document per row give the same
    loss sum, the same gamma-weight sum (the normalisation) and the same correct count."""
    cfg = load_config(None, [])  # the tiny config: a sliding-window layer and a full one, block size 8
    torch.manual_seed(0)
    drafter = build_drafter(cfg, [1, 3, 5], 60)
    hid = cfg.drafter.hidden_size
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(60, hid, generator=g), torch.randn(60, hid, generator=g)
    docs = [_doc(n, g, dense, vocab=60, hidden=hid) for n, dense in [(90, True), (17, False), (130, False), (40, True), (7, True)]]
    packed = collate_packed(docs, pack_tokens=256, pad_multiple=8)  # no row ids: packed by pack_rows itself
    assert packed["tokens"].shape[0] < len(docs)
    plain = collate([{k: v for k, v in d.items()} for d in docs], pad_multiple=8)
    out = {}
    for name, b in (("packed", packed), ("plain", plain)):
        with torch.no_grad():
            loss_sum, correct, blocks, _ = step_loss(drafter, b["tokens"], b["loss_mask"], b["anchors"], b["seq_lens"],
                                                     b["features"], embed, head, cfg, "sdpa", doc_ids=b.get("doc_ids"))
        out[name] = (float(loss_sum), float(blocks.weights.sum()), int(correct[blocks.labels.reshape(-1) >= 0].sum()))
    assert out["packed"][1] == pytest.approx(out["plain"][1], rel=1e-6)
    assert out["packed"][0] == pytest.approx(out["plain"][0], rel=1e-5)
    assert out["packed"][2] == out["plain"][2]
    pad_packed, per_row = padding_stats(packed)
    assert per_row > 1 and pad_packed < padding_stats(plain)[0]


def test_pack_rows_best_fit_in_the_given_order():
    lengths = [5, 9, 3, 7, 2, 8, 1, 4]
    rows = pack_rows(lengths, 10)
    # each document, in order, into the fullest row it fits (not sorted first: rows stay random mixes)
    assert rows == [[0, 2, 4], [1, 6], [3], [5], [7]]
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert rows == pack_rows(lengths, 10)  # a pure function
    assert pack_rows([12, 3], 10) == [[0], [1]]  # a document longer than the budget gets its own row


def _items(batches):
    return [(k, r) for b in batches for item in b if not item[2] for k, r in [(item[0], item[3] if len(item) > 3 else None)]]


def test_packed_plan_deterministic_world_size_independent_and_resumable():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 250, (700,), generator=g).tolist()
    plan = packed_plan(lengths, 2, seed=4, epoch=0, pack_tokens=256)
    assert plan == packed_plan(lengths, 2, seed=4, epoch=0, pack_tokens=256) != packed_plan(lengths, 2, 4, 1, 256)
    assert sorted(i for b in plan for r in b for i in r) == list(range(700))
    assert all(sum(lengths[i] for i in r) <= 256 for b in plan for r in b)
    fill = sum(lengths) / (256 * sum(len(b) for b in plan))
    assert fill > 0.9, fill
    one = RankBatchSampler(lengths, 2, seed=4, pack_tokens=256)
    assert len(one) == len(plan)
    flat = [list(b) for b in one]
    assert [[k for k, *_ in b] for b in flat] == [[i for r in b for i in r] for b in plan]
    assert all(item[3] == r for b, pb in zip(flat, plan) for item, r in zip(b, [r for r, row in enumerate(pb) for _ in row]))
    # 3 ranks, 5 batches each, then resumed on 2: every sample once, rows as planned
    old = [RankBatchSampler(lengths, 2, rank=r, world_size=3, seed=4, pack_tokens=256) for r in range(3)]
    first = []
    for s in old:
        first += list(s)[:5]
        s.consumed = 5
    state = old[0].state_dict()
    assert state["pack_tokens"] == 256 and state["global_done"] == 15
    new = [RankBatchSampler(lengths, 2, rank=r, world_size=2, seed=4, pack_tokens=256) for r in range(2)]
    rest = []
    for s in new:
        s.load_state_dict(state)
        assert s.saved_pack_tokens == 256
        rest += list(s)
    seen = sorted(k for b in first + rest for k, _, filler, *_ in b if not filler)
    assert seen == list(range(700))
    # an unpacked checkpoint's state says so (stages/train.py refuses to resume it packed)
    plain = RankBatchSampler(lengths, 2, seed=4)
    s = RankBatchSampler(lengths, 2, seed=4, pack_tokens=256)
    s.load_state_dict(plain.state_dict())
    assert s.saved_pack_tokens is None


def test_config_keys():
    assert pack_tokens(load_config(None, [])) is None
    assert pack_tokens(load_config(None, ["train.packing=true", "data.max_length=200"])) == 200
    assert pack_tokens(load_config(None, ["train.packing=true", "train.pack_tokens=4096", "data.max_length=200"])) == 4096
    with pytest.raises(ConfigError, match="train.pack_tokens .* below data.max_length"):
        load_config(None, ["train.packing=true", "train.pack_tokens=100", "data.max_length=200"])
    with pytest.raises(ConfigError, match="pack_tokens is only used with train.packing=true"):
        load_config(None, ["train.pack_tokens=4096"])
    with pytest.raises(ConfigError, match="length_group_factor=32 has no effect with train.packing"):
        load_config(None, ["train.packing=true", "train.length_group_factor=32"])
    with pytest.raises(ConfigError, match="packin"):
        load_config(None, ["train.packin=true"])  # unknown keys are refused


@pytest.mark.gpu
@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_packed_flex_on_gpu_matches_sdpa_and_create_block_mask(layer_type):
    """On CUDA: the compiled BlockMask builder of a packed batch equals create_block_mask of the doc-id predicate,
    and compiled flex with it gives SDPA's output and gradients (bf16) for a packed row, dense anchors included."""
    from torch.nn.attention.flex_attention import create_block_mask

    from pipeline.masks import _pad_anchors, dflash_mask_mod, doc_starts, flex_block_mask, padded_len

    g = torch.Generator().manual_seed(1)
    Hd = 64
    d = tiny_drafter(target_layer_ids=[1, 2, 3], layer_types=[layer_type] * 2, sliding_window=96, block_size=16,
                     hidden_size=Hd, intermediate_size=128, head_dim=16).cuda().to(torch.bfloat16)
    docs = [_doc(n, g, dense, hidden=Hd) for n, dense in [(300, True), (9, False), (180, False), (140, True)]]
    batch = {k: (v.cuda() if torch.is_tensor(v) else v)
             for k, v in collate_packed(docs, pack_tokens=400, pad_multiple=128, anchor_multiple=8).items()}
    B, S = batch["tokens"].shape
    A = batch["anchors"].shape[1]
    window = 96 if layer_type == "sliding_attention" else None
    got = flex_block_mask(batch["anchors"], 16, S, batch["seq_lens"], window, doc_ids=batch["doc_ids"])
    q_len = padded_len(A * 16)
    mod = dflash_mask_mod(_pad_anchors(batch["anchors"], 16, q_len), batch["seq_lens"], S, 16, window,
                          doc_ids=batch["doc_ids"])
    ref = create_block_mask(mod, B, None, q_len, padded_len(S + q_len), device="cuda")
    assert torch.equal(got.to_dense(), ref.to_dense())
    embed = torch.randn(50, Hd, device="cuda", dtype=torch.bfloat16)
    probe = torch.randn(B, A * 16, Hd, device="cuda")
    out = {}
    for kind in ("sdpa", "flex"):
        d.zero_grad(set_to_none=True)
        blocks = build_blocks(batch["tokens"], batch["loss_mask"], batch["anchors"], 16, 3, 7.0, batch["doc_ids"])
        attend = make_attend(kind, anchors=batch["anchors"], block_size=16, ctx_len=S, layer_types=d.arch.layer_types,
                             sliding_window=d.arch.sliding_window, seq_lens=batch["seq_lens"], doc_ids=batch["doc_ids"])
        ctx_pos = torch.arange(S, device="cuda").expand(B, S) - doc_starts(batch["doc_ids"])
        h = d(F.embedding(blocks.input_ids, embed), d.project_context(batch["features"].to(torch.bfloat16)),
              blocks.positions, ctx_pos, attend)
        (h.float() * probe).sum().backward()
        out[kind] = (h.detach().float(), {n: p.grad.detach().float().clone() for n, p in d.named_parameters()})
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-12))  # noqa: E731
    assert rel(out["flex"][0], out["sdpa"][0]) < 2e-2
    for n, gr in out["sdpa"][1].items():
        assert rel(out["flex"][1][n], gr) < 5e-2, n
