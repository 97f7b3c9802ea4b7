"""DFlash training geometry: anchors, blocks, labels, loss weights and the attention mask.

Shared by the CPU path (SDPA with a dense boolean mask) and the GPU path (compiled flex_attention with a
block-sparse BlockMask). Both masks come from ONE predicate, `dflash_mask_mod`, so they cannot drift apart.

Layout of one training row (one sequence of S context positions and A anchors of block size bs):

    queries  q_idx in [0, Q), Q = A*bs     block j = q_idx // bs, slot k = q_idx % bs
                                            token = [token[anchor_j], MASK, MASK, ...]  position anchor_j + k
    keys     kv_idx in [0, S + Q)           kv < S: context position kv (target features of token kv)
                                            kv >= S: block token (kv - S), same order as the queries

Visibility (the whole contract, see `dflash_mask_mod`):
    - context: kv < anchor_j (STRICT: at inference the anchor's own target features do not exist yet) and
      kv < seq_len; sliding-window layers also need (anchor_j + k) - kv < W, i.e. the last W positions
      before the query's own position, as a standard sliding window over the query's true position;
    - block tokens: every token of its own block (bidirectional); causal inside the block (slot k sees slots
      <= k) where the layer is: `block_causal(is_causal, layer_type)`, the drafter's `is_causal` key read as
      z-lab's reference model reads it (absent: sliding-window layers causal, full layers
      bidirectional; false: every layer bidirectional, sliding layers still windowed on the context; true:
      every layer causal); never another block;
    - padded anchors (-1) see only their own block (so no SDPA row is fully masked and nothing is NaN);
    - packed rows (several documents in one row, `doc_ids` [B, S]: the document of each context position, -1 on
      padding): a query also needs doc_ids[kv] == doc_ids[anchor_j], so it sees only its own document's context;
      positions restart at each document's start and labels stop at its end (`build_blocks`).

This file must stay torch-only (no project imports): it is copied next to the exported modeling file.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
FULL = "full_attention"
SLIDING = "sliding_attention"
FLEX_BLOCK = 128  # flex_attention's tile; lengths are padded to a multiple of it


# ----------------------------------------------------------------------------------------------------------
# anchors and blocks
# ----------------------------------------------------------------------------------------------------------


def anchor_candidates(loss_mask: Tensor) -> Tensor:
    """THE anchor rule: positions a with loss_mask[a] and loss_mask[a+1] (a+1 < S), ascending. loss_mask: [S]
    -> LongTensor [C]. Training draws from these (sample_anchors), eval spaces over or walks them
    (stages/eval.select_anchors) and ingest drops samples without one (data/ingest.has_anchor)."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:], as_tuple=False).flatten()


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: Optional[torch.Generator] = None,
                   per_token: Optional[float] = None) -> Tensor:
    """Anchors for one sequence: uniform without replacement among a with m[a] and m[a+1] (a+1 < S); sorted.

    loss_mask: [S] bool/int. Returns a LongTensor [n] on loss_mask's device, where
      per_token None (rule `fixed`):        n = min(num_anchors, #candidates);
      per_token r (rule `proportional`):    n = min(num_anchors, #candidates, max(1, round(r * #labelled))),
    #labelled = loss_mask.sum(): a short conversation gets fewer anchors than a long one, never none while it
    has a candidate; num_anchors stays the cap (the padded width). Same candidates either way.
    A fresh generator state per epoch gives fresh anchors per epoch.
    """
    cand = anchor_candidates(loss_mask)  # [C]
    n = num_anchors if per_token is None else min(num_anchors, max(1, round(per_token * int(loss_mask.bool().sum()))))
    if cand.numel() > n:
        perm = torch.randperm(cand.numel(), generator=generator, device="cpu")[:n]
        cand = cand[perm.to(cand.device)]
    return torch.sort(cand).values


def stack_anchors(anchors: Sequence[Tensor], num_anchors: Optional[int] = None, multiple: int = 1) -> Tensor:
    """Pad per-sequence anchor lists with -1 into [B, A]; A = max(num_anchors or longest), rounded up to `multiple`.

    Use multiple = 128 // block_size (when it divides) so that Q = A*bs is a multiple of 128 for flex.
    """
    longest = max((int(a.numel()) for a in anchors), default=0)
    width = max(longest, num_anchors or 0, 1)
    width = int(math.ceil(width / multiple) * multiple)
    out = torch.full((len(anchors), width), -1, dtype=torch.long)
    for i, a in enumerate(anchors):
        out[i, : a.numel()] = a.to(torch.long).cpu()
    return out


