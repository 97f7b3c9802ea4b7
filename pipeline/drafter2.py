"""The DFlash 2 drafter: the DFlash backbone (pipeline/drafter.py) plus two small modules.

    every decoder layer, around BOTH sublayers (attention and MLP), with x = the sublayer's normed input:
        delta = kernel_projection(x)                               [B, Q, 2, T, G]   one projection, both sides
        x'    = conv(x, base_kernel[0], delta[:, :, 0])             the sublayer's input side
        h     = h + conv(sublayer(x'), base_kernel[1], delta[:, :, 1])   its output side
    conv(x, base, delta)[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c],   g(c) = c // group_size,
        zero where row i - t lies in another block (rows are whole blocks of block_size, block-major)

    candidate selector, per block after the anchor (slots 1..bs-1), from the final-normed hidden h:
        unary  = transform(h @ lm_head^T)    transform(z) = cap * tanh(m * z / cap) (m = output_multiplier,
                                              cap = final_logit_softcapping; no tanh when cap is None)
        C_k    = the unary top-K of slot k (sorted, best first)                     [K]
        edge(p -> c) = < A[p] * P(h_k), B[c] > + unary_k[c]     A = predecessor_codebook [V, r],
                                                                B = successor_codebook [V, r], P = hidden_projection
        walk:  p_0 = the anchor token (the verified token); slot k picks argmax_{c in C_k} edge(p_{k-1} -> c)
               (first index on ties, i.e. the higher unary); p_k = that token

Where each detail comes from (read, not copied; the public sources agree unless noted):
- Tensor names and shapes: z-lab's DFlash2 checkpoint header and config (z-lab/dflash tests/fixtures
  dflash2-*.json): `layers.N.{attention,mlp}_conv.base_kernel` [2, T, H], `.kernel_projection.weight`
  [2*T*G, H], `candidate_selector.hidden_projection.weight` [r, H], `.predecessor_codebook` /
  `.successor_codebook` [V, r] (plain tensors, no `.weight`); dflash_config keys conv_kernel_size,
  conv_group_size, selector_rank, selector_top_k, output_multiplier, final_logit_softcapping.
- Convolution: z-lab dflash/model.py (`GroupedDynamicCausalConv.prepare/finish`) and vLLM's
  models/qwen3_dflash2.py (`_grouped_conv`, PR #52816): the projection's output viewed as (2, T, G), side 0
  for the input, 1 for the output, taps masked by the row's position in its block. Identity initialisation
  (base[:, 0] = 1, other taps 0): SpecForge PR #772 and speculators PR #1006. The zero kernel_projection at
  initialisation is our choice (the issue asks that a DFlash 2 model start as its DFlash backbone; with a
  random projection it would not); it still receives gradients (d delta = shifted inputs).
- Selector: z-lab `CandidateSelector.select`, vLLM `_score_edges` and its greedy `_selector_walk_kernel`
  (previous index starts at the anchor row, ties to the lowest index), SpecForge `score_candidates`.
  The sources disagree on the order of the top-K (z-lab: unsorted; vLLM: sorted); we sort, so the walk's
  tie rule picks the higher unary, as vLLM. Unary transform: vLLM `compute_candidates` and z-lab
  `compute_logits` (multiplier, then softcap), applied after the top-K (monotone: same candidates).
- Initialisation of the selector: N(0, initializer_range) for all three (SpecForge's initializer_range
  argument). All-zero would be a saddle: every selector gradient is a product of the other two factors.
- Block attention rule: DFlash's (masks.py), `is_causal` included: absent (our default), sliding layers are
  causal inside the block, which is what z-lab's model derives then; the published DFlash 2 drafters set
  `"is_causal": false` (every layer bidirectional inside the block; configs/qwen3.8-27b-dflash2.yaml).
- Not implemented: dflash_config.input_embedding_scale (vLLM/z-lab read it, default 1.0; never exported).

Torch-only (plus the siblings drafter.py and masks.py): this file is shipped next to the exported modeling file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .drafter import DecoderLayer, DFlashDrafter, DrafterArch

# the dflash_config keys a DFlash 2 export carries beyond DFlash's (the two optional ones only when set)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_OPTIONAL_KEYS = ("output_multiplier", "final_logit_softcapping")


@dataclass
class DFlash2Arch(DrafterArch):
    vocab_size: int = 0  # the target's vocabulary: rows of the selector's codebooks
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None

    def __post_init__(self):
        super().__post_init__()
        if self.vocab_size <= 0:
            raise ValueError("DFlash 2 needs the target's vocab_size (the selector's codebooks have one row per token)")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size} must be between 1 and block_size {self.block_size}")
        if self.conv_group_size <= 0 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.selector_rank <= 0 or not 0 < self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_rank must be positive and selector_top_k in 1..vocab_size ({self.vocab_size})")

    @classmethod
    def from_config(cls, cfg, target_layer_ids, vocab_size: int = 0) -> "DFlash2Arch":
        base = dataclasses.asdict(DrafterArch.from_config(cfg, target_layer_ids))
        own = getattr(cfg, "dflash2", cfg)  # a DrafterConfig keeps these keys in its drafter.dflash2 section
        extra = {k: getattr(own, k) for k in DFLASH2_KEYS + DFLASH2_OPTIONAL_KEYS}
        return cls(**base, vocab_size=int(vocab_size), **extra)

    @classmethod
    def from_exported(cls, cfg: dict) -> "DFlash2Arch":
        base = dataclasses.asdict(DrafterArch.from_exported(cfg))
        dflash = cfg.get("dflash_config") or {}
        missing = [k for k in DFLASH2_KEYS if dflash.get(k, cfg.get(k)) is None]
        if missing:
            raise ValueError(f"a DFlash2DraftModel config needs dflash_config keys {', '.join(missing)}")
        extra = {k: int(dflash.get(k, cfg.get(k))) for k in DFLASH2_KEYS}
        mult = dflash.get("output_multiplier", cfg.get("output_multiplier"))
        cap = dflash.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
        return cls(**base, vocab_size=int(cfg["vocab_size"]), **extra,
                   output_multiplier=1.0 if mult is None else float(mult),
                   final_logit_softcapping=float(cap) if cap else None)

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size


# ----------------------------------------------------------------------------------------------------------
# grouped dynamic convolution (inside each block)
# ----------------------------------------------------------------------------------------------------------


def grouped_dynamic_conv(x: Tensor, delta: Tensor, base: Tensor, block_size: int, group_size: int) -> Tensor:
    """x [B, Q, H] (Q = whole blocks), delta [B, Q, T, G], base [T, H] ->
    out[b, i, c] = sum_t (base[t, c] + delta[b, i, t, c // group_size]) * x[b, i - t, c], 0 across blocks."""
    B, Q, H = x.shape
    T, G = base.shape[0], H // group_size
    if Q % block_size:
        raise ValueError(f"the convolution needs whole blocks: {Q} rows for block size {block_size}")
    xb = x.view(B, Q // block_size, block_size, G, group_size)  # [B, A, bs, G, gs]
    coef = base.to(x.dtype).view(1, 1, 1, T, G, group_size) + delta.to(x.dtype).view(
        B, Q // block_size, block_size, T, G, 1)  # [B, A, bs, T, G, gs]
    out = coef[:, :, :, 0] * xb
    for t in range(1, T):  # tap t reads row i - t of the same block: shift by t inside each block, zeros in front
        shifted = F.pad(xb[:, :, :-t], (0, 0, 0, 0, t, 0))  # [B, A, bs, G, gs]
        out = out + coef[:, :, :, t] * shifted
    return out.view(B, Q, H)


class ZeroLinear(nn.Module):
    """A bias-free linear map that starts at zero. Not an nn.Linear on purpose: it draws no random numbers and
    DFlashDrafter.reset_parameters leaves it alone, so the DFlash 2 modules leave the backbone's seeded
    initialisation exactly as DFlash's."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class GroupedDynamicConv(nn.Module):
    """One sublayer's pair of convolutions (input side 0, output side 1), kernels from ONE projection of x."""

    def __init__(self, arch: DFlash2Arch):
        super().__init__()
        self.taps, self.group_size, self.block_size = arch.conv_kernel_size, arch.conv_group_size, arch.block_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, arch.hidden_size))  # [side, tap, channel]
        self.kernel_projection = ZeroLinear(arch.hidden_size, 2 * self.taps * arch.conv_groups)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity: tap 0 passes x through, no other tap, no dynamic correction."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, Q, H] (normed sublayer input) -> (input-side conv of x [B, Q, H], output-side delta [B, Q, T, G])."""
        B, Q, H = x.shape
        delta = self.kernel_projection(x).view(B, Q, 2, self.taps, H // self.group_size)
        return self._conv(x, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, y: Tensor, delta: Tensor) -> Tensor:
        """y [B, Q, H] (sublayer output), delta from prepare -> output-side conv of y."""
        return self._conv(y, delta, 1)

    def _conv(self, x: Tensor, delta: Tensor, side: int) -> Tensor:
        return grouped_dynamic_conv(x, delta, self.base_kernel[side], self.block_size, self.group_size)


class DecoderLayer2(DecoderLayer):
    """A DFlash decoder layer with a dynamic convolution around each sublayer (same call signature)."""

    def __init__(self, arch: DFlash2Arch, layer_idx: int):
        super().__init__(arch, layer_idx)
        self.attention_conv = GroupedDynamicConv(arch)
        self.mlp_conv = GroupedDynamicConv(arch)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))  # [B, Q, H], [B, Q, T, G]
        h = h + self.attention_conv.finish(self.self_attn(x, ctx, cos, sin, attend, self.layer_type), delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), delta)


