"""GPU only (issue 28.1): long samples through the real compiled path: the BlockMask table builder at 8K/16K
tokens, and the 27B-width training step at an 8K-token sample.

torch 2.11's Inductor failed to generate the table builder's scan at long samples with many anchors (a
`TritonSplitScanKernel` without X dimension: TypeError in `get_block_shape`, docs/benchmarks.md "Long
samples"); pipeline/masks.py now leaves that cumsum to ATen (`dflash::row_cumsum`). Before that fix, the
builder alone failed at 8K x 2,048 and 16K x 2,048 anchors on the H200 (torch 2.11; bench/compile_diag.py
--tables-before). The step is the one `dflash train` runs (bench/train_bench.py's case: hidden 5120, 32/8 heads
x 128, FFN 17408, vocab 248,320; three layers, sliding, sliding, full: the three compiled graphs of a 5-layer
drafter, the first layer's (no input gradient) among them, with `compile_layers`' options), one sample of 8,192
tokens with 512 and with 2,048 anchors. Run on the GPU machine: `python -m pytest -m gpu tests/test_gpu_long.py`
(~1-2 min, most of it compiling).
"""

from __future__ import annotations

import pytest
import torch

from bench.train_bench import build_case, train_step
from pipeline import masks
from pipeline.compile_setup import prepare_compile

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("S,A", [(8192, 512), (8192, 2048), (16384, 2048)])
def test_compiled_block_tables_equal_eager_at_long_samples(S, A):
    """The compiled table builder (as every GPU step builds its BlockMasks) compiles at these lengths and gives
    exactly the eager builder's eight tables (counts and column order), sliding window and full."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(S + A)
    lm = torch.ones(S, dtype=torch.bool)
    lm[:200] = False
    anchors = masks.sample_anchors(lm, A, g)[None].cuda()
    lens = torch.tensor([S], device="cuda")
    comp = torch.compile(masks._all_tables)  # what flex_block_mask compiles on CUDA
    for window in (2048, None):
        got = comp(anchors, lens, 16, S, window)
        ref = masks._all_tables(anchors, lens, 16, S, window)
        assert len(got) == 8 and got[7].shape[-2:] == (masks.padded_len(S + 16 * A) // 128, 16 * A // 128)
        for x, y in zip(got, ref):
            assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y)


@pytest.mark.parametrize("A", [512, 2048])
def test_27b_width_step_at_8k_tokens_compiles_and_trains(A):
    torch.manual_seed(0)
    torch._dynamo.reset()
    c = build_case("dflash", 3, 248320, 8192, A, 4096, torch.device("cuda"), {})
    assert c.Q == 16 * A and c.S == 8192
    before = [p.detach().clone() for p in c.drafter.parameters()]
    ref = None
    if A == 512:  # the reference: the same weights, eager layers and SDPA over the dense mask (at 2048 anchors
        # its [32, Q, S + Q] scores would take ~90 GB), no optimizer step
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            from pipeline.train_step import step_loss

            ref_sum, _, blocks, _ = step_loss(c.drafter, c.tokens, c.loss_mask, c.anchors, c.seq_lens, c.feats,
                                              c.embed, c.head, c.cfg, "sdpa")
            ref = float(ref_sum / blocks.weights.sum())
    prepare_compile(limit=16)  # what `dflash train` does before compiling (pipeline/compile_setup.py)
    c.drafter.compile_layers()
    loss = float(train_step(c, "flex"))  # compiled layers, compiled flex attention and loss chunk; one AdamW step
    if ref is not None:
        assert loss == pytest.approx(ref, rel=2e-2), (loss, ref)  # the loss before the update: same math
    assert 5.0 < loss < 20.0  # ~ln(248320) = 12.4 for an untrained drafter
    moved = [not torch.equal(a, b) for a, b in zip(before, c.drafter.parameters())]
    assert sum(moved) >= len(moved) - 1  # as tests/test_long_samples.py: every trained tensor but at most one
    second = float(train_step(c, "flex"))  # the compiled kernels run a second step
    assert 5.0 < second < 20.0
