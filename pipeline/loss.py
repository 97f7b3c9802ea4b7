"""Chunked, gamma-weighted cross-entropy through the target's FROZEN lm_head.

For a 27B target the head is [248,320 x 5120]; one training sample has ~8K block rows, so full logits
(rows x V fp32 = 8 GB, plus the same again for softmax and for the backward) must never exist. The custom
autograd Function below walks the rows in chunks of `chunk_rows`; per chunk it computes the logits, the
per-row CE, the argmax and, because the head is frozen, the whole input gradient

    dL/dh_i = w_i * (softmax(h_i W^T) - onehot(y_i)) @ W        [rows, H]

and stashes it. Backward only scales the stash by the incoming scalar gradient: no logits are recomputed or
kept, so peak extra memory is O(chunk_rows x V), independent of the number of rows.
Rows with label IGNORE_INDEX (or weight 0) are skipped entirely (padded anchors, slot 0, unsupervised).

DFlash 2 (pipeline/drafter2.py) adds: the same pass can also return each row's top-K ids and apply a logit
softcap (`chunked_weighted_ce_topk`), and `selector_ce` is the selector's K-way cross-entropy over those
candidates, whose unary logits are recomputed for the K ids only, chunk by chunk (`_GatheredLogits`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pipeline.masks import IGNORE_INDEX  # the one definition, beside the labels it marks


def _ce_chunk(logits: Tensor, y: Tensor, w: Tensor, acc_dtype: torch.dtype,
              need_grad: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One chunk: logits [c, V], labels y [c], weights w [c] -> (sum_i w_i CE_i, argmax == y [c],
    dlogits [c, V] = w_i (softmax - onehot) in the logits' dtype, or None). Softmax in acc_dtype (fp32)."""
    lf = logits.to(acc_dtype)
    m = lf.amax(-1, keepdim=True)  # [c, 1]
    e = (lf - m).exp()
    s = e.sum(-1, keepdim=True)
    lse = (m + s.log()).squeeze(1)  # [c]
    ce = lse - lf.gather(1, y[:, None]).squeeze(1)  # [c]
    g = None
    if need_grad:
        onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == y[:, None]  # [c, V]
        g = ((e / s - onehot.to(acc_dtype)) * w[:, None]).to(logits.dtype)
    return (ce * w).sum(), lf.argmax(-1) == y, g


_COMPILED_CHUNK: list = []
CHUNK_COMPILE_OPTIONS: dict = {}  # Inductor options for the compiled chunk (bench/compile_diag.py tries some)


def _ce_chunk_fn(cuda: bool):
    """On CUDA, the chunk compiled into a few fused kernels: the logits are read ~3 times instead of the ~12
    passes (cast, argmax, logsumexp, sub, exp, mul, cast) the eager ops make over [c, V] fp32 (measured: 41 ms
    of a 260 ms 27B-class step). The row count is dynamic (the last chunk is shorter): no recompiles."""
    if not cuda:
        return _ce_chunk
    if not _COMPILED_CHUNK:
        from pipeline.compile_setup import inductor_workarounds

        inductor_workarounds()
        _COMPILED_CHUNK.append(torch.compile(_ce_chunk, dynamic=True, options=CHUNK_COMPILE_OPTIONS or None))
    return _COMPILED_CHUNK[0]


