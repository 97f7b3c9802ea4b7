"""The drafter's training step, either arch (`drafter.arch`: dflash | dflash2), kept out of the Lightning module.

Contract (stages/train_task.py, bench/train_bench.py and bench/long_bench.py call these and nothing else of it):
- `step_loss(drafter, tokens, loss_mask, anchors, seq_lens, feats, embed, head, cfg, kind)` -> (loss_sum,
  correct, blocks, extra): THE training forward, a pure function of the batch: blocks from the anchors
  (pipeline.masks.build_blocks), the drafting sequence (pipeline.drafter.draft_hidden: embedding, the attention
  of `kind` (flex on CUDA, sdpa on CPU), the drafter's layers and norm), then `drafter_loss`. Training and
  validation (stages/train_task.py) and the step benches run this one function; the caller normalises
  loss_sum (by the weight sum, over all ranks) and steps the optimizer.
- `build_drafter(cfg, layer_ids, vocab_size)` -> the drafter of cfg.drafter.arch, initialised from the current
  torch seed (a DFlash 2 backbone draws exactly what a DFlash drafter would: same seed, same backbone), then,
  if drafter.init_from names a trained DFlash export (ours or a published one), its backbone weights are
  loaded (strict on every backbone key and shape; the convolutions stay identity and the selector random);
  a DFlash 2 export gives a DFlash 2 drafter every weight, a DFlash export a DFlash drafter (`init_weights`).
  With train.selector_loss_alpha = 0 the selector is zeroed and frozen (it then passes the unary ranking
  through; DDP needs no gradient for it).
- `drafter_loss(drafter, hidden, head, blocks, tokens, train_cfg)` -> (loss_sum, correct [B*Q], extra):
  * dflash: the chunked gamma-weighted CE (pipeline.loss), correct = argmax == label;
  * dflash2: CE over the transformed unary logits + alpha * the selector's K-way CE (pipeline.loss
    .selector_ce), both gamma-weighted and normalised by the caller with the same weight sum (SpecForge's
    combined numerator over the base denominator); the unary top-K comes from the same chunked pass over the
    head. correct = the teacher-forced selector picks the label among the real candidates, so per-slot
    accuracy and tau measure the tokens serving would draft, not the unary argmax. extra: scalar logs
    (selector loss per weight, top-K coverage).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn

from pipeline.config import Config, ConfigError
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.drafter import draft_hidden  # the drafting sequence (training, eval, speculation, export)
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter
from pipeline.loss import chunked_weighted_ce, chunked_weighted_ce_topk, selector_ce
from pipeline.masks import Blocks, build_blocks, doc_starts


def build_drafter(cfg: Config, layer_ids: list[int], vocab_size: int) -> DFlashDrafter:
    d = cfg.drafter
    if d.arch == "dflash":
        drafter = DFlashDrafter(DrafterArch.from_config(d, layer_ids))
        if d.init_from:
            init_weights(drafter, d.init_from, cfg.source)
        return drafter
    if d.selector_top_k > vocab_size:
        raise ConfigError(f"{cfg.source}: drafter.selector_top_k = {d.selector_top_k} exceeds the target's "
                          f"vocabulary ({vocab_size})")
    drafter = DFlash2Drafter(DFlash2Arch.from_config(d, layer_ids, vocab_size))
    if d.init_from:
        init_weights(drafter, d.init_from, cfg.source)
    if cfg.train.selector_loss_alpha == 0:
        with torch.no_grad():
            for p in drafter.candidate_selector.parameters():
                p.zero_()
        drafter.candidate_selector.requires_grad_(False)
    return drafter


def init_weights(drafter: DFlashDrafter, path: str, source: str = "<config>") -> None:
    """drafter.init_from / `dflash train --init-from`: start from an export's weights (stages/init_from.py checks
    the fit first, naming each difference). A DFlash export into a DFlash 2 drafter gives its backbone
    (`warm_start`); an export of the drafter's own arch gives every weight (strict)."""
    import json
    from pathlib import Path

    from pipeline.export import load_exported

    try:
        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise ConfigError(f"{source}: drafter.init_from = {path} is not a loadable DFlash export ({e})") from None
    is2 = "DFlash2DraftModel" in archs
    if isinstance(drafter, DFlash2Drafter) and not is2:
        return warm_start(drafter, path, source)
    if is2 and not isinstance(drafter, DFlash2Drafter):
        raise ConfigError(f"{source}: drafter.init_from = {path} is a DFlash 2 export; set drafter.arch: dflash2")
    donor, _, _ = load_exported(path)
    own, theirs = drafter.state_dict(), donor.state_dict()
    bad = sorted(set(own) ^ set(theirs)) + [k for k in own if k in theirs and own[k].shape != theirs[k].shape]
    if bad:
        raise ConfigError(f"{source}: drafter.init_from = {path} does not fit this drafter's shape "
                          f"({', '.join(bad[:3])}); the drafter section must match the export's config.json")
    with torch.no_grad():
        for k, v in theirs.items():
            own[k].copy_(v)


