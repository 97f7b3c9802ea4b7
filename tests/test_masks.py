"""Training geometry: anchors, labels, loss weights and the attention mask against brute-force references."""

import math
import warnings

import pytest
import torch

from pipeline.config import gamma_for_block
from pipeline.masks import (
    IGNORE_INDEX,
    build_blocks,
    dense_mask,
    flex_block_mask,
    make_attend,
    sample_anchors,
    stack_anchors,
)


def brute_force_mask(anchors, block_size, ctx_len, seq_lens, window, causal=None):
    """Plain loops over (b, q, kv), written from the brief's words, independent of the predicate code: a query of
    block j, slot k (position anchor_j + k) sees context kv < anchor_j and kv < seq_len (with a window: only the
    last `window` positions before its own position); block tokens of its own block only, and there only slots
    <= k when causal inside the block (causal None: exactly when windowed, the rule without is_causal)."""
    causal = window is not None if causal is None else causal
    B, A = anchors.shape
    Q = A * block_size
    out = torch.zeros(B, 1, Q, ctx_len + Q, dtype=torch.bool)
    for b in range(B):
        for q in range(Q):
            j, k = divmod(q, block_size)
            anchor = int(anchors[b, j])
            for kv in range(ctx_len + Q):
                if kv < ctx_len:  # context token kv
                    ok = anchor >= 0 and kv < anchor and kv < int(seq_lens[b])
                    if window is not None:
                        ok = ok and (anchor + k) - kv < window  # query position minus key position
                else:  # block token
                    jj, kk = divmod(kv - ctx_len, block_size)
                    ok = jj == j and (not causal or kk <= k)
                out[b, 0, q, kv] = ok
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_dense_mask_matches_brute_force(window):
    anchors = torch.tensor([[0, 3, 9, -1], [2, 6, 11, 15]])  # row 0: one padded anchor; anchor 0: no context
    seq_lens = torch.tensor([12, 17])
    got = dense_mask(anchors, 4, 17, seq_lens, window)
    want = brute_force_mask(anchors, 4, 17, seq_lens, window)
    assert got.shape == (2, 1, 16, 33)
    assert torch.equal(got, want)


@pytest.mark.parametrize("window", [None, 3])
def test_dense_anchors_mask_matches_brute_force(window):
    """Anchors one position apart (closer than a block): every block's positions overlap its neighbours', yet
    a query sees only its own block's tokens and context strictly before its own anchor (SpecForge #470)."""
    S, bs = 9, 4
    anchors = torch.arange(S - 1)[None]  # [1, 8]
    got = dense_mask(anchors, bs, S, torch.tensor([S]), window)
    assert torch.equal(got, brute_force_mask(anchors, bs, S, torch.tensor([S]), window))
    m = got[0, 0]
    for q in range(m.shape[0]):
        j = q // bs
        seen_blocks = {kv // bs for kv in m[q, S:].nonzero().flatten().tolist()}  # block of each seen token
        assert seen_blocks <= {j}, (q, seen_blocks)
        assert all(kv < int(anchors[0, j]) for kv in m[q, :S].nonzero().flatten().tolist())


def test_mask_pins():
    S, bs = 12, 4
    anchors = torch.tensor([[5, 8, -1]])
    full = dense_mask(anchors, bs, S)[0, 0]
    sl = dense_mask(anchors, bs, S, window=3)[0, 0]
    # strict <: block 0 (anchor 5) sees context 0..4, NOT 5 (the anchor's own features do not exist yet)
    assert full[0, :5].all() and not full[0, 5:S].any()
    assert full[3, :5].all() and not full[3, 5]
    # own block only, bidirectional on full layers
    assert full[0, S : S + bs].all() and not full[0, S + bs :].any()
    assert full[4, S + bs : S + 2 * bs].all() and not full[4, S : S + bs].any()
    # sliding: context window over the query position (anchor + k): slot 0 of anchor 5 sees 3,4; slot 2 sees none
    assert sl[0, :S].nonzero().flatten().tolist() == [3, 4]
    assert sl[1, :S].nonzero().flatten().tolist() == [4]
    assert not sl[2, :S].any()
    # sliding: causal inside the block
    assert sl[1, S : S + bs].tolist() == [True, True, False, False]
    # padding anchor: only its own block, never context, never other blocks
    pad_rows = full[2 * bs :]
    assert not pad_rows[:, :S].any()
    assert pad_rows[:, S + 2 * bs :].all() and not pad_rows[:, S : S + 2 * bs].any()


def test_sample_anchors():
    m = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)  # candidates: 1, 2, 5, 8 (9 is last)
    all_a = sample_anchors(m, 100)
    assert all_a.tolist() == [1, 2, 5, 8]
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(30):
        a = sample_anchors(m, 2, g)
        assert a.numel() == 2 and a.tolist() == sorted(set(a.tolist()))
        assert set(a.tolist()) <= {1, 2, 5, 8}
        seen.add(tuple(a.tolist()))
    assert len(seen) > 1  # fresh draws
    assert sample_anchors(torch.zeros(5, dtype=torch.bool), 4).numel() == 0
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(sample_anchors(m, 3, g1), sample_anchors(m, 3, g2))


