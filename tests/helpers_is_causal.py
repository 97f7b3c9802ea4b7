"""The is_causal checks shared by the GPU tests (tests/test_gpu_is_causal.py, `bash bench/device_run.sh iscausal`)
and their CPU smoke tests (tests/test_is_causal.py): the same functions build the same drafters, batches and
command lines; only the device and the sizes differ, so a typo costs no GPU minute.

- `flex_vs_sdpa(device, ...)`: a DFlash 2 drafter with a sliding and a full layer and is_causal false, run once
  with SDPA's dense mask and once with flex_attention's BlockMask (compiled on CUDA: the training path), outputs
  (and on CUDA gradients) compared; plus the default rule's output, which must differ (the key is honoured).
- `pipeline_commands(...)` / `run_pipeline(...)`: extract, `dflash train` with drafter.arch=dflash2 and
  drafter.is_causal=false, `dflash eval` of its export offline and online; checks the export's config.json and
  the eval report carry is_causal false and the online decode is lossless.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from helpers_batches import anchor_batch, rel_err
from helpers_cli import TINY, dflash
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter
from pipeline.masks import build_blocks, make_attend

H, V, BS, WINDOW = 64, 256, 8, 96


def _drafter(device, is_causal, seed=0):
    torch.manual_seed(seed)
    arch = DFlash2Arch(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, target_layer_ids=[1, 3], rope_theta=1e6,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW, block_size=BS,
                       mask_token_id=7, vocab_size=V, selector_rank=16, selector_top_k=8, is_causal=is_causal)
    d = DFlash2Drafter(arch).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # trained convolutions are not identity
        for n, p in d.named_parameters():
            if "_conv." in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(device))
    return d


def _forward(d, batch, embed, kind, compile):
    B, S = batch["tokens"].shape
    a = d.arch
    blk = build_blocks(batch["tokens"], batch["loss_mask"], batch["anchors"], BS, a.mask_token_id, 4.0)
    attend = make_attend(kind, anchors=batch["anchors"], block_size=BS, ctx_len=S, layer_types=a.layer_types,
                         sliding_window=a.sliding_window, seq_lens=batch["seq_lens"], compile=compile,
                         is_causal=a.is_causal)
    ctx_pos = torch.arange(S, device=embed.device).expand(B, S)
    return d(F.embedding(blk.input_ids, embed), d.project_context(batch["feats"].to(embed.dtype)), blk.positions,
             ctx_pos, attend)


def flex_vs_sdpa(device: str, S: int, compile: bool, backward: bool, dtype=torch.float32) -> dict:
    """-> {"out": rel err flex vs sdpa, "grad": worst rel err over parameters (backward only), "rule": rel
    difference between is_causal false and the default rule (SDPA, fp32)}. The caller asserts the bounds."""
    d = _drafter(device, is_causal=False).to(dtype)
    embed = (torch.randn(V, H) * 0.5).to(device, dtype)
    batch = anchor_batch(device, S, vocab=V, feat_dim=2 * H, block_size=BS, prompt=5, short_by=9, num_anchors=12)
    res = {}
    for kind in ("sdpa", "flex"):
        d.zero_grad(set_to_none=True)
        with warnings.catch_warnings(), torch.set_grad_enabled(backward):  # eager flex has no CPU backward
            warnings.simplefilter("ignore")  # eager flex on CPU warns that it is not compiled
            out = _forward(d, batch, embed, kind, compile if kind == "flex" else None)
        if backward:
            probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(device)
            (out.float() * probe).sum().backward()
        # parameters outside this forward (the final norm, DFlash 2's selector) get no gradient: compare the rest
        res[kind] = (out.detach(), {n: p.grad.detach().clone() for n, p in d.named_parameters() if p.grad is not None}
                     if backward else {})
    (o_s, g_s), (o_f, g_f) = res["sdpa"], res["flex"]
    assert g_s.keys() == g_f.keys() and (g_s or not backward), (sorted(g_s), sorted(g_f))  # the same, and some
    with torch.no_grad():  # the rule's own effect, in fp32 (far above fp32 noise, below bf16's)
        o_false, o_dflt = (_forward(_drafter(device, c), batch, embed.float(), "sdpa", None) for c in (False, None))
    return {"out": rel_err(o_f, o_s), "grad": max((rel_err(g_f[n], g_s[n]) for n in g_s), default=0.0),
            "rule": rel_err(o_dflt, o_false)}


def pipeline_commands(store: Path, run: Path, ev: Path, gpu: bool, samples: int, train_sets: list[str]) -> list:
    """The three `dflash` command lines (argument lists) of the is_causal pipeline check."""
    sets = ["drafter.arch=dflash2", "drafter.is_causal=false", f"train.run_dir={run}", "train.num_workers=1",
            "train.batch_size=8", *train_sets]
    extract = ["extract", "--config", TINY, "--store", str(store), "--shards", "1", "--set",
               f"data.max_samples={samples}", "--set", "extract.token_budget=4096"]
    train = ["train", "--config", TINY, "--store", str(store), *(["--gpus", "0"] if gpu else []),
             *[x for s in sets for x in ("--set", s)]]
    evaluate = ["eval", str(run / "export"), "--store", str(store), "--online", "--out", str(ev),
                "--set", "eval.num_prompts=3", "--set", "eval.max_new_tokens=24"]
    return [extract, train, evaluate]


def run_pipeline(tmp: Path, gpu: bool, samples: int, train_sets: list[str]) -> dict:
    """Run `pipeline_commands` and check what they wrote; returns the eval report."""
    store, run, ev = tmp / "store.zarr", tmp / "run", tmp / "eval"
    for args in pipeline_commands(store, run, ev, gpu, samples, train_sets):
        dflash(*args, gpus=gpu)
    cfg = json.loads((run / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False, cfg
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    rep = json.loads((ev / "report.json").read_text())
    assert rep["drafter"]["is_causal"] is False and rep["online"]["lossless"], rep
    return rep