class Blocks(NamedTuple):
    input_ids: Tensor  # [B, A*bs] long: [token[anchor], MASK x (bs-1)] per block (all MASK for padded anchors)
    positions: Tensor  # [B, A*bs] long: anchor + k (k for padded anchors); packed: anchor - doc start + k (RoPE)
    labels: Tensor  # [B, A*bs] long: token[anchor + k] for k >= 1 where supervised, else IGNORE_INDEX
    weights: Tensor  # [B, A*bs] float32: exp(-(k-1)/gamma) where labelled, else 0


def doc_starts(doc_ids: Tensor) -> Tensor:
    """doc_ids [B, S] (contiguous documents, -1 on padding) -> [B, S] long: where each position's document starts."""
    B, S = doc_ids.shape
    idx = torch.arange(S, device=doc_ids.device).expand(B, S)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=1).values


def build_blocks(
    tokens: Tensor, loss_mask: Tensor, anchors: Tensor, block_size: int, mask_token_id: int, gamma: float,
    doc_ids: Optional[Tensor] = None,
) -> Blocks:
    """Block inputs, query positions, labels and loss weights for anchors [B, A] (-1 = padding).

    tokens, loss_mask: [B, S]. Slot k of block j predicts token[anchor_j + k] (k = 1..bs-1); slot 0 (the
    anchor itself) carries no loss; labels past the sequence end or on loss_mask == 0 are dropped.
    doc_ids [B, S] (packed rows): labels past the anchor's document end are dropped too, and positions count
    from the document's start, so each document's blocks equal those of the document alone.
    """
    B, S = tokens.shape
    A = anchors.shape[1]
    dev = tokens.device
    anchors = anchors.to(dev)
    valid = anchors >= 0  # [B, A]
    a = anchors.clamp(min=0)  # [B, A]
    k = torch.arange(block_size, device=dev)  # [bs]
    pos = a[:, :, None] + k  # [B, A, bs]
    inside = pos < S
    pos_c = pos.clamp(max=S - 1).view(B, A * block_size)
    tok_at = tokens.gather(1, pos_c).view(B, A, block_size)
    sup_at = loss_mask.bool().gather(1, pos_c).view(B, A, block_size)

    input_ids = torch.full((B, A, block_size), mask_token_id, dtype=torch.long, device=dev)
    input_ids[:, :, 0] = torch.where(valid, tok_at[:, :, 0], torch.full_like(tok_at[:, :, 0], mask_token_id))

    labelled = valid[:, :, None] & (k >= 1) & inside & sup_at  # [B, A, bs]
    if doc_ids is not None:  # packed: the label must lie in the anchor's own document
        doc_ids = doc_ids.to(dev)
        own_doc = doc_ids.gather(1, a).view(B, A, 1)  # [B, A, 1]
        labelled = labelled & (doc_ids.gather(1, pos_c).view(B, A, block_size) == own_doc)
        pos = pos - doc_starts(doc_ids).gather(1, a)[:, :, None]  # [B, A, bs]
    labels = torch.where(labelled, tok_at, torch.full_like(tok_at, IGNORE_INDEX))
    decay = torch.exp(-(k.to(torch.float32) - 1.0) / float(gamma))  # [bs]
    weights = torch.where(labelled, decay.expand(B, A, block_size), torch.zeros((), device=dev))

    flat = lambda t: t.reshape(B, A * block_size)  # noqa: E731
    return Blocks(flat(input_ids), flat(pos), flat(labels), flat(weights).to(torch.float32))


# ----------------------------------------------------------------------------------------------------------
# the one mask predicate
# ----------------------------------------------------------------------------------------------------------



