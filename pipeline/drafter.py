"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on target hidden states by KV injection.

    features [B, S, L*H]  (outputs of target layers target_layer_ids, concatenated in that order)
        -> ctx = hidden_norm(fc(features))                          [B, S, H]   once per sequence
    block_embeds [B, Q, H] (target's frozen embedding of [anchor, MASK, MASK, ...] per block)
        -> n x layer:  h = h + attn(input_layernorm(h), ctx);  h = h + mlp(post_attention_layernorm(h))
        -> norm(h)                                                  [B, Q, H]   (caller applies the frozen lm_head)

    attn: queries from the block tokens only; keys/values = [k_proj/v_proj(ctx) ; k_proj/v_proj(h_normed)].
          ctx is already RMS-normalised by hidden_norm and is projected directly (no input_layernorm), exactly
          as the public DFlash reference. Both halves of the keys go through the layer's k_norm (per head),
          then RoPE at their true positions: context keys at ctx_pos, block keys and queries at q_pos.
          Which key a query may see is the caller's business: it passes `attend(q, k, v, layer_type)`
          (SDPA with a dense mask on CPU, compiled flex_attention with a BlockMask on CUDA; see masks.py).

`draft_hidden` (below the model) is the one drafting sequence: block ids -> the target's embedding -> attend ->
the layers -> norm; training, the offline and online eval and the exported model all call it.

No embedding and no lm_head parameters here: both belong to the target and stay frozen (draft_hidden is handed
the embedding). Parameter names are the export
contract (`layers.{i}.self_attn.q_proj.weight`, ..., `fc.weight`, `hidden_norm.weight`, `norm.weight`),
so `state_dict()` is the exported checkpoint. Torch-only (plus the sibling masks.py): this file is copied
next to the exported modeling file, so it must not import the rest of the project or transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .acceptance import draw
from .masks import FULL, SLIDING, make_attend

Attend = Callable[[Tensor, Tensor, Tensor, str], Tensor]  # (q [B,h,Q,d], k [B,kv,S+Q,d], v, layer_type) -> [B,h,Q,d]


@dataclass
class DrafterArch:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 262144
    layer_types: Optional[list[str]] = None  # per layer: full_attention | sliding_attention (None: all full)
    sliding_window: Optional[int] = None
    block_size: int = 16
    mask_token_id: int = 0
    initializer_range: float = 0.02
    # causal inside the block (config.json `is_causal`, read as z-lab's reference model reads it):
    # None (absent) = sliding-window layers causal, full layers bidirectional; False = every layer
    # bidirectional (the published DFlash 2 drafters); True = every layer causal. masks.block_causal applies it.
    is_causal: Optional[bool] = None

    def __post_init__(self):
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal must be true, false or absent, got {self.is_causal!r}")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise ValueError("need at least one target layer id")

    @classmethod
    def from_config(cls, cfg, target_layer_ids) -> "DrafterArch":
        """From a `pipeline.config.DrafterConfig` (duck-typed: this file imports nothing of the project)."""
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            target_layer_ids=list(target_layer_ids),
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            max_position_embeddings=cfg.max_position_embeddings,
            layer_types=list(cfg.layer_types) if cfg.layer_types else None,
            sliding_window=cfg.sliding_window if cfg.layer_types and SLIDING in cfg.layer_types else None,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            is_causal=getattr(cfg, "is_causal", None),
        )

    @classmethod
    def from_exported(cls, cfg: dict) -> "DrafterArch":
        """From an exported config.json dict (also what the exported modeling file uses)."""
        dflash = cfg.get("dflash_config") or {}
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta"))),
            max_position_embeddings=cfg["max_position_embeddings"],
            layer_types=cfg.get("layer_types"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
            mask_token_id=int(dflash["mask_token_id"]),
            initializer_range=cfg.get("initializer_range", 0.02),
            is_causal=cfg.get("is_causal"),
        )

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def uses_sliding(self) -> bool:
        return SLIDING in self.layer_types

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------
# building blocks (Qwen3)
# ----------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # statistics in fp32
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (Qwen3 / rotate-half layout, full rotary dim)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [d/2]
    freqs = positions[..., None].float() * inv_freq  # [B, T, d/2], fp32 (exact for positions < 2^24)
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, d]
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin  # x [B, h, T, d], cos/sin [B, 1, T, d]


