"""GPU only: compiled flex_attention with the BlockMask == SDPA with the dense mask (outputs and gradients, bf16),
the block mask (equal to create_block_mask, bounded recompiles), a compiled drafter forward+backward, and the chunked
loss's peak memory. Run on the GPU machine: `python -m pytest -m gpu tests/test_gpu_attention.py`."""

import pytest
import torch
import torch.nn.functional as F

from helpers_batches import anchor_batch, rel_err
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.loss import chunked_weighted_ce
from pipeline.masks import build_blocks, dense_mask, flex_block_mask, make_attend

pytestmark = pytest.mark.gpu

H, BS, WINDOW, V = 512, 16, 256, 1024


def make_arch(layer_types):
    return DrafterArch(hidden_size=H, intermediate_size=1024, num_hidden_layers=len(layer_types),
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, target_layer_ids=[1, 5, 9],
                       layer_types=layer_types, sliding_window=WINDOW, block_size=BS, mask_token_id=7,
                       rope_theta=1e6)


def make_batch(seed, S, num_anchors=24):
    return anchor_batch("cuda", S, vocab=V, feat_dim=3 * H, block_size=BS, prompt=20, short_by=37,
                        num_anchors=num_anchors, seed=seed)


def drafter_for(layer_types, seed=0):
    torch.manual_seed(seed)
    return DFlashDrafter(make_arch(layer_types)).cuda().to(torch.bfloat16)


def forward(model, arch, batch, embed, kind, compile=None):
    B, S = batch["tokens"].shape
    blk = build_blocks(batch["tokens"], batch["loss_mask"], batch["anchors"], BS, arch.mask_token_id, 7.0)
    attend = make_attend(kind, anchors=batch["anchors"], block_size=BS, ctx_len=S, layer_types=arch.layer_types,
                         sliding_window=arch.sliding_window, seq_lens=batch["seq_lens"], compile=compile)
    ctx_pos = torch.arange(S, device="cuda").expand(B, S)
    emb = F.embedding(blk.input_ids, embed)
    ctx = model.project_context(batch["feats"].to(embed.dtype))
    return model(emb, ctx, blk.positions, ctx_pos, attend)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_flex_matches_sdpa_outputs_and_grads(layer_type):
    d = drafter_for([layer_type, layer_type])
    embed = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    batch = make_batch(0, S=700)  # not a multiple of 128: exercises the padding inside attend
    probe = torch.randn(2, 24 * BS, H, device="cuda")
    results = {}
    for kind in ("sdpa", "flex"):
        d.zero_grad(set_to_none=True)
        out = forward(d, d.arch, batch, embed, kind)
        (out.float() * probe).sum().backward()
        results[kind] = (out.detach(), {n: p.grad.detach().clone() for n, p in d.named_parameters()})
    (o_s, g_s), (o_f, g_f) = results["sdpa"], results["flex"]
    assert rel_err(o_f, o_s) < 2e-2
    for n in g_s:
        assert rel_err(g_f[n], g_s[n]) < 5e-2, n


def test_block_mask_on_gpu_equals_create_block_mask_with_bounded_recompiles():
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    from pipeline.masks import _pad_anchors, dflash_mask_mod, padded_len

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    q = torch.randn(2, 8, 384, 64, device="cuda", dtype=torch.bfloat16)
    for seed in range(3):  # same padded shapes, different anchors: no recompile after the first
        batch = make_batch(seed, S=640)
        kv = torch.randn(2, 2, 640 + 384, 64, device="cuda", dtype=torch.bfloat16)
        for window in (None, WINDOW):
            args = (batch["anchors"], BS, 640, batch["seq_lens"], window)
            got = flex_block_mask(*args)
            q_len = padded_len(batch["anchors"].shape[1] * BS)
            mod = dflash_mask_mod(_pad_anchors(batch["anchors"], BS, q_len), batch["seq_lens"], 640, BS, window)
            ref = create_block_mask(mod, 2, None, q_len, padded_len(640 + q_len), device="cuda")
            assert torch.equal(got.to_dense(), ref.to_dense())
            for num in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
                assert torch.equal(getattr(got, num), getattr(ref, num)), num
            for num, idx in (("q_num_blocks", "q_indices"), ("full_kv_num_blocks", "full_kv_indices")):
                for row_n, row_g, row_r in zip(getattr(got, num).flatten().tolist(),
                                               getattr(got, idx).flatten(0, -2), getattr(ref, idx).flatten(0, -2)):
                    assert torch.equal(row_g[:row_n].sort().values, row_r[:row_n].sort().values), idx
            types = ["sliding_attention" if window else "full_attention"]
            kw = dict(anchors=batch["anchors"], block_size=BS, ctx_len=640, layer_types=types,
                      sliding_window=WINDOW, seq_lens=batch["seq_lens"])
            ref = make_attend("sdpa", **kw)(q, kv, kv, types[0])
            got = make_attend("flex", **kw)(q, kv, kv, types[0])
            assert rel_err(got, ref) < 1e-2
            mask = dense_mask(*args)
            assert mask.any(-1).all()  # no fully masked query row
    graphs_same_shape = counters["stats"]["unique_graphs"] - before
    make_attend("flex", anchors=make_batch(9, S=900)["anchors"], block_size=BS, ctx_len=900,
                layer_types=["full_attention"], seq_lens=torch.tensor([900, 863], device="cuda"))
    graphs_total = counters["stats"]["unique_graphs"] - before
    print(f"graphs compiled: {graphs_same_shape} for 3 batches x 2 windows, {graphs_total} after a new length")
    assert graphs_same_shape <= 4, graphs_same_shape  # block tables + flex, per window kind; not per batch
    assert graphs_total <= graphs_same_shape + 4  # a new length: at most one dynamic recompile of each