def loss_weight_sum(tokens: Tensor, loss_mask: Tensor, anchors: Tensor, block_size: int, gamma: float,
                    doc_ids: Optional[Tensor] = None) -> float:
    """The sum of `build_blocks`' loss weights for a batch: what the loader adds up over a gradient-accumulation
    window, so the step can normalise by the window's weight (stages.train_task)."""
    return float(build_blocks(tokens, loss_mask, anchors, block_size, 0, gamma, doc_ids).weights.sum())


def block_causal(is_causal: Optional[bool], layer_type: str) -> bool:
    """Whether a layer of `layer_type` is causal inside the block, for the drafter's `is_causal` key (None:
    absent, as z-lab's model derives it: sliding-window layers causal, full layers not; else the key itself)."""
    return layer_type == SLIDING if is_causal is None else bool(is_causal)


def dflash_mask_mod(
    anchors: Tensor, seq_lens: Tensor, ctx_len: int, block_size: int, window: Optional[int] = None,
    causal: Optional[bool] = None,
    doc_ids: Optional[Tensor] = None,
) -> Callable:
    """The visibility predicate mask_mod(b, h, q_idx, kv_idx) -> bool (see the module docstring).

    anchors: [B, A'] long (-1 = padding; A' may exceed the real A to cover padded query rows), seq_lens: [B]
    long (valid context length per row), ctx_len: S (where block keys start), window: None for full
    attention, W for a sliding-window layer; causal: causal inside the block (None: exactly when windowed,
    i.e. `block_causal(None, layer_type)`); doc_ids: None (one
    document per row) or [B, S] long for packed rows (a context key must be in the anchor's document).
    Written with tensor ops only: flex vmaps it over scalars, `dense_mask` broadcasts it over index grids.
    """
    causal = (window is not None) if causal is None else bool(causal)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size  # block of the query
        slot = q_idx % block_size  # its slot k
        anchor = anchors[b, blk]  # -1 for padding: sees no context
        is_ctx = kv_idx < ctx_len
        ctx_ok = is_ctx & (kv_idx < anchor) & (kv_idx < seq_lens[b])
        kv_blk = kv_idx - ctx_len  # index among block tokens (negative for context)
        own = (~is_ctx) & (torch.div(kv_blk, block_size, rounding_mode="floor") == blk)
        if window is not None:
            ctx_ok = ctx_ok & (anchor + slot - kv_idx < window)
        if causal:
            own = own & (torch.remainder(kv_blk, block_size) <= slot)
        if doc_ids is not None:  # packed: only the anchor's own document
            last = doc_ids.shape[1] - 1
            ctx_ok = ctx_ok & (doc_ids[b, kv_idx.clamp(max=last)] == doc_ids[b, anchor.clamp(0, last)])
        return ctx_ok | own

    return mask_mod


def _seq_lens(seq_lens: Optional[Tensor], batch: int, ctx_len: int, device) -> Tensor:
    if seq_lens is None:
        return torch.full((batch,), ctx_len, dtype=torch.long, device=device)
    return seq_lens.to(device=device, dtype=torch.long)


def dense_mask(
    anchors: Tensor,
    block_size: int,
    ctx_len: int,
    seq_lens: Optional[Tensor] = None,
    window: Optional[int] = None,
    causal: Optional[bool] = None,
    doc_ids: Optional[Tensor] = None,
) -> Tensor:
    """bool [B, 1, Q, S+Q] (True = attend) for SDPA: the predicate broadcast over index grids. Q = A*bs."""
    B, A = anchors.shape
    dev = anchors.device
    Q = A * block_size
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.zeros((), dtype=torch.long, device=dev)
    q = torch.arange(Q, device=dev).view(1, 1, Q, 1)
    kv = torch.arange(ctx_len + Q, device=dev).view(1, 1, 1, ctx_len + Q)
    docs = None if doc_ids is None else doc_ids.to(dev).long()
    mod = dflash_mask_mod(anchors.long(), _seq_lens(seq_lens, B, ctx_len, dev), ctx_len, block_size, window, causal,
                          docs)
    return mod(b, h, q, kv).expand(B, 1, Q, ctx_len + Q)


def padded_len(n: int, multiple: int = FLEX_BLOCK) -> int:
    return int(math.ceil(n / multiple) * multiple)


_COMPILED: dict = {}  # name -> torch.compile'd function, one per process
_DYNAMIC: list = [None]  # torch.compile's `dynamic` for the table builder (set_dynamic_shapes)