class Attention(nn.Module):
    def __init__(self, arch: DrafterArch):
        super().__init__()
        H, d = arch.hidden_size, arch.head_dim
        self.n_head, self.n_kv, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.n_head * d, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_head * d, H, bias=False)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps)  # per head, over head_dim
        self.k_norm = RMSNorm(d, arch.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, attend: Attend, layer_type: str) -> Tensor:
        # x [B, Q, H] (block tokens, after input_layernorm), ctx [B, S, H] (hidden_norm(fc(features)))
        # cos/sin [B, 1, S+Q, d]: context positions then block positions
        B, Q, _ = x.shape
        S = ctx.shape[1]
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_head, d)).transpose(1, 2)  # [B, h, Q, d]
        q = apply_rope(q, cos[:, :, S:], sin[:, :, S:])
        kv_in = torch.cat([ctx, x], dim=1)  # [B, S+Q, H]: KV injection, context first
        k = self.k_norm(self.k_proj(kv_in).view(B, S + Q, self.n_kv, d)).transpose(1, 2)  # [B, kv, S+Q, d]
        k = apply_rope(k, cos, sin)
        v = self.v_proj(kv_in).view(B, S + Q, self.n_kv, d).transpose(1, 2)  # [B, kv, S+Q, d]
        # under autocast the fp32 norm weights promote q/k to fp32 while v is bf16; flex needs one dtype
        q, k = q.to(v.dtype), k.to(v.dtype)
        o = attend(q, k, v, layer_type)  # [B, h, Q, d]
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.n_head * d))


class MLP(nn.Module):
    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: DrafterArch, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = arch.layer_types[layer_idx]  # what attend() needs (a string guard, not the index)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, attend, self.layer_type)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------------------
# the drafter
# ----------------------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    layer_cls = DecoderLayer  # a subclass may wrap the layer (drafter2.py), keeping its call signature
    # the draft is the logits' argmax, so a sampling decoder may draw from the logits instead (stages/speculate.py);
    # False for a drafter whose `pick` is a rule of its own (DFlash 2's selector walk)
    draws_from_logits = True

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.arch = arch
        H = arch.hidden_size
        self.layers = nn.ModuleList([self.layer_cls(arch, i) for i in range(arch.num_hidden_layers)])
        self.fc = nn.Linear(arch.num_features * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, arch.rms_norm_eps)
        self.norm = RMSNorm(H, arch.rms_norm_eps)
        self.gradient_checkpointing = False  # per-layer activation checkpointing in training
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, initializer_range) (as transformers' Qwen3 init), RMSNorm weights = 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, self.arch.initializer_range)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def compile_layers(self, **kwargs) -> None:
        """Regional compilation: torch.compile each decoder layer, not the whole model. Layers share compiled
        graphs (parameters are graph inputs and no guard depends on the layer's index): one per layer type, plus
        one for the first layer, whose input needs no gradient (checked with 10 layers: 3 graphs). Graph breaks
        stay local to a layer. Inductor options default to `pipeline.compile_setup.layer_compile_options()` (the
        long-sample workaround; an `options=` given here replaces them). Training passes `dynamic=True` when its
        batches come in many shapes (data/sampler.py `shapes_vary`): one graph per variant from the first step."""
        if "options" not in kwargs:
            from pipeline.compile_setup import layer_compile_options

            kwargs["options"] = layer_compile_options() or None
        for layer in self.layers:
            layer.compile(**kwargs)

    def project_context(self, features: Tensor) -> Tensor:
        """features [B, S, L*H] (target layers in target_layer_ids order) -> ctx [B, S, H]."""
        return self.hidden_norm(self.fc(features))

    def forward(self, block_embeds: Tensor, ctx: Tensor, q_pos: Tensor, ctx_pos: Tensor, attend: Attend) -> Tensor:
        """block_embeds [B, Q, H], ctx [B, S, H], q_pos [B, Q], ctx_pos [B, S] -> final-normed hidden [B, Q, H]."""
        d, theta = self.arch.head_dim, self.arch.rope_theta
        cos, sin = rope_cos_sin(torch.cat([ctx_pos, q_pos], dim=1), d, theta, block_embeds.dtype)  # [B,1,S+Q,d]
        h = block_embeds
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, ctx, cos, sin, attend, use_reentrant=False)
            else:
                h = layer(h, ctx, cos, sin, attend)
        return self.norm(h)

    def pick(self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor) -> Tensor:
        """The serving decision. hidden [N, P, H] (slots 1..bs-1), logits [N, P, V] = hidden @ lm_head^T,
        anchor_ids [N] (the verified token each block starts from) -> draft ids [N, P]: DFlash drafts the argmax
        (DFlash 2 overrides this with its selector's walk)."""
        return logits.argmax(-1)


