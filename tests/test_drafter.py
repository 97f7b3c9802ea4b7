"""The drafter: contract names, no leakage across the mask, RoPE at true positions, training == inference geometry."""

import pytest
import torch

from pipeline.config import DrafterConfig
from pipeline.drafter import DFlashDrafter, DrafterArch, draft_blocks
from pipeline.export import contract_keys
from pipeline.masks import build_blocks, make_attend

import helpers_drafters  # noqa: E402

H, L, V, BS, W = 16, 2, 40, 4, 4


def _shape(layer_types) -> dict:
    return dict(layer_types=layer_types, target_layer_ids=[1, 3], block_size=BS, mask_token_id=1,
                sliding_window=W if "sliding_attention" in layer_types else None)


def tiny_arch(layer_types):
    return helpers_drafters.tiny_arch(**_shape(layer_types))


def tiny_drafter(layer_types, seed=0):  # float64, non-trivial norm weights so that every parameter matters
    return helpers_drafters.tiny_drafter(seed, torch.float64, **_shape(layer_types))


def run(d, feats, embeds, anchors, q_pos=None, ctx_pos=None):
    S = feats.shape[1]
    Q = embeds.shape[1]
    if q_pos is None:
        q_pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(BS)).view(1, Q)
    if ctx_pos is None:
        ctx_pos = torch.arange(S).view(1, S)
    attend = make_attend("sdpa", anchors=anchors, block_size=BS, ctx_len=S, layer_types=d.arch.layer_types,
                         sliding_window=d.arch.sliding_window)
    return d(embeds, d.project_context(feats), q_pos, ctx_pos, attend)


def geometry_case(kind, seed, S, anchors):
    """(drafter, tokens, feats, embed, head, blocks, block embeddings): a seeded [kind, full] drafter; from a
    generator of the same seed S random tokens, fp64 features [S, 2H], embedding and head; the training blocks of
    `anchors` [1, A] (every position labelled) and their embeddings [1, A*BS, H]."""
    d = tiny_drafter([kind, "full_attention"], seed=seed)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, V, (1, S), generator=g)
    feats = torch.randn(S, 2 * H, generator=g, dtype=torch.float64)
    embed = torch.randn(V, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    blk = build_blocks(tokens, torch.ones_like(tokens), anchors, BS, d.arch.mask_token_id, 4.0)
    return d, tokens, feats, embed, head, blk, torch.nn.functional.embedding(blk.input_ids, embed)


def assert_each_anchor_alone_equals(train_logits, d, feats, anchors, tokens, embed, head):
    """Drafting after each anchor ALONE, from only the features strictly before it, gives its row of the batched
    training forward's logits [A, BS-1, V]."""
    for j, p in enumerate(anchors[0].tolist()):
        alone = draft_blocks(d, feats[:p], torch.tensor([p]), tokens[0, p : p + 1], embed, head, return_logits=True)[1]
        assert torch.allclose(alone[0].double(), train_logits[j], atol=1e-9), j


def test_parameter_names_are_the_export_contract():
    d = DFlashDrafter(tiny_arch(["sliding_attention", "full_attention"]))
    assert sorted(d.state_dict()) == contract_keys(2)
    assert not any("embed" in k or "lm_head" in k for k in d.state_dict())
    assert d.fc.weight.shape == (H, 2 * H)


def test_arch_from_config():
    cfg = DrafterConfig(num_hidden_layers=2, hidden_size=H, intermediate_size=32, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=64, block_size=8, mask_token_id=3)
    arch = DrafterArch.from_config(cfg, [1, 3, 5])
    assert arch.num_features == 3 and arch.sliding_window == 64 and arch.block_size == 8
    assert DrafterArch.from_config(DrafterConfig(num_hidden_layers=1), [4]).layer_types == ["full_attention"]


@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
def test_no_leakage(kind):
    d = tiny_drafter([kind, kind])
    S = 14
    anchors = torch.tensor([[3, 7, 11]])
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, S, 2 * H, generator=g, dtype=torch.float64)
    embeds = torch.randn(1, 3 * BS, H, generator=g, dtype=torch.float64)
    base = run(d, feats, embeds, anchors)
    blk1 = slice(BS, 2 * BS)  # block of anchor 7

    def changed(f=feats, e=embeds):
        return (run(d, f, e, anchors) - base).abs().amax(-1)[0]  # [Q] per-query change

    f = feats.clone()
    f[:, 7:] += torch.randn_like(f[:, 7:])  # context at or after the anchor (7 itself: strict <)
    assert changed(f=f)[blk1].max() == 0
    assert changed(f=f)[:BS].max() == 0  # nor anything of the earlier block
    e = embeds.clone()
    e[:, :BS] += 1.0
    e[:, 2 * BS:] += 1.0  # the other two blocks' tokens
    assert changed(e=e)[blk1].max() == 0
    f = feats.clone()
    f[:, 6] += 1.0  # the position right before the anchor is visible
    assert changed(f=f)[blk1].min() > 0
    f = feats.clone()
    f[:, 3] += 1.0  # query positions 7..10 minus 3 >= W = 4: outside every sliding window of block 1
    assert (changed(f=f)[blk1].min() > 0) == (kind == "full_attention")
    assert (changed(f=f)[blk1].max() == 0) == (kind == "sliding_attention")
    e = embeds.clone()
    e[:, BS + 2] += 1.0  # slot 2 of block 1
    c = changed(e=e)[blk1]
    if kind == "full_attention":  # bidirectional inside the block
        assert c.min() > 0
    else:  # causal inside the block
        assert c[:2].max() == 0 and c[2:].min() > 0


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
def test_dense_anchors_no_cross_block_leak(kind, attention):
    """Anchors closer than a block apart (every position: each block's positions overlap the next bs-1 blocks')
    leak nothing between blocks (SpecForge #470: a leak made the training loss better than serving). The batched
    training forward must equal drafting each anchor ALONE from the features strictly before it, which sees no
    other block by construction; and perturbing every other block's tokens changes nothing in a block."""
    import warnings

    S = 11
    anchors = torch.arange(S)[None]  # [1, 11]: one anchor at every position, blocks overlap by bs-1 positions
    A = anchors.shape[1]
    d, tokens, feats, embed, head, blk, embeds = geometry_case(kind, 5, S, anchors)
    attend = make_attend(attention, anchors=anchors, block_size=BS, ctx_len=S, layer_types=d.arch.layer_types,
                         sliding_window=d.arch.sliding_window, compile=False)
    ctx = d.project_context(feats[None])
    with warnings.catch_warnings(), torch.no_grad():  # flex has no backward on CPU
        warnings.simplefilter("ignore")  # eager flex_attention on CPU warns that it is not compiled
        train_h = d(embeds, ctx, blk.positions, torch.arange(S)[None], attend)  # [1, A*BS, H]
        e = embeds.clone().view(A, BS, H)
        for j in range(A):  # perturb every block but j: block j must not move
            pert = e + 1.0
            pert[j] = e[j]
            moved = d(pert.view(1, A * BS, H), ctx, blk.positions, torch.arange(S)[None], attend)
            assert torch.equal(moved.view(A, BS, H)[j], train_h.view(A, BS, H)[j]), (j, "sees another block")
    assert_each_anchor_alone_equals(train_h.view(A, BS, H)[:, 1:] @ head.t(), d, feats, anchors, tokens, embed, head)