def warm_start(drafter: DFlash2Drafter, path: str, source: str = "<config>") -> None:
    """Copy a trained DFlash export's backbone (layers' attention/MLP/norms, fc, hidden_norm, norm) into drafter."""
    from pipeline.export import load_exported

    try:
        donor, arch, _ = load_exported(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{source}: drafter.init_from = {path} is not a loadable DFlash export ({e}); point it "
                          "at an exported directory (RUN/export: config.json + model.safetensors)") from None
    if list(arch.target_layer_ids) != list(drafter.arch.target_layer_ids):
        raise ConfigError(f"{source}: drafter.init_from = {path} conditions on target layers {arch.target_layer_ids}, "
                          f"this drafter on {drafter.arch.target_layer_ids}; warm-start from a drafter of this target")
    own = drafter.state_dict()
    backbone = {k: v for k, v in donor.state_dict().items() if "_conv." not in k and not k.startswith("candidate_selector.")}
    bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in backbone.items() if k in own and v.shape != own[k].shape]
    missing = sorted(k for k in own if "_conv." not in k and not k.startswith("candidate_selector.") and k not in backbone)
    if bad or missing:
        raise ConfigError(f"{source}: drafter.init_from = {path} does not fit this drafter's shape "
                          f"({'; '.join(bad[:3]) or 'missing ' + ', '.join(missing[:3])}); the drafter section "
                          "(layers, hidden, heads, FFN) must match the export's")
    with torch.no_grad():
        for k, v in backbone.items():
            own[k].copy_(v)


def step_loss(drafter: nn.Module, tokens: Tensor, loss_mask: Tensor, anchors: Tensor, seq_lens: Tensor, feats: Tensor,
              embed: Tensor, head: Tensor, cfg: Config, kind: str,
              model: Optional[nn.Module] = None, doc_ids: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Blocks, dict]:
    """One training forward. tokens/loss_mask [B, S], anchors [B, N] (padded with -1), seq_lens [B],
    feats [B, S, L*H] (decoded target features), embed/head [V, H] frozen; kind "flex" | "sdpa";
    model: a compiled wrapper of drafter, if any; doc_ids [B, S] for packed rows (train.packing: the document
    of each position, -1 on padding; positions restart per document, the mask and labels keep to it).
    -> (loss_sum, correct [B*Q], blocks, extra), Q = N * block."""
    B, S = tokens.shape
    bs = drafter.arch.block_size
    blocks = build_blocks(tokens, loss_mask, anchors, bs, cfg.drafter.mask_token_id, cfg.train.gamma,
                          doc_ids)  # [B, Q] each
    ctx = drafter.project_context(feats)  # [B, S, H]
    ctx_pos = torch.arange(S, device=tokens.device).expand(B, S)  # [B, S]
    if doc_ids is not None:  # packed: RoPE positions count from each document's start
        ctx_pos = ctx_pos - doc_starts(doc_ids.to(tokens.device))
    hidden = draft_hidden(drafter, blocks.input_ids, ctx, blocks.positions, ctx_pos, anchors, embed=embed,
                          kind=kind, seq_lens=seq_lens, doc_ids=doc_ids, forward=model)  # [B, Q, H]
    row_pos = None  # packed: block positions within the row (predecessor tokens), [B, Q]
    if doc_ids is not None:
        row_pos = blocks.positions + doc_starts(doc_ids.to(tokens.device)).gather(
            1, anchors.to(tokens.device).clamp(min=0)).repeat_interleave(bs, dim=1)
    loss_sum, correct, extra = drafter_loss(drafter, hidden, head, blocks, tokens, cfg.train, row_pos)
    return loss_sum, correct, blocks, extra


def predecessor_ids(tokens: Tensor, positions: Tensor) -> Tensor:
    """tokens [B, S], block positions [B, Q] -> the true token before each block row [B*Q] (clamped to the
    sequence: rows whose label is dropped get some id, never used)."""
    prev = (positions - 1).clamp(0, tokens.shape[1] - 1)
    return tokens.gather(1, prev).reshape(-1)


def drafter_loss(drafter: nn.Module, hidden: Tensor, head: Tensor, blocks, tokens: Tensor,
                 train_cfg, row_pos: Optional[Tensor] = None) -> tuple[Tensor, Tensor, dict]:
    """hidden [B, Q, H] (the drafter's output), head [V, H] frozen, blocks (pipeline.masks.Blocks), tokens [B, S];
    row_pos [B, Q]: the block positions within the row when they differ from blocks.positions (packed rows)."""
    rows = hidden.reshape(-1, hidden.shape[-1])  # [B*Q, H]
    labels, weights = blocks.labels.reshape(-1), blocks.weights.reshape(-1)
    if not isinstance(drafter, DFlash2Drafter):
        loss_sum, correct = chunked_weighted_ce(rows, head, labels, weights, train_cfg.loss_chunk_rows)
        return loss_sum, correct, {}
    a = drafter.arch
    scaled = rows * a.output_multiplier if a.output_multiplier != 1.0 else rows
    loss_sum, _, cand = chunked_weighted_ce_topk(scaled, head, labels, weights, a.selector_top_k,
                                                 train_cfg.loss_chunk_rows, a.final_logit_softcapping)
    alpha = train_cfg.selector_loss_alpha
    # alpha 0: the selector is frozen at zero (it passes the unary ranking through); its metrics still count
    with torch.no_grad() if alpha == 0 else contextlib.nullcontext():
        sel_sum, correct, covered = selector_ce(drafter.candidate_selector, rows, head, cand, labels, weights,
                                                predecessor_ids(tokens, blocks.positions if row_pos is None else row_pos),
                                                multiplier=a.output_multiplier, softcap=a.final_logit_softcapping,
                                                chunk_rows=train_cfg.loss_chunk_rows)
    if alpha:
        loss_sum = loss_sum + alpha * sel_sum
    w = weights.sum().clamp(min=1e-6)
    live = (labels >= 0) & (weights != 0)
    extra = {"selector_loss": sel_sum.detach() / w, "topk_coverage": covered.sum() / live.sum().clamp(min=1)}
    return loss_sum, correct, extra
