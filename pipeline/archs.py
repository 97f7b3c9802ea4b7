"""The drafter architectures (`drafter.arch`), one entry each: `ARCHS[name]` is its `ArchSpec`, and every place
that does something per arch asks this registry instead of testing the drafter or the arch's name.

    ArchSpec            what it is                                 who asks
    name, title         "dflash2" (drafter.arch), "DFlash 2"       config's tuple (tests hold it equal), messages
    architecture        "DFlash2DraftModel": its export's config.json `architectures` (the transformers class)
                                                                   pipeline.export.load_exported, --init-from
    arch_class,         DFlash2Arch, DFlash2Drafter                 `spec_of(drafter)`, the checkpoint loader
    drafter_class
    config_keys         keys of its section (drafter.NAME.*, pipeline/config_NAME.py) that fix its shape,
                        written into its export's dflash_config    --init-from's comparison (stages/init_from.py)
    optional_keys       keys of its section that do not (defaults left out of the export)
    build               (cfg, layer_ids, vocab_size) -> a fresh drafter (the current torch seed)
    train_setup         (drafter, train_cfg): after its init weights (pipeline.train_step.build_drafter)
    loss                pipeline.train_step.drafter_loss's arguments -> (loss_sum, correct, extra)
    export              (drafter, arch, out_dir, **kw): its files, through pipeline/export_dir.write_files
    load_export         (path, meta, device, dtype) -> (drafter, arch, meta)   pipeline.export.load_exported
    warm_start_from     the archs whose exports give it its backbone (pipeline.train_step.warm_start)
    added_weight        its weights beyond that backbone (by state_dict key)
    adds                those weights in words (--init-from's message)

The drafting decision is not here: it is the drafter's own method, `pick` (DFlash's argmax, DFlash 2's selector
walk), and `draws_from_logits` says whether a sampling decoder may draw from the logits (stages/speculate.py).
A checkpoint records its arch as the arch's dict (`arch.to_dict()`); `drafter_from_arch_dict` builds it back.
`check_sizes` (pipeline/arch_sizes.py, re-exported here) runs before a checkpoint's or an export's drafter is built: each size within
pipeline/config_ranges.py's range for its drafter key, the layer count that of the weights stored, and every
tensor of the drafter (built on the meta device: nothing allocated) the shape of the stored one; otherwise
`ArchError`, one line, and nothing was allocated (a hidden size of 10^7 hung export and eval before).

pipeline/config.py knows the archs by their key sections (`DRAFTER_ARCHS`: dflash and one per `drafter.NAME`
section, each section's class with its own `check`): it cannot import this file (pipeline/export2.py ->
pipeline/target.py -> pipeline/config.py); tests/test_archs.py holds the two equal.
A new arch: its drafter file (pipeline/drafterN.py), its export (pipeline/exportN.py) and modeling file
(pipeline/modeling_dflashN.py), one ArchSpec here, its keys' section (pipeline/config_NAME.py, one field of
DrafterConfig), and its tests (docs/architecture.md, "Where to change what").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from .drafter import DFlashDrafter, DrafterArch
from .drafter2 import DFLASH2_KEYS, DFLASH2_OPTIONAL_KEYS, DFlash2Arch, DFlash2Drafter
from .arch_sizes import ArchError, check_sizes  # noqa: F401  (re-exported: callers name them here)
from .errors import ConfigError
from .export1 import ARCHITECTURE as DFLASH_ARCHITECTURE, export_dflash, load_exported1
from .export2 import ARCHITECTURE as DFLASH2_ARCHITECTURE, export_dflash2, load_exported2
from .loss import chunked_weighted_ce, chunked_weighted_ce_topk, predecessor_ids, selector_ce


def _nothing(*_args) -> None:
    return None


def _no_weight(_key: str) -> bool:
    return False


@dataclass(frozen=True)
class ArchSpec:
    name: str
    title: str
    architecture: str
    arch_class: type
    drafter_class: type
    build: Callable[..., nn.Module]
    loss: Callable[..., tuple]
    export: Callable[..., object]
    load_export: Callable[..., tuple]
    config_keys: tuple[str, ...] = ()
    optional_keys: tuple[str, ...] = ()
    train_setup: Callable[..., None] = _nothing
    warm_start_from: tuple[str, ...] = ()
    added_weight: Callable[[str], bool] = _no_weight
    adds: str = ""


# ----------------------------------------------------------------------------------------------------------
# DFlash (pipeline/drafter.py, pipeline/export1.py, pipeline/modeling_dflash.py)
# ----------------------------------------------------------------------------------------------------------


def _build_dflash(cfg, layer_ids: list[int], vocab_size: int) -> DFlashDrafter:
    return DFlashDrafter(DrafterArch.from_config(cfg.drafter, layer_ids))


def _loss_dflash(drafter: nn.Module, hidden: Tensor, head: Tensor, blocks, tokens: Tensor, train_cfg,
                 row_pos: Optional[Tensor] = None) -> tuple[Tensor, Tensor, dict]:
    """The chunked gamma-weighted CE (pipeline.loss); correct = argmax == label."""
    rows = hidden.reshape(-1, hidden.shape[-1])  # [B*Q, H]
    labels, weights = blocks.labels.reshape(-1), blocks.weights.reshape(-1)
    loss_sum, correct = chunked_weighted_ce(rows, head, labels, weights, train_cfg.loss_chunk_rows)
    return loss_sum, correct, {}


# ----------------------------------------------------------------------------------------------------------
# DFlash 2 (pipeline/drafter2.py, pipeline/export2.py, pipeline/modeling_dflash2.py)
# ----------------------------------------------------------------------------------------------------------


def _build_dflash2(cfg, layer_ids: list[int], vocab_size: int) -> DFlash2Drafter:
    d = cfg.drafter
    if d.dflash2.selector_top_k > vocab_size:
        raise ConfigError(f"{cfg.source}: drafter.dflash2.selector_top_k = {d.dflash2.selector_top_k} exceeds the "
                          f"target's vocabulary ({vocab_size})")
    return DFlash2Drafter(DFlash2Arch.from_config(d, layer_ids, vocab_size))


def _train_setup_dflash2(drafter: DFlash2Drafter, train_cfg) -> None:
    """train.selector_loss_alpha = 0: the selector zeroed and frozen (it then passes the unary ranking through;
    DDP needs no gradient for it)."""
    if train_cfg.selector_loss_alpha == 0:
        with torch.no_grad():
            for p in drafter.candidate_selector.parameters():
                p.zero_()
        drafter.candidate_selector.requires_grad_(False)


def _loss_dflash2(drafter: DFlash2Drafter, hidden: Tensor, head: Tensor, blocks, tokens: Tensor, train_cfg,
                  row_pos: Optional[Tensor] = None) -> tuple[Tensor, Tensor, dict]:
    """CE over the transformed unary logits + alpha * the selector's K-way CE (pipeline.train_step's docstring)."""
    rows = hidden.reshape(-1, hidden.shape[-1])  # [B*Q, H]
    labels, weights = blocks.labels.reshape(-1), blocks.weights.reshape(-1)
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


def _added_weight_dflash2(key: str) -> bool:
    return "_conv." in key or key.startswith("candidate_selector.")


# ----------------------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------------------


ARCHS: dict[str, ArchSpec] = {s.name: s for s in (
    ArchSpec(name="dflash", title="DFlash", architecture=DFLASH_ARCHITECTURE, arch_class=DrafterArch,
             drafter_class=DFlashDrafter, build=_build_dflash, loss=_loss_dflash, export=export_dflash,
             load_export=load_exported1),
    ArchSpec(name="dflash2", title="DFlash 2", architecture=DFLASH2_ARCHITECTURE, arch_class=DFlash2Arch,
             drafter_class=DFlash2Drafter, build=_build_dflash2, loss=_loss_dflash2, export=export_dflash2,
             load_export=load_exported2, config_keys=DFLASH2_KEYS, optional_keys=DFLASH2_OPTIONAL_KEYS,
             train_setup=_train_setup_dflash2, warm_start_from=("dflash",), added_weight=_added_weight_dflash2,
             adds="convolutions and a candidate selector"),
)}
DEFAULT = "dflash"  # what an export naming no architecture of ours is read as (a foreign DFlash checkpoint)


def spec_for(name: str) -> ArchSpec:
    """drafter.arch -> its spec."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"drafter.arch {name!r} is not one of {', '.join(ARCHS)}") from None


