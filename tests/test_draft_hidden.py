"""Issue 29 item 5: one drafting sequence, pipeline/drafter.py `draft_hidden` (embed -> attention -> layers -> norm),
run by training (step_loss), the offline eval (draft_blocks), speculation (DFlashDraftFn) and the export's modeling
file. Each test holds it bit for bit equal to the sequence its caller wrote before (kept once below as
`_old_sequence`, with each caller's own embedding and casts); the last one checks that no other place builds
a drafter's attention itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import load_config
from pipeline.drafter import draft_blocks, draft_hidden
from pipeline.masks import build_blocks, doc_starts, make_attend
from pipeline.train_step import drafter_loss, step_loss

from helpers_drafters import tiny_drafter

ROOT = Path(__file__).resolve().parent.parent
H, BS, V = 16, 4, 40
LAYERS = [1, 3, 5]

pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)


def _old_sequence(forward, block_embeds, ctx, q_pos, ctx_pos, anchors, block_size, arch, kind="sdpa",
                  seq_lens=None, doc_ids=None):
    """The drafting sequence as step_loss, draft_blocks, DFlashDraftFn and modeling_dflash each wrote it before
    draft_hidden (the embedding and casts are each caller's, in the tests below)."""
    attend = make_attend(kind, anchors=anchors, block_size=block_size, ctx_len=ctx.shape[1],
                         layer_types=arch.layer_types, sliding_window=arch.sliding_window, seq_lens=seq_lens,
                         is_causal=arch.is_causal, doc_ids=doc_ids)
    return forward(block_embeds, ctx, q_pos, ctx_pos, attend)


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(0, target_layer_ids=LAYERS, sliding_window=6, block_size=BS, mask_token_id=3).eval()


@pytest.fixture(scope="module")
def head():
    g = torch.Generator().manual_seed(1)
    return torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)  # embed, lm_head