# ----------------------------------------------------------------------------------------------------------
# THE drafting sequence: training, validation, the offline eval, speculation and the export all run it
# ----------------------------------------------------------------------------------------------------------


def draft_hidden(
    drafter: nn.Module,
    block: Tensor,
    ctx: Tensor,
    q_pos: Tensor,
    ctx_pos: Tensor,
    anchors: Optional[Tensor] = None,
    *,
    embed: Optional[Tensor] = None,
    dtype: Optional[torch.dtype] = None,
    kind: str = "sdpa",
    seq_lens: Optional[Tensor] = None,
    doc_ids: Optional[Tensor] = None,
    forward: Optional[Callable] = None,
) -> Tensor:
    """Block tokens and the projected context -> the drafter's final-normed hidden [B, Q, H]:

        block [B, Q] ids  --F.embedding(block, embed)-->  block_embeds [B, Q, H]   (without embed: block IS the
                                                          embeddings [B, Q, H], z-lab's noise_embedding)
        dtype given (inference, in the drafter's dtype): block_embeds and ctx cast to it; None (training):
                                                          nothing cast, autocast decides
        attend = make_attend(kind, anchors [B, A], ...)  the A blocks of each row (Q = A * block size), block a
                                                          sees the context positions < anchors[:, a] (-1: a padded
                                                          anchor); anchors None: one block after all of ctx (S)
        -> n x decoder layer -> norm                      [B, Q, H]   (the caller applies the frozen lm_head)

    ctx [B, S, H] = drafter.project_context(features [B, S, L*H]): decoders keep it projected across steps and
    extend it. q_pos [B, Q], ctx_pos [B, S]: RoPE positions. seq_lens [B] / doc_ids [B, S]: training's padded
    and packed rows (masks.make_attend). forward: what runs the layers and the norm, called as
    forward(block_embeds, ctx, q_pos, ctx_pos, attend) (default: the drafter; training passes its compiled
    wrapper, the exported transformers model `DFlashDrafter.forward` bound to itself).
    """
    arch = drafter.arch
    B, Q = block.shape[0], block.shape[1]
    S = ctx.shape[1]
    block_embeds = block if embed is None else F.embedding(block, embed)  # [B, Q, H]
    if dtype is not None:
        block_embeds, ctx = block_embeds.to(dtype), ctx.to(dtype)
    if anchors is None:
        anchors = torch.full((B, 1), S, dtype=torch.long, device=block_embeds.device)  # [B, 1]
    attend = make_attend(
        kind, anchors=anchors, block_size=Q // anchors.shape[1], ctx_len=S, layer_types=arch.layer_types,
        sliding_window=arch.sliding_window, seq_lens=seq_lens, is_causal=arch.is_causal, doc_ids=doc_ids,
    )
    return (forward or drafter)(block_embeds, ctx, q_pos, ctx_pos, attend)  # [B, Q, H]


