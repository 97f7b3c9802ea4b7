"""DFlash 2 (pipeline/drafter2.py, the loss additions, pipeline/train_step.py): the convolution and the selector
against the formulas written out element by element, the identity start, the chunked objective against an
unchunked autograd reference, the config keys and the warm start."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import ConfigError, load_config
from pipeline.drafter import DFlashDrafter, DrafterArch, draft_blocks
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter, grouped_dynamic_conv, transform_unary
from pipeline.loss import IGNORE_INDEX, chunked_weighted_ce, chunked_weighted_ce_topk, selector_ce
from pipeline.masks import build_blocks, make_attend

from helpers_drafters import TINY_ARCH  # noqa: E402

H, V, BS, K = 16, 40, 4, 5
BASE = dict(TINY_ARCH, target_layer_ids=[1, 3], sliding_window=4, block_size=BS, mask_token_id=1)
EXTRA = dict(vocab_size=V, conv_kernel_size=2, conv_group_size=4, selector_rank=6, selector_top_k=K)


def drafters(seed=0, **extra):
    torch.manual_seed(seed)
    d1 = DFlashDrafter(DrafterArch(**BASE))
    torch.manual_seed(seed)
    d2 = DFlash2Drafter(DFlash2Arch(**BASE, **{**EXTRA, **extra}))
    return d1, d2


def randomise(d2, scale=0.3, seed=1):
    """Non-trivial DFlash 2 modules (trained values are never identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in d2.named_parameters():
            if "_conv." in n or "candidate_selector" in n:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return d2


@pytest.mark.parametrize("taps", [1, 2, 3])
def test_convolution_is_the_formula_and_stays_in_its_block(taps):
    g = torch.Generator().manual_seed(0)
    B, A, gs = 2, 3, 4
    x = torch.randn(B, A * BS, H, generator=g, dtype=torch.float64)
    delta = torch.randn(B, A * BS, taps, H // gs, generator=g, dtype=torch.float64)
    base = torch.randn(taps, H, generator=g, dtype=torch.float64)
    out = grouped_dynamic_conv(x, delta, base, BS, gs)
    ref = torch.zeros_like(x)
    for b in range(B):
        for i in range(A * BS):
            for t in range(taps):
                if i % BS - t < 0:  # row i - t lies in the previous block: zero
                    continue
                for c in range(H):
                    ref[b, i, c] += (base[t, c] + delta[b, i, t, c // gs]) * x[b, i - t, c]
    torch.testing.assert_close(out, ref)


def test_one_projection_gives_both_sides_and_identity_init():
    _, d2 = drafters()
    conv = d2.layers[0].attention_conv
    x = torch.randn(2, 2 * BS, H)
    y, delta = conv.prepare(x)
    torch.testing.assert_close(y, x)  # identity at initialisation
    torch.testing.assert_close(conv.finish(x, delta), x)
    randomise(d2)
    y, delta = conv.prepare(x)
    proj = (x @ conv.kernel_projection.weight.t()).view(2, 2 * BS, 2, 2, H // 4)  # (side, tap, group)
    torch.testing.assert_close(delta, proj[:, :, 1])
    torch.testing.assert_close(y, grouped_dynamic_conv(x, proj[:, :, 0], conv.base_kernel[0], BS, 4))
    z = torch.randn_like(x)
    torch.testing.assert_close(conv.finish(z, delta), grouped_dynamic_conv(z, proj[:, :, 1], conv.base_kernel[1], BS, 4))


def test_starts_as_its_dflash_backbone():
    """Same seed: the same backbone weights, the same hidden states; with the selector at zero the same drafts."""
    d1, d2 = drafters()
    s1, s2 = d1.state_dict(), d2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    g = torch.Generator().manual_seed(2)
    feats, emb, head = torch.randn(20, 2 * H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    anchors, ids = torch.tensor([0, 3, 9, 20]), torch.randint(0, V, (4,), generator=g)
    a, la = draft_blocks(d1, feats, anchors, ids, emb, head, return_logits=True)
    with torch.no_grad():
        for p in d2.candidate_selector.parameters():
            p.zero_()
    b, lb = draft_blocks(d2, feats, anchors, ids, emb, head, return_logits=True)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    assert torch.equal(a, b)


def test_selector_score_and_walk_are_the_formula():
    _, d2 = drafters()
    randomise(d2, scale=1.0)
    sel = d2.candidate_selector
    g = torch.Generator().manual_seed(3)
    N, P = 3, BS - 1
    hidden = torch.randn(N, P, H, generator=g)
    logits = torch.randn(N, P, V, generator=g) * 3
    anchor = torch.randint(0, V, (N,), generator=g)
    A, B, Pw = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    path = d2.select(hidden, logits, anchor)
    for n in range(N):  # walked by hand: all K candidates of each slot, edge from the previous pick
        prev = int(anchor[n])
        for k in range(P):
            cand = logits[n, k].topk(K).indices.tolist()
            with torch.no_grad():
                scores = [float(logits[n, k, c] + ((A[prev] * (Pw @ hidden[n, k])) * B[c]).sum()) for c in cand]
            prev = cand[max(range(K), key=lambda j: (scores[j], -j))]
            assert int(path[n, k]) == prev
    # the selector can overrule the unary argmax (else it would be pointless)
    assert (path != logits.argmax(-1)).any()


def test_unary_transform_and_its_use():
    z = torch.tensor([-100.0, 0.0, 3.0, 100.0])
    torch.testing.assert_close(transform_unary(z, 0.2, 2.0), torch.tanh(z * 0.2 / 2.0) * 2.0)
    torch.testing.assert_close(transform_unary(z, 1.0, None), z)


def _rows(seed=4, N=29, top_hits=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = IGNORE_INDEX
    weights = torch.rand(N, generator=g, dtype=torch.float64) * (labels != IGNORE_INDEX)
    preds = torch.randint(0, V, (N,), generator=g)
    return hidden, W, labels, weights, preds


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_topk_ce_equals_reference(softcap):
    hidden, W, labels, weights, _ = _rows()
    h1 = hidden.clone().requires_grad_(True)
    loss, correct, cand = chunked_weighted_ce_topk(h1, W, labels, weights, K, chunk_rows=4, softcap=softcap)
    loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    logits = h2 @ W.t()
    capped = torch.tanh(logits / softcap) * softcap if softcap else logits
    ref = (F.cross_entropy(capped, labels, ignore_index=IGNORE_INDEX, reduction="none") * weights).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h1.grad, h2.grad)
    live = labels != IGNORE_INDEX
    assert torch.equal(cand[live], logits.detach().topk(K).indices[live]) and (cand[~live] == 0).all()
    if softcap is None:
        assert torch.equal(loss.detach(), chunked_weighted_ce(hidden, W, labels, weights, 4)[0])


def test_selector_ce_equals_reference_with_gold_insertion():
    _, d2 = drafters(selector_top_k=K)
    sel = randomise(d2.double(), scale=0.5).candidate_selector
    hidden, W, labels, weights, preds = _rows()
    cand = (hidden @ W.t()).topk(K).indices
    labels[1] = int(cand[1, 2])  # covered, not first
    labels[2] = int((hidden[2] @ W.t()).argmin())  # certainly missing: gold replaces the last candidate
    weights[1], weights[2] = 0.7, 0.9
    h1 = hidden.clone().requires_grad_(True)
    total, correct, covered = selector_ce(sel, h1, W, cand, labels, weights, preds, multiplier=0.5, softcap=3.0,
                                          chunk_rows=3)
    total.backward()
    grads = {n: p.grad.clone() for n, p in sel.named_parameters()}
    sel.zero_grad()
    h2 = hidden.clone().requires_grad_(True)
    ref, ref_ok, ref_cov = 0.0, [], []
    for i in range(len(labels)):  # row by row, the published objective written out
        if labels[i] == IGNORE_INDEX or weights[i] == 0:
            ref_ok.append(False), ref_cov.append(False)
            continue
        c = cand[i].clone()
        hit = bool((c == labels[i]).any())
        if not hit:
            c[-1] = labels[i]
        unary = torch.tanh(0.5 * (h2[i] @ W[c].t()) / 3.0) * 3.0
        scores = unary + ((sel.predecessor_codebook[preds[i]] * sel.hidden_projection(h2[i])) * sel.successor_codebook[c]).sum(-1)
        gold = int((c == labels[i]).nonzero()[0])
        ref = ref + weights[i] * F.cross_entropy(scores[None], torch.tensor([gold]))
        ref_ok.append(hit and int(scores.argmax()) == gold), ref_cov.append(hit)
    ref.backward()
    torch.testing.assert_close(total, ref)
    torch.testing.assert_close(h1.grad, h2.grad)
    for n, p in sel.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
        assert grads[n].abs().max() > 0, n
    assert correct.tolist() == ref_ok and covered.tolist() == ref_cov
    assert covered[1] and not covered[2] and not correct[2]


def test_training_loss_equals_full_logits_reference():
    """The whole DFlash 2 objective of a training batch (pipeline.train_step.drafter_loss) against full logits
    and autograd: base CE over transformed logits + alpha * selector CE, gradients into every parameter."""
    from types import SimpleNamespace

    from pipeline.loss import predecessor_ids
    from pipeline.train_step import drafter_loss

    _, d2 = drafters(output_multiplier=0.8, final_logit_softcapping=4.0)
    d2 = randomise(d2.double(), scale=0.2)
    g = torch.Generator().manual_seed(5)
    S = 16
    tokens = torch.randint(2, V, (1, S), generator=g)
    mask = torch.ones(1, S, dtype=torch.bool)
    mask[0, :3] = False
    anchors = torch.tensor([[3, 6, 10, 13]])
    feats = torch.randn(1, S, 2 * H, generator=g, dtype=torch.float64)
    emb, head = torch.randn(V, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    blk = build_blocks(tokens, mask, anchors, BS, 1, 4.0)
    attend = make_attend("sdpa", anchors=anchors, block_size=BS, ctx_len=S, layer_types=d2.arch.layer_types,
                         sliding_window=d2.arch.sliding_window)

    def hidden():
        return d2(F.embedding(blk.input_ids, emb), d2.project_context(feats), blk.positions, torch.arange(S)[None], attend)

    cfg = SimpleNamespace(loss_chunk_rows=3, selector_loss_alpha=0.6)
    loss, correct, extra = drafter_loss(d2, hidden(), head, blk, tokens, cfg)
    loss.backward()
    got = {n: p.grad.clone() for n, p in d2.named_parameters()}
    d2.zero_grad()
    h = hidden().reshape(-1, H)
    lab, w = blk.labels.reshape(-1), blk.weights.reshape(-1)
    full = transform_unary(h @ head.t(), 0.8, 4.0)
    base = (F.cross_entropy(full, lab, ignore_index=IGNORE_INDEX, reduction="none") * w).sum()
    cand = full.detach().topk(K).indices
    sel, _, _ = selector_ce(d2.candidate_selector, h, head, cand, lab, w, predecessor_ids(tokens, blk.positions),
                            multiplier=0.8, softcap=4.0)
    (base + 0.6 * sel).backward()
    torch.testing.assert_close(loss, base + 0.6 * sel)
    for n, p in d2.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)
        assert got[n].abs().max() > 0, n  # every parameter learns, the identity convolutions included
    # predecessors are the true previous tokens: slot 1's is the anchor token
    pred = predecessor_ids(tokens, blk.positions).view(4, BS)
    assert pred[:, 1].tolist() == tokens[0, anchors[0]].tolist() and pred[:, 2].tolist() == tokens[0, anchors[0] + 1].tolist()
    assert 0 <= float(extra["topk_coverage"]) <= 1 and float(extra["selector_loss"]) > 0


def test_config_keys():
    cfg = load_config(None, ["drafter.arch=dflash2"])
    assert (cfg.drafter.dflash2.conv_kernel_size, cfg.drafter.dflash2.conv_group_size, cfg.drafter.dflash2.selector_rank,
            cfg.drafter.dflash2.selector_top_k) == (2, 16, 256, 16)
    assert load_config().drafter.arch == "dflash"
    for bad, msg in [("drafter.arch=dflash3", "not one of"), ("drafter.dflash2.conv_kernel_size=9", "conv_kernel_size"),
                     ("drafter.dflash2.conv_group_size=48", "divide"), ("drafter.dflash2.selector_top_k=0", "selector_top_k"),
                     ("drafter.dflash2.final_logit_softcapping=-1", "softcapping"), ("train.selector_loss_alpha=-1", "alpha")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(None, ["drafter.arch=dflash2", bad])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["drafter.selector_topk=3"])


def test_the_flat_keys_of_before_still_load_with_one_line_and_the_section_round_trips(tmp_path, capsys):
    """`drafter.selector_rank` (flat, as configs and checkpoints wrote it before drafter.dflash2) loads into the
    section with one deprecation line; given both ways it is refused; a written config.yaml is the nested form."""
    from pipeline.config import config_from_dict, dump_config, write_config

    old = tmp_path / "old.yaml"
    old.write_text("drafter:\n  arch: dflash2\n  selector_rank: 8\n  conv_group_size: 4\n  hidden_size: 64\n"
                   "  intermediate_size: 64\n  num_attention_heads: 4\n  num_key_value_heads: 2\n  head_dim: 16\n")
    cfg = load_config(old, ["drafter.selector_top_k=5"])
    assert (cfg.drafter.dflash2.selector_rank, cfg.drafter.dflash2.conv_group_size,
            cfg.drafter.dflash2.selector_top_k) == (8, 4, 5)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "moved to drafter.dflash2" in ln]
    assert len(lines) == 1 and all(f"drafter.{k}" in lines[0] for k in ("selector_rank", "conv_group_size",
                                                                        "selector_top_k")), lines
    embedded = {"drafter": {"arch": "dflash2", "selector_top_k": 7}}  # a checkpoint of before: its embedded dict
    assert config_from_dict(embedded).drafter.dflash2.selector_top_k == 7
    with pytest.raises(ConfigError, match="both given; keep drafter.dflash2.selector_rank"):
        load_config(old, ["drafter.dflash2.selector_rank=8"])
    with pytest.raises(ConfigError, match=r"--set 'drafter.dflash2.selector_rnak=3': unknown key .*did you mean "
                                          r"'drafter.dflash2.selector_rank'"):
        load_config(None, ["drafter.dflash2.selector_rnak=3"])
    capsys.readouterr()
    assert "  dflash2:\n    conv_kernel_size: 2\n" in dump_config(cfg)
    again = load_config(write_config(cfg, tmp_path / "config.yaml"))
    assert again.drafter.dflash2 == cfg.drafter.dflash2
    assert "moved to" not in capsys.readouterr().err


def test_build_drafter_warm_start_and_alpha_zero(tmp_path):
    from pipeline.train_step import build_drafter
    from pipeline.export import export_drafter

    cfg = load_config(None, ["drafter.arch=dflash2", "drafter.dflash2.selector_rank=8"])
    torch.manual_seed(7)
    donor = DFlashDrafter(DrafterArch.from_config(cfg.drafter, [1, 3, 5]))
    export_drafter(donor, None, tmp_path / "donor", vocab_size=576, num_target_layers=8, dtype="float32")
    cfg.drafter.init_from = str(tmp_path / "donor")
    d2 = build_drafter(cfg, [1, 3, 5], 576)
    assert isinstance(d2, DFlash2Drafter) and d2.candidate_selector.successor_codebook.shape == (576, 8)
    own = d2.state_dict()
    for k, v in donor.state_dict().items():
        assert torch.equal(own[k], v), k
    assert d2.candidate_selector.hidden_projection.weight.abs().max() > 0  # the selector stays random
    with pytest.raises(ConfigError, match="target layers"):
        build_drafter(cfg, [1, 3, 6], 576)
    cfg.drafter.init_from = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="init_from"):
        build_drafter(cfg, [1, 3, 5], 576)
    cfg.drafter.init_from, cfg.train.selector_loss_alpha = None, 0.0
    d2 = build_drafter(cfg, [1, 3, 5], 576)
    assert all(not p.requires_grad and p.abs().max() == 0 for p in d2.candidate_selector.parameters())
    with pytest.raises(ConfigError, match="selector_top_k"):
        build_drafter(cfg, [1, 3, 5], 10)
    assert dataclasses.asdict(build_drafter(load_config(), [1, 3, 5], 576).arch).keys() == dataclasses.asdict(donor.arch).keys()
