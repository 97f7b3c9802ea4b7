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
  through; DDP needs no gradient for it). Each arch's part is its entry in pipeline/archs.py (`build`,
  `train_setup`, `warm_start_from`).
- `drafter_loss(drafter, hidden, head, blocks, tokens, train_cfg)` -> (loss_sum, correct [B*Q], extra), each
  arch's `loss` in pipeline/archs.py:
  * dflash: the chunked gamma-weighted CE (pipeline.loss), correct = argmax == label;
  * dflash2: CE over the transformed unary logits + alpha * the selector's K-way CE (pipeline.loss
    .selector_ce), both gamma-weighted and normalised by the caller with the same weight sum (SpecForge's
    combined numerator over the base denominator); the unary top-K comes from the same chunked pass over the
    head. correct = the teacher-forced selector picks the label among the real candidates, so per-slot
    accuracy and tau measure the tokens serving would draft, not the unary argmax. extra: scalar logs
    (selector loss per weight, top-K coverage).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from pipeline.archs import spec_for, spec_for_export, spec_of
from pipeline.config import Config, ConfigError
from pipeline.drafter import DFlashDrafter
from pipeline.drafter import draft_hidden  # the drafting sequence (training, eval, speculation, export)
from pipeline.masks import Blocks, build_blocks, doc_starts


def compute_dtype(device_type: str, precision: str) -> torch.dtype:
    """dtype of the frozen embedding/head and of the decoded features: bf16 on GPU under bf16 precision;
    fp32 on CPU and under "32-true" (whose fp32 layers would refuse bf16 inputs: no autocast casts them)."""
    return torch.bfloat16 if device_type == "cuda" and precision.startswith("bf16") else torch.float32


def build_drafter(cfg: Config, layer_ids: list[int], vocab_size: int) -> DFlashDrafter:
    spec = spec_for(cfg.drafter.arch)
    drafter = spec.build(cfg, layer_ids, vocab_size)
    if cfg.drafter.init_from:
        init_weights(drafter, cfg.drafter.init_from, cfg.source)
    spec.train_setup(drafter, cfg.train)
    return drafter


def init_weights(drafter: DFlashDrafter, path: str, source: str = "<config>") -> None:
    """drafter.init_from / `dflash train --init-from`: start from an export's weights (stages/init_from.py checks
    the fit first, naming each difference). An export of an arch the drafter's warm-starts from (a DFlash export
    into a DFlash 2 drafter) gives its backbone (`warm_start`); an export of the drafter's own arch gives every
    weight (strict)."""
    import json
    from pathlib import Path

    from pipeline.export import load_exported

    try:
        meta = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{source}: drafter.init_from = {path} is not a loadable DFlash export ({e})") from None
    own, theirs = spec_of(drafter), spec_for_export(meta)
    if theirs is not own:
        if theirs.name in own.warm_start_from:
            return warm_start(drafter, path, source)
        raise ConfigError(f"{source}: drafter.init_from = {path} is a {theirs.title} export; set drafter.arch: "
                          f"{theirs.name}")
    donor, _, _ = load_exported(path)
    own, theirs = drafter.state_dict(), donor.state_dict()
    bad = sorted(set(own) ^ set(theirs)) + [k for k in own if k in theirs and own[k].shape != theirs[k].shape]
    if bad:
        raise ConfigError(f"{source}: drafter.init_from = {path} does not fit this drafter's shape "
                          f"({', '.join(bad[:3])}); the drafter section must match the export's config.json")
    with torch.no_grad():
        for k, v in theirs.items():
            own[k].copy_(v)


def warm_start(drafter: DFlashDrafter, path: str, source: str = "<config>") -> None:
    """Copy a trained export's backbone (for DFlash 2 from DFlash: the layers' attention/MLP/norms, fc,
    hidden_norm, norm) into drafter; the weights its arch adds (`ArchSpec.added_weight`) keep their start."""
    from pipeline.export import load_exported

    try:
        donor, arch, _ = load_exported(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{source}: drafter.init_from = {path} is not a loadable DFlash export ({e}); point it "
                          "at an exported directory (RUN/export: config.json + model.safetensors)") from None
    if list(arch.target_layer_ids) != list(drafter.arch.target_layer_ids):
        raise ConfigError(f"{source}: drafter.init_from = {path} conditions on target layers {arch.target_layer_ids}, "
                          f"this drafter on {drafter.arch.target_layer_ids}; warm-start from a drafter of this target")
    added = spec_of(drafter).added_weight
    own = drafter.state_dict()
    backbone = {k: v for k, v in donor.state_dict().items() if not added(k)}
    bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in backbone.items() if k in own and v.shape != own[k].shape]
    missing = sorted(k for k in own if not added(k) and k not in backbone)
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


def drafter_loss(drafter: nn.Module, hidden: Tensor, head: Tensor, blocks, tokens: Tensor,
                 train_cfg, row_pos: Optional[Tensor] = None) -> tuple[Tensor, Tensor, dict]:
    """hidden [B, Q, H] (the drafter's output), head [V, H] frozen, blocks (pipeline.masks.Blocks), tokens [B, S];
    row_pos [B, Q]: the block positions within the row when they differ from blocks.positions (packed rows).
    The loss of the drafter's arch (pipeline/archs.py)."""
    return spec_of(drafter).loss(drafter, hidden, head, blocks, tokens, train_cfg, row_pos)