def set_dynamic_shapes(dynamic: Optional[bool]) -> None:
    """The compiled table builder's `dynamic`: True when a run's batches come in many shapes (packed rows, mixed
    lengths), so its first compile is the dynamic one and no later shape recompiles (issue 46 item 2; the
    drafter's layers get the same flag, stages/train_task.py); None is torch's default (static first, dynamic
    at the first new shape). Set before the first batch; each value has its own compiled builder."""
    _DYNAMIC[0] = dynamic


def _flex_attention(compile: bool):
    """flex_attention, compiled once per process when asked (eager flex_attention is a slow reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compile:
        return flex_attention
    if "flex_attention" not in _COMPILED:
        from pipeline.compile_setup import inductor_workarounds

        inductor_workarounds()
        _COMPILED["flex_attention"] = torch.compile(flex_attention)
    return _COMPILED["flex_attention"]


def _pad_anchors(anchors: Tensor, block_size: int, q_len: int) -> Tensor:
    """anchors [B, A] -> [B, ceil(q_len / bs)]: padded query rows belong to extra padded anchors (-1)."""
    B, A = anchors.shape
    a_pad = int(math.ceil(q_len / block_size))
    if a_pad > A:
        anchors = torch.cat([anchors, anchors.new_full((B, a_pad - A), -1)], dim=1)
    return anchors.long()


def block_tables(
    anchors: Tensor,
    block_size: int,
    ctx_len: int,
    seq_lens: Optional[Tensor] = None,
    window: Optional[int] = None,
    tile: int = FLEX_BLOCK,
    causal: Optional[bool] = None,
    doc_ids: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Which (query tile, key tile) pairs of `dflash_mask_mod` are partly / fully visible, without the dense grid.

    Returns (partial, full), bool [B, 1, q_len/tile, kv_len/tile] (lengths padded to `tile`), exactly what
    create_block_mask derives by evaluating the predicate on all Q x KV pairs. Here each query row's visible
    keys are two intervals read off the predicate (the module docstring):
        context [lo, hi):  hi = min(anchor, seq_len, S) (0 for a padded anchor), lo = 0, or for a sliding
                           window lo = max(0, anchor + slot - W + 1); a packed row (doc_ids) also raises lo
                           to the start of the anchor's document;
        own block [S + bs*j, S + bs*j + n):  n = bs, or slot + 1 when causal in the block (causal None: when
                           windowed, as the predicate).
    A key tile [k0, k1) is touched by a row when an interval overlaps it and covered when one interval contains
    it (the two never join: hi <= anchor < S). Cost O(Q x KV / tile) instead of O(Q x KV).
    """
    B, A = anchors.shape
    dev = anchors.device
    q_len, kv_len = padded_len(A * block_size, tile), padded_len(ctx_len + A * block_size, tile)
    anchors = _pad_anchors(anchors.to(dev), block_size, q_len)
    q = torch.arange(q_len, device=dev)  # [Qp]
    j, slot = q // block_size, q % block_size  # [Qp]
    anchor = anchors[:, j]  # [B, Qp]
    lens = _seq_lens(seq_lens, B, ctx_len, dev).clamp(max=ctx_len)[:, None]  # [B, 1]
    c_hi = torch.minimum(anchor, lens).clamp(min=0)  # [B, Qp]
    c_lo = torch.zeros_like(c_hi) if window is None else (anchor + slot - window + 1).clamp(min=0)
    if doc_ids is not None:  # packed: the anchor's document starts at doc_starts[anchor]
        starts = doc_starts(doc_ids.to(dev).long()).gather(1, anchor.clamp(0, ctx_len - 1))  # [B, Qp]
        c_lo = torch.maximum(c_lo, starts)
    b_lo = (ctx_len + j * block_size).expand(B, q_len)  # [B, Qp]
    causal = (window is not None) if causal is None else bool(causal)
    b_hi = b_lo + (slot + 1 if causal else block_size)
    k0 = torch.arange(0, kv_len, tile, device=dev)  # [T] key tile starts
    k1 = k0 + tile

    def touch_cover(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:  # [B, Qp] -> 2 x [B, Qp, T]
        lo, hi = lo[..., None], hi[..., None]
        return torch.maximum(lo, k0) < torch.minimum(hi, k1), (lo <= k0) & (hi >= k1)

    (t_ctx, c_ctx), (t_blk, c_blk) = touch_cover(c_lo, c_hi), touch_cover(b_lo, b_hi)
    rows = lambda x: x.view(B, q_len // tile, tile, -1)  # noqa: E731  [B, Qp/tile, tile, T]
    touched = rows(t_ctx | t_blk).any(dim=2)  # [B, Qp/tile, T]
    full = rows(c_ctx | c_blk).all(dim=2)
    return (touched & ~full)[:, None], full[:, None]


def _define_row_cumsum():
    """`row_cumsum(t)`: int32 [..., n] -> its running sum along the last dim, int32, contiguous; an opaque op
    to torch.compile, so the compiled table builder calls ATen's scan instead of generating one. torch 2.11's
    Inductor split a long scan with few rows (the q-side tables at 16K tokens with 2,048 anchors: 384 rows of
    256) into a `TritonSplitScanKernel`, which drops its X dimension and then failed in `get_block_shape`
    (TypeError: list indices must be integers or slices, not NoneType; issue 28, docs/benchmarks.md). The op is
    defined once per process: an exported drafter's copy of this file finds it already there."""
    try:
        return torch.ops.dflash.row_cumsum.default
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("dflash::row_cumsum", mutates_args=())
    def row_cumsum(t: Tensor) -> Tensor:
        return t.cumsum(-1, dtype=torch.int32).contiguous()

    @row_cumsum.register_fake
    def _(t: Tensor) -> Tensor:
        return t.new_empty(t.shape, dtype=torch.int32)

    return row_cumsum


_row_cumsum = _define_row_cumsum()


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """bool [B, H, rows, cols] -> (count int32 [B, H, rows], column order int32 [B, H, rows, cols]).

    The order lists each row's set columns first, ascending, then the unset ones: what a stable descending
    argsort gives (create_block_mask's layout), computed with one cumsum and a scatter instead of a sort,
    which keeps the compiled builder small (a compiled Triton sort is what made create_block_mask's cold
    compile take minutes).
    """
    t = tiles.to(torch.int32)
    count = t.sum(dim=-1, dtype=torch.int32)
    c = _row_cumsum(t)  # set columns up to and including each column; unset ones: col + 1 - c
    cols = torch.arange(tiles.shape[-1], device=tiles.device, dtype=torch.int32).expand_as(t)
    pos = torch.where(tiles, c - 1, count[..., None] + cols - c)  # each column's slot
    return count, torch.empty_like(t).scatter_(-1, pos.long(), cols)


def _all_tables(anchors: Tensor, seq_lens: Tensor, block_size: int, ctx_len: int, window: Optional[int],
                causal: Optional[bool] = None, doc_ids: Optional[Tensor] = None) -> tuple:
    """The eight BlockMask tables: kv side (forward) and q side (backward), partial and full."""
    partial, full = block_tables(anchors, block_size, ctx_len, seq_lens, window, causal=causal, doc_ids=doc_ids)
    return (*_ordered(partial), *_ordered(full), *_ordered(partial.transpose(-2, -1)),
            *_ordered(full.transpose(-2, -1)))


def flex_block_mask(
    anchors: Tensor,
    block_size: int,
    ctx_len: int,
    seq_lens: Optional[Tensor] = None,
    window: Optional[int] = None,
    compile: Optional[bool] = None,
    causal: Optional[bool] = None,
    doc_ids: Optional[Tensor] = None,
):
    """BlockMask over (Q, S+Q) padded up to multiples of 128, from the same predicate as `dense_mask`.

    The tables come from `block_tables` (exact, no dense grid, no sort), compiled into one small graph on
    CUDA (compile=None) so a step pays a few kernel launches, not a hundred eager ops; the predicate itself
    is attached as the BlockMask's mask_mod for the partial tiles. Padded query rows belong to extra padded
    anchors (-1); padded key columns sit after the block tokens and are seen by nothing real. Build once per
    batch per layer type and share it by all layers of that type.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, A = anchors.shape
    dev = anchors.device
    q_len, kv_len = padded_len(A * block_size), padded_len(ctx_len + A * block_size)
    lens = _seq_lens(seq_lens, B, ctx_len, dev)
    build = _all_tables
    if (dev.type == "cuda") if compile is None else compile:
        key = "tables" if _DYNAMIC[0] is None else f"tables dynamic={_DYNAMIC[0]}"
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(_all_tables, dynamic=_DYNAMIC[0])
        build = _COMPILED[key]
    docs = None if doc_ids is None else doc_ids.to(dev).long()
    # the rule resolved before the compiled builder sees it: None and its meaning (causal exactly when windowed)
    # are one graph, not two (a guard on the argument's value would recompile the tables for each spelling)
    causal = (window is not None) if causal is None else bool(causal)
    kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i = build(anchors.long(), lens, block_size, ctx_len, window, causal,
                                                           docs)
    mod = dflash_mask_mod(_pad_anchors(anchors, block_size, q_len), lens, ctx_len, block_size, window, causal, docs)
    return BlockMask(seq_lengths=(q_len, kv_len), kv_num_blocks=kv_n, kv_indices=kv_i, full_kv_num_blocks=fkv_n,
                     full_kv_indices=fkv_i, q_num_blocks=q_n, q_indices=q_i, full_q_num_blocks=fq_n,
                     full_q_indices=fq_i, BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=mod)


def make_attend(
    kind: str,
    *,
    anchors: Tensor,
    block_size: int,
    ctx_len: int,
    layer_types: Sequence[str],
    sliding_window: Optional[int] = None,
    seq_lens: Optional[Tensor] = None,
    compile: Optional[bool] = None,
    is_causal: Optional[bool] = None,
    doc_ids: Optional[Tensor] = None,
) -> Callable[[Tensor, Tensor, Tensor, str], Tensor]:
    """The drafter's `attend(q [B,h,Q,d], k [B,kv,S+Q,d], v, layer_type) -> [B,h,Q,d]` for one batch.

    kind: "sdpa" (dense boolean mask; CPU training and the reference) or "flex" (BlockMask; compiled on CUDA
    when compile is None). One mask per layer type present, shared by all layers of that type. GQA through
    enable_gqa (no repeat of k/v). is_causal: the drafter's key (`block_causal` reads it per layer type).
    doc_ids [B, S]: packed rows (see `dflash_mask_mod`).
    """
    if kind not in ("sdpa", "flex"):
        raise ValueError(f"attention kind must be 'sdpa' or 'flex', got {kind!r}")
    types = list(layer_types)
    for t in set(types):
        if t not in (FULL, SLIDING):
            raise ValueError(f"unknown layer type {t!r}")
        if t == SLIDING and not sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
    windows = {t: (sliding_window if t == SLIDING else None) for t in set(types)}
    causal = {t: block_causal(is_causal, t) for t in windows}

    if kind == "sdpa":
        masks = {t: dense_mask(anchors, block_size, ctx_len, seq_lens, w, causal[t], doc_ids)
                 for t, w in windows.items()}

        def attend_sdpa(q: Tensor, k: Tensor, v: Tensor, layer_type: str) -> Tensor:
            mask = masks[layer_type]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

        return attend_sdpa

    compile = (anchors.device.type == "cuda") if compile is None else compile
    masks = {t: flex_block_mask(anchors, block_size, ctx_len, seq_lens, w, compile, causal[t], doc_ids)
             for t, w in windows.items()}
    flex = _flex_attention(compile)

    def attend_flex(q: Tensor, k: Tensor, v: Tensor, layer_type: str) -> Tensor:
        Q, KV = q.shape[2], k.shape[2]
        q_len, kv_len = padded_len(Q), padded_len(KV)
        if q_len != Q:  # cheap when the caller already pads S and A*bs to multiples of 128
            q = F.pad(q, (0, 0, 0, q_len - Q))
        if kv_len != KV:
            k = F.pad(k, (0, 0, 0, kv_len - KV))
            v = F.pad(v, (0, 0, 0, kv_len - KV))
        out = flex(q, k, v, block_mask=masks[layer_type], enable_gqa=k.shape[1] != q.shape[1])
        return out[:, :, :Q]

    return attend_flex