class _ChunkedWeightedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, row_weights: Tensor, chunk_rows: int,
                top_k: int = 0, softcap: float = 0.0):
        # hidden [N, H], weight [V, H] (frozen), labels [N] long, row_weights [N]; top_k > 0: also the ids of each
        # supervised row's top_k logits [N, K] (sorted, best first; 0 elsewhere); softcap > 0: CE over
        # softcap * tanh(logits / softcap) (DFlash 2's unary transform; the top-K is the same either way)
        N, H = hidden.shape
        need_grad = ctx.needs_input_grad[0]
        grad = torch.zeros_like(hidden) if need_grad else None  # [N, H] stashed dL/dh
        correct = torch.zeros(N, dtype=torch.bool, device=hidden.device)
        topk = torch.zeros(N, top_k, dtype=torch.long, device=hidden.device)
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (tests)
        loss_sum = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        live = (labels != IGNORE_INDEX) & (row_weights != 0)
        rows = torch.nonzero(live, as_tuple=False).flatten()  # [R] supervised rows (host sync, outside compile)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, rows.numel(), chunk_rows):
                idx = rows[start : start + chunk_rows]  # [c]
                h = hidden.index_select(0, idx).to(weight.dtype)  # [c, H]
                y = labels.index_select(0, idx)  # [c]
                w = row_weights.index_select(0, idx).to(acc_dtype)  # [c]
                logits = h @ weight.t()  # [c, V] in the head's dtype (bf16 on GPU), fp32-accumulated GEMM
                if top_k:
                    topk[idx] = logits.topk(top_k, dim=-1).indices  # [c, K]
                if softcap:
                    t = torch.tanh(logits.to(acc_dtype) / softcap)  # [c, V]
                    logits = t * softcap
                ce_sum, correct[idx], g = _ce_chunk_fn(logits.is_cuda)(logits, y, w, acc_dtype, need_grad)
                loss_sum = loss_sum + ce_sum
                if need_grad:
                    if softcap:
                        g = g * (1 - t * t)  # d(cap * tanh(z / cap)) / dz
                    grad.index_copy_(0, idx, (g.to(weight.dtype) @ weight).to(grad.dtype))  # [c, H]
                del logits, g
        ctx.save_for_backward(grad if need_grad else torch.empty(0))
        ctx.mark_non_differentiable(correct, topk)
        return loss_sum, correct, topk

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_correct: Optional[Tensor], grad_topk: Optional[Tensor]):
        (grad,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        return (grad * grad_loss.to(grad.dtype),) + (None,) * 6


def chunked_weighted_ce(
    hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, weights: Tensor, chunk_rows: int = 4096
) -> tuple[Tensor, Tensor]:
    """Sum_i w_i * CE(h_i @ W^T, y_i) over rows, never holding more than chunk_rows x V logits.

    hidden [..., H] (the drafter's final-normed output), lm_head_weight [V, H] (frozen: requires_grad False),
    labels [...] (IGNORE_INDEX = no loss), weights [...] (exp(-(k-1)/gamma), 0 where ignored).
    Returns (loss_sum: fp32 scalar with grad to hidden, correct: bool [...] = argmax == label, False where
    ignored). Normalise with `normalised_loss`.
    """
    _check_frozen(lm_head_weight, chunk_rows)
    shape = labels.shape
    H = hidden.shape[-1]
    loss_sum, correct, _ = _ChunkedWeightedCE.apply(
        hidden.reshape(-1, H), lm_head_weight, labels.reshape(-1).long(), weights.reshape(-1), int(chunk_rows)
    )
    return loss_sum, correct.view(shape)


def _check_frozen(lm_head_weight: Tensor, chunk_rows: int) -> None:
    if lm_head_weight.requires_grad:
        raise ValueError("chunked_weighted_ce: the lm_head is frozen here (no weight gradient is computed); "
                         "call lm_head_weight.requires_grad_(False) or pass .detach()")
    if chunk_rows <= 0:
        raise ValueError("chunk_rows must be positive")


# ----------------------------------------------------------------------------------------------------------
# DFlash 2: the selector's K-way cross-entropy over the unary top-K (pipeline/drafter2.py)
# ----------------------------------------------------------------------------------------------------------


def predecessor_ids(tokens: Tensor, positions: Tensor) -> Tensor:
    """tokens [B, S], block positions [B, Q] -> the true token before each block row [B*Q] (clamped to the
    sequence: rows whose label is dropped get some id, never used)."""
    prev = (positions - 1).clamp(0, tokens.shape[1] - 1)
    return tokens.gather(1, prev).reshape(-1)


def chunked_weighted_ce_topk(hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, weights: Tensor, top_k: int,
                             chunk_rows: int = 4096, softcap: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """`chunked_weighted_ce`, plus the ids of each supervised row's top_k logits taken chunk by chunk from the
    same logits (no second pass over the head): (loss_sum, correct [...], candidates [..., K] long, sorted best
    first, 0 on unsupervised rows). softcap: the CE is over softcap * tanh(logits / softcap)."""
    _check_frozen(lm_head_weight, chunk_rows)
    if top_k <= 0:
        raise ValueError("top_k must be positive")
    shape = labels.shape
    H = hidden.shape[-1]
    loss_sum, correct, topk = _ChunkedWeightedCE.apply(
        hidden.reshape(-1, H), lm_head_weight, labels.reshape(-1).long(), weights.reshape(-1), int(chunk_rows),
        int(top_k), float(softcap or 0.0))
    return loss_sum, correct.view(shape), topk.view(*shape, top_k)


class _GatheredLogits(torch.autograd.Function):
    """logits of chosen ids only: out[n, k] = <hidden[n], W[ids[n, k]]>, chunked so that the gathered head rows
    ([rows, K, H]) exist one chunk at a time, in the forward and again in the backward (W is frozen)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, chunk_rows: int):
        out = torch.empty(ids.shape, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        for s in range(0, ids.shape[0], chunk_rows):  # out [N, K]: fp32 (fp64 for fp64 inputs)
            w = weight[ids[s : s + chunk_rows]]  # [c, K, H]
            out[s : s + chunk_rows] = torch.einsum("ch,ckh->ck", hidden[s : s + chunk_rows].to(w.dtype), w)
        ctx.save_for_backward(ids)
        ctx.weight, ctx.chunk_rows, ctx.hidden_dtype = weight, chunk_rows, hidden.dtype
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        (ids,) = ctx.saved_tensors
        grad = torch.empty(ids.shape[0], ctx.weight.shape[1], dtype=ctx.hidden_dtype, device=g.device)  # [N, H]
        for s in range(0, ids.shape[0], ctx.chunk_rows):
            w = ctx.weight[ids[s : s + ctx.chunk_rows]]  # [c, K, H]
            grad[s : s + ctx.chunk_rows] = torch.einsum("ck,ckh->ch", g[s : s + ctx.chunk_rows].to(w.dtype), w)
        return grad, None, None, None


def selector_ce(selector, hidden: Tensor, lm_head_weight: Tensor, candidates: Tensor, labels: Tensor,
                weights: Tensor, predecessors: Tensor, *, multiplier: float = 1.0, softcap: Optional[float] = None,
                chunk_rows: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
    """DFlash 2's selector objective (SpecForge PR #772, speculators PR #1006), over supervised rows only:

        sum_i w_i * CE_K(edge scores of row i's candidates, the gold token's index)

    hidden [N, H] (final-normed drafter output), candidates [N, K] (the unary top-K from
    `chunked_weighted_ce_topk`), labels [N] (IGNORE_INDEX: no loss), weights [N] (the gamma weights),
    predecessors [N] (the true token before each row's: teacher forcing, the walk's state when every earlier
    slot was accepted). When the gold token is not among the K, it replaces the last (lowest) candidate, for
    the loss only. Unary scores are multiplier * logits (softcapped if set), differentiable into hidden; the
    edge scores come from `selector.score` (CandidateSelector). Returns (sum, correct [N] bool: the selector
    picks the gold token AND it was a real candidate, i.e. serving would have drafted it; covered [N] bool).
    """
    live = (labels != IGNORE_INDEX) & (weights != 0)
    rows = torch.nonzero(live, as_tuple=False).flatten()  # [R] (R may be 0: the selector stays in the graph)
    h, y, w = hidden.index_select(0, rows), labels.index_select(0, rows).long(), weights.index_select(0, rows)
    cand = candidates.index_select(0, rows)  # [R, K]
    covered = (cand == y[:, None]).any(-1)  # [R]
    cand = torch.cat([cand[:, :-1], torch.where(covered, cand[:, -1], y)[:, None]], dim=1)  # gold inserted
    gold = (cand == y[:, None]).long().argmax(-1)  # [R] its index
    unary = _GatheredLogits.apply(h * multiplier if multiplier != 1.0 else h, lm_head_weight, cand,
                                  max(1, chunk_rows // cand.shape[1]))  # [R, K] fp32
    if softcap:
        unary = torch.tanh(unary / softcap) * softcap
    scores = selector.score(cand, unary, h, predecessors.index_select(0, rows))  # [R, K] fp32
    ce = torch.nn.functional.cross_entropy(scores, gold, reduction="none")  # [R]
    correct = torch.zeros(labels.shape[0], dtype=torch.bool, device=labels.device)
    correct[rows] = (scores.detach().argmax(-1) == gold) & covered
    covered_all = torch.zeros_like(correct)
    covered_all[rows] = covered
    return (ce * w.to(ce.dtype)).sum(), correct, covered_all


def normalised_loss(loss_sum: Tensor, weight_sum_global: Tensor, world_size: int = 1, eps: float = 1e-6) -> Tensor:
    """The loss each rank calls backward on: loss_sum / W_global * world_size (what the training step returns).

    The DFlash loss is normalised by the sum of loss weights over ALL tokens of the global batch, not per rank:
    ranks hold different numbers of supervised tokens, and a per-rank mean would give a rank with 10 tokens the
    same say as one with 10,000. weight_sum_global is the SUM of the ranks' weight sums (all-reduced by the
    caller); it is not differentiated through. DDP then AVERAGES gradients over ranks (divides their sum by
    world_size), so returning loss_sum_rank / W_global * world_size makes the averaged gradient exactly the
    gradient of sum_over_ranks(loss_sum) / W_global. Under gradient accumulation the caller passes the whole
    window's global weight sum instead (the loader's batch["window_weight"], summed over ranks) and multiplies
    by accumulate_grad_batches to undo Lightning's division, so the optimizer step sees the gradient of
    sum_over_window_and_ranks(loss_sum) / W_window (stages/train_task.py: training_step).
    """
    return loss_sum / weight_sum_global.detach().to(torch.float32).clamp_min(eps) * world_size