@pytest.mark.parametrize("regional", [True, False])
def test_compiled_drafter_forward_backward_under_autocast(regional):
    """As training runs it: fp32 parameters, bf16 autocast, compiled drafter (per layer as `dflash train` does, or
    whole), flex with fresh masks per batch; equal to the eager SDPA reference; a bounded number of graphs."""
    import copy

    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    d = DFlashDrafter(make_arch(["sliding_attention", "sliding_attention", "full_attention"])).cuda()
    embed = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    eager = copy.deepcopy(d)
    if regional:
        d.compile_layers()
        compiled = d
    else:
        compiled = torch.compile(d)
    probe = torch.randn(2, 24 * BS, H, device="cuda")  # (the final norm makes sum(out^2) constant: no gradient)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for seed in range(3):
        batch = make_batch(10 + seed, S=768)
        d.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward(compiled, d.arch, batch, embed, "flex")
        (out.float() * probe).sum().backward()
        g_c = {n: p.grad.detach().clone() for n, p in d.named_parameters()}
        if seed == 0:
            eager.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ref = forward(eager, eager.arch, batch, embed, "sdpa")
            (ref.float() * probe).sum().backward()
            assert rel_err(out, ref) < 2e-2
            for n, p in eager.named_parameters():
                assert rel_err(g_c[n], p.grad) < 5e-2, n
    graphs = counters["stats"]["unique_graphs"] - before
    print(f"graphs compiled for 3 batches (regional={regional}): {graphs}")
    # regional: a graph per layer type (+ the first layer, whose input needs no grad); never one per batch
    assert graphs <= (len(d.layers) + 3 if regional else 10), graphs


def test_chunked_loss_peak_memory_is_one_chunk():
    torch.manual_seed(0)
    N, Hd, Vb, chunk = 8192, 512, 32768, 1024
    W = (torch.randn(Vb, Hd, device="cuda") / Hd**0.5).to(torch.bfloat16)
    hidden = torch.randn(N, Hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, Vb, (N,), device="cuda")
    weights = torch.rand(N, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, _ = chunked_weighted_ce(hidden, W, labels, weights, chunk_rows=chunk)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full_logits = N * Vb * 4
    print(f"peak extra {peak / 2**20:.0f} MiB; full fp32 logits would be {full_logits / 2**20:.0f} MiB")
    one_chunk = chunk * Vb * 4  # fp32 logits of one chunk
    assert peak < 4 * one_chunk + N * Hd * 2 * 2  # a few chunk-sized temporaries + dL/dh, never N x V
    assert peak < full_logits / 2
    with torch.no_grad():
        ref = (F.cross_entropy((hidden @ W.t()).float(), labels, reduction="none") * weights).sum()
    assert torch.allclose(loss, ref, rtol=1e-3)


def test_compiled_loss_chunk_matches_eager_reference():
    """The fused (compiled) chunk gives the eager chunk's loss, argmax and input gradient; rows vary per call."""
    torch.manual_seed(1)
    Hd, Vb = 256, 50000
    W = (torch.randn(Vb, Hd, device="cuda") / Hd**0.5).to(torch.bfloat16)
    for N in (1000, 777):  # dynamic row count: the last chunk of a batch is shorter
        hidden = torch.randn(N, Hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, Vb, (N,), device="cuda")
        labels[::7] = -100
        weights = torch.rand(N, device="cuda")
        loss, correct = chunked_weighted_ce(hidden, W, labels, weights, chunk_rows=384)
        loss.backward()
        h = hidden.detach().clone().requires_grad_(True)
        live = labels != -100
        logits = (h @ W.t()).float()
        ref = (F.cross_entropy(logits[live], labels[live], reduction="none") * weights[live]).sum()
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(hidden.grad.float(), h.grad.float(), rtol=2e-2, atol=1e-3)
        assert torch.equal(correct[live], logits[live].argmax(-1) == labels[live])