def draft_tokens(drafter: nn.Module, hidden: Tensor, head_weight: Tensor, anchor_id: int,
                 probs: Optional[Callable] = None, generator: Optional[torch.Generator] = None):
    """THE drafting rule of one speculative step: the online eval's (stages/speculate.py `DFlashDraftFn`) and
    the export's `spec_generate` (pipeline/modeling_dflash.py, modeling_dflash2.py) are this function.

    hidden [P, H] (the block's slots 1..bs-1, from `draft_hidden`), head_weight [V, H] (the target's lm_head),
    anchor_id (the verified token the block starts from) -> (draft ids [P] as a list, q [P, V] or None, logits
    [P, V] = hidden @ head_weight^T in the head's dtype). Greedy (probs None): the drafter's `pick` (DFlash:
    the argmax; DFlash 2: its selector's walk). Sampling (probs: logits -> distribution): a drafter that
    `draws_from_logits` draws each slot from q = probs(logits) with `generator`; one that does not (DFlash 2)
    keeps its pick with q None (one-hot for the rejection rule, pipeline/acceptance.py `accept_step`)."""
    logits = hidden.to(head_weight.dtype) @ head_weight.t()  # [P, V]
    if probs is not None and drafter.draws_from_logits:
        q = probs(logits)
        return draw(q, generator).tolist(), q, logits
    anchor = torch.tensor([int(anchor_id)], dtype=torch.long, device=hidden.device)
    return drafter.pick(hidden[None], logits[None], anchor)[0].tolist(), None, logits


# ----------------------------------------------------------------------------------------------------------
# inference helper (evaluation): draft blocks after given anchors of one sequence
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def draft_blocks(
    drafter: nn.Module,
    features: Tensor,
    anchor_positions: Tensor,
    anchor_ids: Tensor,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    *,
    mask_token_id: Optional[int] = None,
    block_size: Optional[int] = None,
    return_logits: bool = False,
):
    """Greedy DFlash drafts for several anchors of one sequence in one forward (SDPA, any device).

    features [S, L*H]: target features of context positions 0..S-1. anchor_positions [A] (each 0..S; S means
    "right after the context", the serving case) and anchor_ids [A] (the token at each anchor). The block
    of anchor p sees exactly the context positions < p: the same geometry as training, so drafting with
    several anchors at once equals drafting each one with features[:p].
    Returns draft ids [A, bs-1] (slot k = 1..bs-1 guesses token p+k), plus fp32 logits [A, bs-1, V] if asked
    (for a DFlash 2 drafter the ids are its selector's walk and the logits its unary head's, untransformed).
    """
    arch: DrafterArch = drafter.arch
    bs = block_size or arch.block_size
    mask_id = arch.mask_token_id if mask_token_id is None else mask_token_id
    dev = features.device
    dtype = next(drafter.parameters()).dtype
    S = features.shape[0]
    anchors = anchor_positions.to(dev, torch.long).view(1, -1)  # [1, A]
    A = anchors.shape[1]
    if A == 0 or int(anchors.min()) < 0 or int(anchors.max()) > S:
        raise ValueError(f"anchor positions must lie in [0, {S}] (context length), got {anchor_positions.tolist()}")
    k = torch.arange(bs, device=dev)
    ids = torch.full((A, bs), mask_id, dtype=torch.long, device=dev)
    ids[:, 0] = anchor_ids.to(dev, torch.long)
    q_pos = (anchors.view(A, 1) + k).view(1, A * bs)  # [1, A*bs]
    ctx_pos = torch.arange(S, device=dev).view(1, S)
    ctx = drafter.project_context(features.to(dtype).reshape(1, S, features.shape[-1]))  # [1, S, H]
    h = draft_hidden(drafter, ids.view(1, A * bs), ctx, q_pos, ctx_pos, anchors, embed=embed_weight,
                     dtype=dtype).view(A, bs, -1)[:, 1:]  # [A, bs-1, H]
    logits = (h.to(lm_head_weight.dtype) @ lm_head_weight.t()).float()  # [A, bs-1, V]
    draft = drafter.pick(h, logits, ids[:, 0])  # the argmax, or DFlash 2's selector walk from the anchor token
    return (draft, logits) if return_logits else draft