@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
def test_rope_at_true_positions(kind):
    d = tiny_drafter([kind, "full_attention"])
    S = 10
    anchors = torch.tensor([[4, 8]])
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(1, S, 2 * H, generator=g, dtype=torch.float64)
    embeds = torch.randn(1, 2 * BS, H, generator=g, dtype=torch.float64)
    q_pos = (anchors[:, :, None] + torch.arange(BS)).view(1, -1)
    ctx_pos = torch.arange(S).view(1, S)
    base = run(d, feats, embeds, anchors, q_pos, ctx_pos)
    shifted = run(d, feats, embeds, anchors, q_pos + 37, ctx_pos + 37)  # same relative positions
    assert torch.allclose(base, shifted, atol=1e-9)
    assert not torch.allclose(base, run(d, feats, embeds, anchors, q_pos + 1, ctx_pos), atol=1e-6)
    assert not torch.allclose(base, run(d, feats, embeds, anchors, q_pos, ctx_pos - 1), atol=1e-6)


@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
def test_training_geometry_equals_inference(kind):
    """A batched training forward (build_blocks + mask) gives, for each anchor, what drafting after that anchor
    with only the features before it gives: the geometry that serving uses."""
    S = 13
    anchors = torch.tensor([[0, 5, 9, 12]])
    d, tokens, feats, embed, head, blk, embeds = geometry_case(kind, 3, S, anchors)
    attend = make_attend("sdpa", anchors=anchors, block_size=BS, ctx_len=S, layer_types=d.arch.layer_types,
                         sliding_window=d.arch.sliding_window)
    train_h = d(embeds, d.project_context(feats[None]), blk.positions, torch.arange(S)[None], attend)
    train_logits = (train_h.view(4, BS, H)[:, 1:] @ head.t())
    draft, logits = draft_blocks(d, feats, anchors[0], tokens[0, anchors[0]], embed, head, return_logits=True)
    assert torch.allclose(logits.double(), train_logits, atol=1e-9)
    assert torch.equal(draft, logits.argmax(-1))
    assert_each_anchor_alone_equals(train_logits, d, feats, anchors, tokens, embed, head)


def test_gradient_checkpointing_same_result():
    d = tiny_drafter(["sliding_attention", "full_attention"])
    S = 9
    anchors = torch.tensor([[2, 6]])
    feats = torch.randn(1, S, 2 * H, dtype=torch.float64)
    embeds = torch.randn(1, 2 * BS, H, dtype=torch.float64)
    probe = torch.randn(1, 2 * BS, H, dtype=torch.float64)  # not out^2: the final norm makes that constant
    out = run(d, feats, embeds, anchors)
    (out * probe).sum().backward()
    grads = [p.grad.clone() for p in d.parameters()]
    d.zero_grad()
    d.gradient_checkpointing = True
    out2 = run(d, feats, embeds, anchors)
    (out2 * probe).sum().backward()
    assert torch.allclose(out, out2)
    assert all(torch.allclose(a, p.grad) for a, p in zip(grads, d.parameters()))
    assert all(a.abs().max() > 1e-6 for a in grads)
