"""GPU only (issue 20): the DFlash 2 drafter under compiled flex attention and bf16 equals SDPA (outputs and
gradients, the convolutions and the selector loss included), and `dflash train` with drafter.arch=dflash2 runs
end to end on one GPU (compiled layers, bf16-mixed, softcapped unary) and exports a DFlash2DraftModel.
Run on the GPU machine: `python -m pytest -m gpu tests/test_gpu_dflash2.py`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers_cli import dflash
from pipeline.train_step import drafter_loss
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter
from pipeline.masks import build_blocks
from test_gpu_attention import BS, H, V, forward, make_arch, make_batch, rel_err

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def dflash2_drafter(seed=0):
    import dataclasses

    torch.manual_seed(seed)
    base = dataclasses.asdict(make_arch(["sliding_attention", "full_attention"]))
    d = DFlash2Drafter(DFlash2Arch(**base, vocab_size=V, selector_rank=64, selector_top_k=16,
                                   final_logit_softcapping=30.0)).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    with torch.no_grad():  # trained convolutions are not identity
        for n, p in d.named_parameters():
            if "_conv." in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g, device="cuda"))
    return d


def test_compiled_flex_matches_sdpa_with_the_dflash2_loss():
    d = dflash2_drafter()
    embed = torch.randn(V, H, device="cuda") * 0.5
    head = torch.randn(V, H, device="cuda") * 0.5
    batch = make_batch(0, S=700)
    blk = build_blocks(batch["tokens"], batch["loss_mask"], batch["anchors"], BS, d.arch.mask_token_id, 7.0)
    cfg = SimpleNamespace(loss_chunk_rows=512, selector_loss_alpha=1.0)
    results = {}
    for kind in ("sdpa", "flex"):
        if kind == "flex":
            d.compile_layers()  # what `dflash train` does on CUDA
        d.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward(d, d.arch, batch, embed.bfloat16(), kind)
            loss, correct, extra = drafter_loss(d, out, head.bfloat16(), blk, batch["tokens"], cfg)
        loss.backward()
        assert torch.isfinite(loss) and 0 < float(extra["topk_coverage"]) <= 1
        results[kind] = (out.detach(), float(loss), {n: p.grad.detach().clone() for n, p in d.named_parameters()})
    (o_s, l_s, g_s), (o_f, l_f, g_f) = results["sdpa"], results["flex"]
    assert rel_err(o_f, o_s) < 2e-2 and abs(l_f - l_s) < 2e-2 * abs(l_s)
    for n in g_s:
        assert g_s[n].abs().max() > 0, n
        # the selector's gradients depend on which ids make each row's top-K: a bf16 near-tie at the K-th logit
        # can flip between the two attention kernels, so they get a looser bound than the dense gradients
        assert rel_err(g_f[n], g_s[n]) < (0.15 if "candidate_selector" in n else 5e-2), n


@pytest.mark.gpu_alone  # starts dflash on the GPU: run alone (bench part gputests)
def test_train_dflash2_on_gpu(tmp_path):
    store, run = str(tmp_path / "store.zarr"), tmp_path / "run"
    dflash("extract", "--config", TINY, "--store", store, "--set", "data.max_samples=240",
           "--set", "extract.token_budget=4096", gpus=True)
    sets = ["drafter.arch=dflash2", "drafter.dflash2.final_logit_softcapping=30.0", f"train.run_dir={run}",
            "train.precision=bf16-mixed", "train.compile=on", "train.epochs=2", "train.batch_size=8",
            "train.val_every=20", "train.num_workers=1"]
    dflash("train", "--config", TINY, "--store", store, "--gpus", "0", *[x for s in sets for x in ("--set", s)],
           gpus=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] > 0 and summary["val"]["val/tau"] > 1.0, summary
    cfg = json.loads((run / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["final_logit_softcapping"] == 30.0
    ev = tmp_path / "eval"
    dflash("eval", str(run / "export"), "--store", store, "--online", "--out", str(ev), "--set", "eval.num_prompts=4",
           gpus=True)
    rep = json.loads((ev / "report.json").read_text())
    assert rep["offline"]["tau"] > 1.0 and rep["online"]["lossless"]
