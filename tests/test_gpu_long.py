"""GPU only (issue 28.1): the 27B-width training step at an 8K-token sample through the real compiled path.

torch 2.11's Inductor failed to generate a kernel of the compiled layers' backward at 8K tokens
(`get_block_shape`: TypeError, docs/benchmarks.md "Long samples"); 2K compiled. The step here is the one
`dflash train` runs (bench/train_bench.py's case: hidden 5120, 32/8 heads x 128, FFN 17408, vocab 248,320;
two layers, one sliding-window and one full, so both layer types and the first layer's variant compile),
one sample of 8,192 tokens with 512 anchors. Run on the GPU machine: `python -m pytest -m gpu tests/test_gpu_long.py`
(~1 min, most of it compiling).
"""

from __future__ import annotations

import pytest
import torch

from bench.train_bench import build_case, train_step
from pipeline.compile_setup import prepare_compile

pytestmark = pytest.mark.gpu


def test_27b_width_step_at_8k_tokens_compiles_and_matches_eager():
    torch.manual_seed(0)
    c = build_case("dflash", 2, 248320, 8192, 512, 4096, torch.device("cuda"), {})
    assert c.Q == 8192 and c.S == 8192
    before = [p.detach().clone() for p in c.drafter.parameters()]
    # the reference: the same weights, eager layers and SDPA over the dense mask, no optimizer step
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        from pipeline.train_step import step_loss

        ref_sum, _, blocks, _ = step_loss(c.drafter, c.tokens, c.loss_mask, c.anchors, c.seq_lens, c.feats, c.embed,
                                          c.head, c.cfg, "sdpa")
        ref = float(ref_sum / blocks.weights.sum())
    prepare_compile(limit=16)  # what `dflash train` does before compiling (pipeline/compile_setup.py)
    c.drafter.compile_layers()
    loss = float(train_step(c, "flex"))  # compiled layers, compiled flex attention and loss chunk; one AdamW step
    assert loss == pytest.approx(ref, rel=2e-2), (loss, ref)  # the loss before the update: same math
    assert 5.0 < loss < 20.0  # ~ln(248320) = 12.4 for an untrained drafter
    moved = [not torch.equal(a, b) for a, b in zip(before, c.drafter.parameters())]
    assert sum(moved) >= len(moved) - 1  # as tests/test_long_samples.py: every trained tensor but at most one
    second = float(train_step(c, "flex"))  # the compiled kernels run a second step
    assert 5.0 < second < 20.0