def test_stack_anchors_pads_with_minus_one():
    out = stack_anchors([torch.tensor([1, 4]), torch.tensor([2])], multiple=4)
    assert out.tolist() == [[1, 4, -1, -1], [2, -1, -1, -1]]


def test_build_blocks_labels_and_weights():
    bs, gamma, MASK = 4, 4.0, 99
    tokens = torch.arange(10, 20).view(1, 10)  # token at position p is 10 + p
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    loss_mask[0, 4] = 0  # position 4 unsupervised
    anchors = torch.tensor([[2, 8, -1]])
    blk = build_blocks(tokens, loss_mask, anchors, bs, MASK, gamma)
    ids, pos, lab, w = (t.view(3, bs) for t in blk)
    assert ids.tolist() == [[12, MASK, MASK, MASK], [18, MASK, MASK, MASK], [MASK] * 4]
    assert pos[:2].tolist() == [[2, 3, 4, 5], [8, 9, 10, 11]]
    # slot k predicts token anchor + k; slot 0 no loss; position 4 unsupervised; 10, 11 past the end
    assert lab.tolist() == [[IGNORE_INDEX, 13, IGNORE_INDEX, 15], [IGNORE_INDEX, 19, IGNORE_INDEX, IGNORE_INDEX],
                            [IGNORE_INDEX] * 4]
    decay = [math.exp(-(k - 1) / gamma) for k in range(bs)]
    assert torch.allclose(w[0], torch.tensor([0.0, decay[1], 0.0, decay[3]]))
    assert w[0, 1] == 1.0  # the first predicted slot has weight exp(0) = 1
    assert torch.allclose(w[1], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert (w[2] == 0).all()
    assert ((lab == IGNORE_INDEX) == (w == 0)).all()


def test_gamma_for_block():
    assert (gamma_for_block(16), gamma_for_block(10), gamma_for_block(8)) == (7.0, 5.0, 4.0)


@pytest.mark.parametrize("layer_types", [["full_attention"], ["sliding_attention"]])
def test_flex_attend_matches_sdpa_forward_on_cpu(layer_types):
    """Eager flex (forward only on CPU) with the padded BlockMask equals SDPA with the dense mask."""
    torch.manual_seed(0)
    anchors = torch.tensor([[0, 4, 9, -1], [3, 7, 12, 14]])
    S, bs = 16, 4
    kw = dict(anchors=anchors, block_size=bs, ctx_len=S, layer_types=layer_types, sliding_window=5)
    q = torch.randn(2, 4, 16, 8)
    k, v = torch.randn(2, 2, S + 16, 8), torch.randn(2, 2, S + 16, 8)
    ref = make_attend("sdpa", **kw)(q, k, v, layer_types[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": expected on CPU
        got = make_attend("flex", compile=False, **kw)(q, k, v, layer_types[0])
    assert torch.allclose(got, ref, atol=1e-5)
    bm = flex_block_mask(anchors, bs, S)
    assert bm.shape[-2:] == (128, 128)


def _tiles(num, idx, cols):
    """(count [B, H, R], ordered indices [B, H, R, C]) -> bool [B, H, R, cols]: the set each row lists."""
    out = torch.zeros(*num.shape, cols, dtype=torch.bool)
    for b, h, r in torch.cartesian_prod(*(torch.arange(n) for n in num.shape)).view(-1, 3).tolist():
        out[b, h, r, idx[b, h, r, : num[b, h, r]].long()] = True
    return out


def _ragged_batch(g, trial, max_len, packed=False):
    """(S, lens, anchors, doc_ids) of a random ragged batch of two rows drawn from `g`: S in [20, max_len), tile
    aligned on odd trials; row 1 of a random length; about 80% of each row labelled, anchors sampled among those
    positions; packed: each row cut into up to 6 documents (doc_ids) with anchors drawn per document, else no
    doc_ids."""
    from pipeline.masks import padded_len

    S = int(torch.randint(20, max_len, (1,), generator=g))
    S = padded_len(S) if trial % 2 else S  # block keys aligned to tiles (as training pads) or not
    lens = torch.tensor([S, int(torch.randint(3, S + 1, (1,), generator=g))])
    per_row, docs = [], torch.full((2, S), -1, dtype=torch.long)
    for r, n in enumerate(lens.tolist()):
        m = torch.zeros(S, dtype=torch.bool)
        m[:n] = torch.rand(n, generator=g) > 0.2
        if not packed:
            per_row.append(sample_anchors(m, int(torch.randint(1, 40, (1,), generator=g)), g))
            continue
        cuts = sorted(set(torch.randint(1, max(2, n), (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()) - {n})
        row = []
        for d, (s0, s1) in enumerate(zip([0, *cuts], [*cuts, n])):  # documents [s0, s1), anchors in each
            docs[r, s0:s1] = d
            row.append(s0 + sample_anchors(m[s0:s1], int(torch.randint(1, 12, (1,), generator=g)), g))
        per_row.append(torch.cat(row))
    return S, lens, stack_anchors(per_row), docs if packed else None


def _assert_tables_equal_create_block_mask(anchors, block_size, S, lens, window, causal=None, doc_ids=None, where=()):
    """flex_block_mask's tables equal create_block_mask evaluating dflash_mask_mod on every pair: partial and full
    tiles, kv and q (backward) sides. Returns flex_block_mask's BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    from pipeline.masks import _pad_anchors, dflash_mask_mod, padded_len

    got = flex_block_mask(anchors, block_size, S, lens, window, causal=causal, doc_ids=doc_ids)
    q_len, kv_len = padded_len(anchors.shape[1] * block_size), padded_len(S + anchors.shape[1] * block_size)
    mod = dflash_mask_mod(_pad_anchors(anchors, block_size, q_len), lens, S, block_size, window, causal, doc_ids=doc_ids)
    ref = create_block_mask(mod, 2, None, q_len, kv_len, device="cpu")
    for num, idx in [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")]:
        assert torch.equal(getattr(got, num), getattr(ref, num)), (*where, num)
        cols = getattr(ref, idx).shape[-1]
        assert torch.equal(_tiles(getattr(got, num), getattr(got, idx), cols),
                           _tiles(getattr(ref, num), getattr(ref, idx), cols)), (*where, idx)
    return got


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("block_size", [16, 8, 5, 12, 128])
def test_block_tables_equal_create_block_mask(block_size, packed):
    """The analytic block tables (no dense grid, nothing compiled) equal create_block_mask evaluating the
    predicate on every pair: partial and full tiles, kv and q (backward) sides, on random ragged batches with
    padded anchors, short sequences, both window kinds and lengths that are not multiples of 128; packed rows
    (several documents per row, doc_ids) with anchors drawn per document, documents shorter than a block."""
    g = torch.Generator().manual_seed(block_size)
    for trial in range(6):
        S, lens, anchors, doc_ids = _ragged_batch(g, trial, 700, packed)
        for window in (None, int(torch.randint(3, 300, (1,), generator=g))):
            got = _assert_tables_equal_create_block_mask(anchors, block_size, S, lens, window, doc_ids=doc_ids,
                                                         where=(trial, window))
            assert got.kv_num_blocks.sum() + got.full_kv_num_blocks.sum() > 0


# ----------------------------------------------------------------------------------------------------------
# is_causal (the drafter's config.json key): who is causal inside the block
# ----------------------------------------------------------------------------------------------------------


def rule_mask(anchors, block_size, ctx_len, seq_lens, layer_type, window, is_causal):
    """The rules read directly, pair by pair (brute_force_mask): only sliding layers are windowed; a layer is
    causal inside the block when is_causal is absent (None) -> sliding layers, full layers not; true / false ->
    every layer."""
    causal = (layer_type == "sliding_attention") if is_causal is None else is_causal
    win = window if layer_type == "sliding_attention" else None
    return brute_force_mask(anchors, block_size, ctx_len, seq_lens, win, causal)


@pytest.mark.parametrize("is_causal", [None, False, True])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_is_causal_mask_matches_the_rules_pair_by_pair(is_causal, layer_type):
    from pipeline.masks import block_causal

    anchors = torch.tensor([[0, 3, 9, -1], [2, 6, 11, 15]])  # a padded anchor, an anchor without context
    seq_lens, S, bs, W = torch.tensor([12, 17]), 17, 4, 5
    window = W if layer_type == "sliding_attention" else None
    got = dense_mask(anchors, bs, S, seq_lens, window, block_causal(is_causal, layer_type))
    want = rule_mask(anchors, bs, S, seq_lens, layer_type, W, is_causal)
    assert torch.equal(got, want)
    # the rule really changes with the key: the published layout (sliding, false) sees later slots of its block
    slot0 = got[1, 0, 4, S + 4 : S + 8].tolist()  # block 1, slot 0: its own block's four tokens
    causal = (layer_type == "sliding_attention") if is_causal is None else is_causal
    assert slot0 == ([True, False, False, False] if causal else [True] * 4)
    if layer_type == "sliding_attention":  # windowed on the context whatever is_causal says
        assert got[1, 0, 4 * 3 + 3, :S].nonzero().flatten().tolist() == [14]  # anchor 15, slot 3: 18 - kv < 5


@pytest.mark.parametrize("is_causal", [False, True])
def test_make_attend_honours_is_causal(is_causal):
    """make_attend's SDPA (and CPU eager flex) outputs equal attention under the rule mask, per layer type."""
    torch.manual_seed(0)
    anchors = torch.tensor([[0, 4, 9, -1], [3, 7, 12, 14]])
    S, bs, W = 16, 4, 5
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, S + 16, 8), torch.randn(2, 2, S + 16, 8)
    types = ["sliding_attention", "full_attention"]
    kw = dict(anchors=anchors, block_size=bs, ctx_len=S, layer_types=types, sliding_window=W, is_causal=is_causal)
    sdpa = make_attend("sdpa", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": expected on CPU
        flex = make_attend("flex", compile=False, **kw)
        for t in types:
            mask = rule_mask(anchors, bs, S, torch.tensor([S, S]), t, W, is_causal)
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            assert torch.allclose(sdpa(q, k, v, t), ref, atol=1e-6), t
            assert torch.allclose(flex(q, k, v, t), ref, atol=1e-5), t
    default = make_attend("sdpa", **{**kw, "is_causal": None})
    changed = "sliding_attention" if is_causal is False else "full_attention"
    assert not torch.allclose(default(q, k, v, changed), sdpa(q, k, v, changed))  # the key changes that layer type


@pytest.mark.parametrize("block_size", [8, 5])
def test_block_tables_equal_create_block_mask_for_is_causal(block_size):
    """block_tables with causal given explicitly (is_causal false: sliding layers bidirectional in the block;
    true: full layers causal) equal create_block_mask evaluating the same predicate on every pair."""
    g = torch.Generator().manual_seed(100 + block_size)
    for trial in range(4):
        S, lens, anchors, _ = _ragged_batch(g, trial, 500)
        for window, causal in ((int(torch.randint(3, 300, (1,), generator=g)), False), (None, True)):
            _assert_tables_equal_create_block_mask(anchors, block_size, S, lens, window, causal, where=(trial, window))


def test_the_compiled_table_builder_sees_one_spelling_of_each_rule(monkeypatch):
    """flex_block_mask resolves `causal` before the compiled builder: None (causal exactly when windowed) and the
    bool it means reach it as the same argument, so a direct call and make_attend's call share one compiled graph
    (on the H200 the two spellings compiled the tables twice per window kind: 6 graphs where 4 are expected)."""
    import pipeline.masks as m

    seen = []

    def builder(*args):
        seen.append(args[5])
        return m._all_tables(*args)

    monkeypatch.setitem(m._COMPILED, "tables", builder)
    anchors, lens = torch.tensor([[3, 40, 90]]), torch.tensor([120])
    for window, meant in ((None, False), (24, True)):
        seen.clear()
        a = m.flex_block_mask(anchors, 8, 128, lens, window, compile=True)
        b = m.flex_block_mask(anchors, 8, 128, lens, window, compile=True, causal=meant)
        assert seen == [meant, meant] and all(type(x) is bool for x in seen)
        assert torch.equal(a.to_dense(), b.to_dense())