def spec_of(drafter: nn.Module) -> ArchSpec:
    """A drafter -> the spec of its class (the nearest registered class up its MRO)."""
    by_class = {s.drafter_class: s for s in ARCHS.values()}
    for cls in type(drafter).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise TypeError(f"{type(drafter).__name__} is not a drafter of a registered arch ({', '.join(ARCHS)})")


def spec_for_export(meta: dict) -> ArchSpec:
    """An export's config.json -> the spec of the architecture it names (a later arch first), else DFlash's."""
    names = meta.get("architectures") or []
    for spec in reversed(ARCHS.values()):
        if spec.architecture in names:
            return spec
    return ARCHS[DEFAULT]


def architectures() -> list[str]:
    """Every export architecture name of ours, in registry order."""
    return [s.architecture for s in ARCHS.values()]


def spec_for_arch_dict(d: dict) -> ArchSpec:
    """A checkpoint's recorded arch (`arch.to_dict()`) -> its spec: of the archs whose shape keys it holds all of,
    the one with the most (a DFlash 2 dict holds DFlash's fields and its own; DFlash's, no others)."""
    return max((s for s in ARCHS.values() if all(k in d for k in s.config_keys)), key=lambda s: len(s.config_keys))


def drafter_from_arch_dict(d: dict, state: Optional[dict] = None, where: str = "the checkpoint") -> nn.Module:
    """A checkpoint's recorded arch -> the matching, freshly built drafter (stages/export.py loads its weights).
    `state`: the weights it will load ({name: tensor}); given, the arch is checked against them first
    (`check_sizes`)."""
    spec = spec_for_arch_dict(d)
    if state is not None:
        check_sizes(d, {k: tuple(v.shape) for k, v in state.items()}, where,
                    lambda: spec.drafter_class(spec.arch_class(**d)))
    return spec.drafter_class(spec.arch_class(**d))