def _batch(packed: bool):
    g = torch.Generator().manual_seed(2)
    B, S = 2, 20
    tokens = torch.randint(4, V, (B, S), generator=g)
    loss_mask = torch.ones(B, S, dtype=torch.bool)
    loss_mask[:, :3] = False
    loss_mask[1, 15:] = False  # row 1 is 15 tokens long
    anchors = torch.tensor([[3, 8, 13], [4, 9, -1]])  # padded with -1
    seq_lens = torch.tensor([20, 15])
    feats = torch.randn(B, S, len(LAYERS) * H, generator=g)
    doc_ids = torch.tensor([[0] * 10 + [1] * 10, [0] * 15 + [-1] * 5]) if packed else None
    return tokens, loss_mask, anchors, seq_lens, feats, doc_ids


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_training_sequence_equals_the_old_step_loss(drafter, head, packed):
    embed, lm_head = head
    tokens, loss_mask, anchors, seq_lens, feats, doc_ids = _batch(packed)
    B, S = tokens.shape
    cfg = load_config(None, ["drafter.mask_token_id=3"])
    blocks = build_blocks(tokens, loss_mask, anchors, BS, 3, cfg.train.gamma, doc_ids)
    ctx = drafter.project_context(feats)
    ctx_pos = torch.arange(S).expand(B, S)
    if doc_ids is not None:
        ctx_pos = ctx_pos - doc_starts(doc_ids)
    with torch.no_grad():
        old = _old_sequence(drafter, F.embedding(blocks.input_ids, embed), ctx, blocks.positions, ctx_pos, anchors,
                            BS, drafter.arch, "sdpa", seq_lens, doc_ids)  # step_loss: no cast (autocast decides)
        new = draft_hidden(drafter, blocks.input_ids, ctx, blocks.positions, ctx_pos, anchors, embed=embed,
                           kind="sdpa", seq_lens=seq_lens, doc_ids=doc_ids)
        assert torch.equal(new, old)
        if not packed:  # and step_loss, end to end, runs exactly that
            loss_old, correct_old, _ = drafter_loss(drafter, old, lm_head, blocks, tokens, cfg.train)
            loss, correct, _, _ = step_loss(drafter, tokens, loss_mask, anchors, seq_lens, feats, embed, lm_head,
                                            cfg, "sdpa")
            assert torch.equal(loss, loss_old) and torch.equal(correct, correct_old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offline_sequence_equals_the_old_draft_blocks(head, dtype):
    d = tiny_drafter(0, dtype, target_layer_ids=LAYERS, sliding_window=6, block_size=BS, mask_token_id=3).eval()
    embed, lm_head = head
    g = torch.Generator().manual_seed(3)
    S = 14
    feats = torch.randn(S, len(LAYERS) * H, generator=g)
    anchor_pos, anchor_ids = torch.tensor([2, 7, 9, 14]), torch.randint(4, V, (4,), generator=g)
    with torch.no_grad():  # draft_blocks' old body
        A = anchor_pos.numel()
        anchors = anchor_pos.view(1, -1)
        ids = torch.full((A, BS), 3, dtype=torch.long)
        ids[:, 0] = anchor_ids
        q_pos = (anchors.view(A, 1) + torch.arange(BS)).view(1, A * BS)
        ctx = d.project_context(feats.to(dtype).reshape(1, S, -1))
        h = _old_sequence(d, F.embedding(ids.view(1, A * BS), embed).to(dtype), ctx, q_pos,
                          torch.arange(S).view(1, S), anchors, BS, d.arch).view(A, BS, -1)[:, 1:]
        want = (h.to(lm_head.dtype) @ lm_head.t()).float()
    draft, logits = draft_blocks(d, feats, anchor_pos, anchor_ids, embed, lm_head, return_logits=True)
    assert torch.equal(logits, want) and torch.equal(draft, want.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculation_sequence_equals_the_old_draft_fn(head, dtype):
    from stages.speculate import dflash_draft_fn

    d = tiny_drafter(0, dtype, target_layer_ids=LAYERS, sliding_window=6, block_size=BS, mask_token_id=3).eval()
    embed, lm_head = head
    fn = dflash_draft_fn(d, embed, lm_head)
    g = torch.Generator().manual_seed(4)
    context = torch.randn(16, len(LAYERS) * H, generator=g)
    for pos, last in ((5, 9), (7, 11), (12, 20)):  # the projected context grows step by step
        got = fn(context[:pos], pos, last)
        with torch.no_grad():  # DFlashDraftFn's old body on the context it projected
            ids = torch.full((1, BS), 3, dtype=torch.long)
            ids[0, 0] = last
            h = _old_sequence(d, F.embedding(ids, embed).to(dtype), fn.ctx, pos + torch.arange(BS).view(1, BS),
                              torch.arange(pos).view(1, pos), torch.tensor([[pos]]), BS, d.arch)[0, 1:]
            want = h.to(lm_head.dtype) @ lm_head.t()
        assert torch.equal(fn.logits, want) and got == want.argmax(-1).tolist()


def test_export_sequence_equals_the_old_modeling_file(drafter, head, tmp_path):
    from transformers import AutoModel

    from pipeline.export import export_drafter

    out = export_drafter(drafter, drafter.arch, tmp_path / "x", vocab_size=V, num_target_layers=8, dtype="float32")
    hf = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    embed, _ = head
    g = torch.Generator().manual_seed(5)
    S = 11
    ctx = hf.project_context(torch.randn(1, S, len(LAYERS) * H, generator=g))
    block = torch.tensor([[7, 3, 3, 3]])
    q_pos, ctx_pos = torch.arange(S, S + BS)[None], torch.arange(S)[None]
    with torch.no_grad():
        noise = F.embedding(block, embed).to(hf.fc.weight.dtype)
        # modeling_dflash's old draft_hidden: one block after all of ctx, ctx cast to the block's dtype
        want = _old_sequence(hf.drafter_forward, noise, ctx.to(noise.dtype), q_pos, ctx_pos,
                             torch.full((1, 1), S), BS, hf.arch)
        assert torch.equal(hf.draft_hidden(noise, ctx, q_pos, ctx_pos), want)  # forward()'s call
        assert torch.equal(draft_hidden(hf, block, ctx, q_pos, ctx_pos, embed=embed, dtype=hf.fc.weight.dtype,
                                        forward=hf.drafter_forward), want)  # spec_generate's call
        feats = torch.randn(1, S, len(LAYERS) * H, generator=g)
        assert torch.equal(hf(noise_embedding=noise, target_hidden=feats, position_ids=torch.arange(S + BS)[None]),
                           _old_sequence(hf.drafter_forward, noise, hf.project_context(feats), q_pos, ctx_pos,
                                         torch.full((1, 1), S), BS, hf.arch))




def test_only_draft_hidden_builds_a_drafters_attention():
    """embed -> attention -> layers -> norm is written once: no other function of the project (the benches aside,
    which time mask building and attention alone) calls make_attend."""
    found = []
    for pkg in ("pipeline", "data", "stages", "scripts"):
        for f in sorted((ROOT / pkg).glob("*.py")):
            path = f.relative_to(ROOT).as_posix()
            for fn in ast.walk(ast.parse(f.read_text())):
                if isinstance(fn, ast.FunctionDef) and path != "pipeline/masks.py" and any(
                        isinstance(c, ast.Call) and getattr(c.func, "id", getattr(c.func, "attr", None)) == "make_attend"
                        for c in ast.walk(fn)):
                    found.append(f"{path}:{fn.name}")
    assert found == ["pipeline/drafter.py:draft_hidden"]