# ----------------------------------------------------------------------------------------------------------
# candidate selector
# ----------------------------------------------------------------------------------------------------------


class CandidateSelector(nn.Module):
    def __init__(self, arch: DFlash2Arch):
        super().__init__()
        r = arch.selector_rank
        self.top_k = arch.selector_top_k
        self.hidden_projection = ZeroLinear(arch.hidden_size, r)  # P (random: DFlash2Drafter)
        self.predecessor_codebook = nn.Parameter(torch.zeros(arch.vocab_size, r))  # A
        self.successor_codebook = nn.Parameter(torch.zeros(arch.vocab_size, r))  # B

    def score(self, candidates: Tensor, unary: Tensor, hidden: Tensor, predecessors: Tensor) -> Tensor:
        """candidates [..., K] ids, unary [..., K], hidden [..., H] (the slot's), predecessors [...] ids
        -> edge scores [..., K] in fp32 (fp64 for fp64 inputs): unary + <A[predecessor] * P(hidden), B[candidate]>."""
        acc = torch.promote_types(unary.dtype, torch.float32)
        state = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        pair = torch.einsum("...r,...kr->...k", state.to(acc), self.successor_codebook[candidates].to(acc))
        return unary.to(acc) + pair

    def walk(self, candidates: Tensor, unary: Tensor, hidden: Tensor, anchor_ids: Tensor) -> Tensor:
        """candidates/unary [N, P, K], hidden [N, P, H], anchor_ids [N] -> the greedy path [N, P] from the anchor."""
        prev, path = anchor_ids, []
        for k in range(candidates.shape[1]):
            pick = self.score(candidates[:, k], unary[:, k], hidden[:, k], prev).argmax(-1, keepdim=True)  # [N, 1]
            prev = candidates[:, k].gather(1, pick)[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


def transform_unary(logits: Tensor, multiplier: float, softcap: Optional[float]) -> Tensor:
    """The unary scores the selector adds to: multiplier * logits, then softcap * tanh(. / softcap) if set."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    z = z * multiplier if multiplier != 1.0 else z
    return torch.tanh(z / softcap) * softcap if softcap else z


# ----------------------------------------------------------------------------------------------------------
# the drafter
# ----------------------------------------------------------------------------------------------------------


class DFlash2Drafter(DFlashDrafter):
    """DFlash's modules and names, plus `layers.N.{attention,mlp}_conv` and `candidate_selector`.

    forward/project_context/compile_layers are DFlash's (the layers keep DFlash's call signature). The block
    rows of `forward` must be whole blocks, block-major (as pipeline.masks.build_blocks lays them out)."""

    layer_cls = DecoderLayer2
    draws_from_logits = False  # the draft is the selector's walk (deterministic), not a draw from the logits

    def __init__(self, arch: DFlash2Arch):
        super().__init__(arch)  # DFlash's modules (layers with convolutions), initialised by reset_parameters below
        self.candidate_selector = CandidateSelector(arch)
        self._reset_selector()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The backbone exactly as DFlashDrafter (the same random draws in the same order: the new modules draw
        none, so with the same seed a DFlash 2 model starts as the DFlash model), identity convolutions, then
        a small random selector."""
        super().reset_parameters()
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        if "candidate_selector" in self._modules:  # absent while DFlashDrafter.__init__ runs
            self._reset_selector()

    @torch.no_grad()
    def _reset_selector(self) -> None:
        for p in self.candidate_selector.parameters():
            p.normal_(0.0, self.arch.initializer_range)

    def select(self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor) -> Tensor:
        """The serving decision. hidden [N, P, H] (slots 1..bs-1), logits [N, P, V] = hidden @ lm_head^T,
        anchor_ids [N] (the verified token each block starts from) -> draft ids [N, P]."""
        a = self.arch
        unary, candidates = torch.topk(logits.float(), a.selector_top_k, dim=-1)  # [N, P, K], sorted, best first
        unary = transform_unary(unary, a.output_multiplier, a.final_logit_softcapping)
        return self.candidate_selector.walk(candidates, unary, hidden, anchor_ids.to(candidates.device))

    def pick(self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor) -> Tensor:
        """DFlash's `pick` (the serving decision), here the selector's walk: `select`."""
        return self.select(hidden, logits, anchor_ids)
