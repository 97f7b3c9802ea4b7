"""Speculative decoding with a DFlash drafter on a transformers target, and the plain greedy baseline.

Contract (used by `dflash eval --online` and the tests):
- Both decoders run the same target through the same `TargetRunner`, with the same cache policy:
  "kv" (a transformers DynamicCache through pipeline/target_cache.py: rejected draft tokens' keys and values
  are cropped; on a hybrid target the linear-attention conv and recurrent states are restored from a snapshot
  and advanced over the accepted tokens only) or "recompute" (no cache: every forward reruns the whole
  sequence). "auto" picks "kv" when the cache can be rolled back (dense and Qwen3.5-style hybrid targets),
  else "recompute" (e.g. sliding-window KV layers); an explicit "kv" that cannot roll back is refused with
  the reason. The result says which policy ran (`cache`) and how it rolled back (`TargetRunner.describe`).
- Greedy: prefill -> argmax -> one target forward per new token; stops after a stop token or max_new_tokens.
- Speculative: prefill -> first token. Each step: the drafter proposes bs-1 tokens after the last verified
  token `last` (at position p) from the target features of the verified positions < p (layers layer_ids,
  captured by hooks on the same forwards that verify, exactly as extraction captures them, rounded through
  the store's feature encoding so the drafter sees what it was trained on). The target verifies
  [last, d1..d_{bs-1}] in ONE forward; the longest prefix of drafts equal to the target's argmax is
  accepted plus the target's own next token (the bonus; pipeline/acceptance.py `greedy_accept`, the rule the
  export's spec_generate runs too); the cache is cropped back to the verified tokens.
  Output is truncated after a stop token or at max_new_tokens exactly like greedy.
- Greedy speculative decoding is lossless: `speculative_decode(...).tokens == greedy_decode(...).tokens`.
  The evaluation counts any difference as a bug.
- Sampling (`sampling=Sampling(temperature > 0, top_p, seed)`, stages/sampling.py): the baseline samples each
  token from the target's p; the speculative decoder draws each draft token from the drafter's q (same
  temperature/top-p; DFlash 2's selector stays deterministic, q one-hot) and verifies with the rejection rule
  (pipeline/acceptance.py `verify`, shipped with the export for its spec_generate): lossless in
  distribution, not token for token. Temperature 0 (or sampling=None) is the greedy path above, unchanged.
- `draft_fn(context [p, L*H], p, last_id) -> list[int]` is pluggable (its `reset()`, if any, is called at the
  start of each sequence); `dflash_draft_fn` is the DFlash drafter (`pipeline.drafter.draft_hidden`, as
  `draft_blocks` runs it, with the projected context cached across steps; a DFlash 2 drafter picks its
  tokens with its selector walk: the drafter's `pick`), tests plug in oracles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from pipeline.acceptance import accept_step, draw, target_token
from pipeline.drafter import draft_hidden, draft_tokens
from pipeline.encoding import decode, encode
from pipeline.target import FeatureCapture
from stages.sampling import Sampling

DraftFn = Callable[[Tensor, int, int], list]


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    forwards: int  # target forwards, prefill included
    seconds: float
    steps: list[int] = field(default_factory=list)  # speculative: tokens produced per verify step
    cache: str = "kv"


class TargetRunner:
    """One sequence through the target: extend it by some tokens, read their logits/features, roll back."""

    def __init__(self, model: nn.Module, cache: str = "auto"):
        from pipeline.target_cache import RollbackCache

        if cache not in ("auto", "kv", "recompute"):
            raise ValueError(f"cache policy must be auto, kv or recompute, got {cache!r}")
        self.model, self.requested = model, cache
        self.device = next(model.parameters()).device
        self.kind, self.why = RollbackCache.support(model)
        if cache == "kv" and self.kind is None:
            raise ValueError(f"--cache kv: this target's cache cannot roll back rejected drafts ({self.why}); "
                             "use --cache recompute (or auto)")
        self.policy = "recompute" if cache == "recompute" or self.kind is None else "kv"
        self._cache = None
        self._seq: Optional[Tensor] = None

    def reset(self) -> None:
        if self._cache is not None:
            self._cache.close()
        self._cache, self._seq = None, None

    def describe(self) -> str:
        from pipeline.target_cache import RollbackCache

        if self.policy == "recompute":
            why = "" if self.requested == "recompute" else f" (the cache cannot roll back: {self.why})"
            return "recompute: no cache, every forward reruns the whole sequence" + why
        return RollbackCache.describe_model(self.model)

    @property
    def length(self) -> int:
        if self.policy == "kv":
            return 0 if self._cache is None else self._cache.length
        return 0 if self._seq is None else int(self._seq.shape[1])

    def extend(self, ids: list[int] | Tensor) -> Tensor:
        """Append tokens; returns their logits [T, V] (fp32). Hooks registered on the model see the forward."""
        from pipeline.target_cache import RollbackCache

        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        T = ids.shape[1]
        if self.policy == "kv":
            if self._cache is None:
                self._cache = RollbackCache(self.model)
            return self._cache.forward(ids).logits[0, -T:].float()
        self._seq = ids if self._seq is None else torch.cat([self._seq, ids], dim=1)
        out = self.model(input_ids=self._seq, use_cache=False)
        return out.logits[0, -T:].float()

    def rollback(self, keep: int) -> None:
        """Keep only the first `keep` tokens of the sequence."""
        if self.policy == "kv":
            if self._cache is not None:
                self._cache.rollback(keep)
        elif self._seq is not None:
            self._seq = self._seq[:, :keep]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _picker(runner: TargetRunner, sampling: Optional[Sampling], generator: Optional[torch.Generator]):
    """(logits [V] -> next token, the generator): argmax when greedy, else a draw from sampling.probs."""
    if sampling is None or sampling.greedy:
        return (lambda logits: target_token(logits)), None
    gen = generator if generator is not None else sampling.generator(runner.device)
    return (lambda logits: target_token(logits, sampling.probs, gen)), gen


@torch.inference_mode()
def greedy_decode(runner: TargetRunner, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                  sampling: Optional[Sampling] = None, generator: Optional[torch.Generator] = None) -> DecodeResult:
    """Plain decoding: argmax, or with a sampling temperature > 0 a draw from the target's p per token."""
    pick, _ = _picker(runner, sampling, generator)
    runner.reset()
    _sync(runner.device)
    t0 = time.perf_counter()
    out = [pick(runner.extend(prompt)[-1])]
    forwards = 1
    while out[-1] not in stop_ids and len(out) < max_new_tokens:
        out.append(pick(runner.extend([out[-1]])[-1]))
        forwards += 1
    _sync(runner.device)
    return DecodeResult(out, forwards, time.perf_counter() - t0, cache=runner.policy)


@torch.inference_mode()
def speculative_decode(runner: TargetRunner, draft_fn: DraftFn, prompt: list[int], layer_ids: list[int],
                       block_size: int, max_new_tokens: int, stop_ids: set[int],
                       feature_encoding: Optional[str] = "bf16",
                       feature_dtype: torch.dtype = torch.float32, sampling: Optional[Sampling] = None,
                       generator: Optional[torch.Generator] = None) -> DecodeResult:
    pick, gen = _picker(runner, sampling, generator)
    runner.reset()
    if hasattr(draft_fn, "reset"):
        draft_fn.reset()
    capture = FeatureCapture(runner.model, layer_ids)
    try:
        _sync(runner.device)
        t0 = time.perf_counter()

        def features(n: int) -> Tensor:  # features of the last n tokens of the latest forward, [n, L*H]
            x = capture.pop()[0, -n:]  # [n, L, H]
            if feature_encoding:
                x = decode(encode(x, feature_encoding), feature_encoding, feature_dtype)
            return x.to(feature_dtype).flatten(1)

        P = len(prompt)
        logits = runner.extend(prompt)
        ctx = [features(P)]
        out = [pick(logits[-1])]
        forwards, steps = 1, []
        while out[-1] not in stop_ids and len(out) < max_new_tokens:
            pos = P + len(out) - 1  # position of the last verified token; its features do not exist yet
            context = torch.cat(ctx) if len(ctx) > 1 else ctx[0]
            ctx = [context]
            probs = None if gen is None else sampling.probs
            if gen is not None and isinstance(draft_fn, DFlashDraftFn):  # the drafting rule draws (draft_tokens)
                draft, q = draft_fn(context, pos, out[-1], probs, gen)[: block_size - 1], draft_fn.q
            else:
                draft = [int(t) for t in draft_fn(context, pos, out[-1])][: block_size - 1]
                q = None
                if gen is not None:
                    draft, q = _sampled_draft(draft_fn, draft, sampling, gen)
            logits = runner.extend([out[-1]] + draft)  # [1 + len(draft), V]: ONE verify forward
            forwards += 1
            # greedy: the longest prefix equal to the target's argmax, then its own next token; sampling: the
            # rejection rule (accepted drafts, then a residual draw or the bonus token)
            n, nxt = accept_step(draft, q, logits, probs, gen)
            produced = []
            for t in draft[:n] + [nxt]:
                produced.append(t)
                if t in stop_ids or len(out) + len(produced) >= max_new_tokens:
                    break
            feats = features(len(draft) + 1)
            ctx.append(feats[: n + 1])  # last, d1..dn are verified tokens now
            runner.rollback(pos + n + 1)
            out += produced
            steps.append(len(produced))
        _sync(runner.device)
        return DecodeResult(out, forwards, time.perf_counter() - t0, steps, cache=runner.policy)
    finally:
        capture.remove()


def _sampled_draft(draft_fn, draft: list[int], sampling: Sampling, gen: torch.Generator) -> tuple:
    """A plugged-in draft_fn (tests' oracles; DFlashDraftFn draws through `draft_tokens` itself): (draft tokens
    drawn from its q, q [n, V]) when it exposes its logits; else its own tokens with q one-hot (None), which the
    rejection rule handles as a deterministic drafter."""
    logits = getattr(draft_fn, "logits", None)
    if logits is None or not draft:
        return draft, None
    q = sampling.probs(logits[: len(draft)])  # [n, V]
    return draw(q, gen).tolist(), q


class DFlashDraftFn:
    """The DFlash drafter as a draft_fn: block [last, MASK...] at positions p.., context = features of positions < p.

    Same math as `pipeline.drafter.draft_blocks` with one anchor at the end of the context (tested equal), but
    the projected context hidden_norm(fc(features)) is per position, so it is cached and only the verified
    tokens' new rows are projected each step (for a 27B target, re-projecting 5x5120 features of thousands
    of positions every step would cost as much as the verify forward). `reset()` starts a new sequence.
    `logits` [bs-1, V] holds the last call's logits (None for DFlash 2, whose selector is deterministic), `q`
    the distributions its sampled drafts were drawn from (None: greedy, or DFlash 2). The tokens come from
    `pipeline.drafter.draft_tokens`, the drafting rule the export's spec_generate runs too.
    """

    def __init__(self, drafter: nn.Module, embed_weight: Tensor, lm_head_weight: Tensor):
        self.drafter, self.embed, self.head = drafter, embed_weight, lm_head_weight
        self.arch = drafter.arch
        self.dtype = next(drafter.parameters()).dtype
        self.ctx: Optional[Tensor] = None  # [1, n, H]
        self.logits: Optional[Tensor] = None  # [bs-1, V] of the last call
        self.q: Optional[Tensor] = None  # [bs-1, V]: what the last sampled draft was drawn from

    def reset(self) -> None:
        self.ctx = None

    @torch.no_grad()
    def __call__(self, context: Tensor, pos: int, last_id: int, probs: Optional[Callable] = None,
                 generator: Optional[torch.Generator] = None) -> list:
        arch, bs, dev = self.arch, self.arch.block_size, context.device
        have = 0 if self.ctx is None else self.ctx.shape[1]
        if context.shape[0] != pos or pos < have:
            raise ValueError(f"draft context must hold exactly the {pos} positions before the block "
                             f"(got {context.shape[0]}; {have} already projected)")
        if pos > have:
            new = self.drafter.project_context(context[have:pos].to(self.dtype).unsqueeze(0))  # [1, n, H]
            self.ctx = new if self.ctx is None else torch.cat([self.ctx, new], dim=1)
        ids = torch.full((1, bs), arch.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = last_id
        q_pos = pos + torch.arange(bs, device=dev).view(1, bs)
        ctx_pos = torch.arange(pos, device=dev).view(1, pos)
        h = draft_hidden(self.drafter, ids, self.ctx, q_pos, ctx_pos, embed=self.embed,
                         dtype=self.dtype)[0, 1:]  # [bs-1, H]: one block after the pos context positions
        # the argmax, DFlash 2's selector walk through the top-K from the verified token, or draws from q
        draft, self.q, logits = draft_tokens(self.drafter, h, self.head, last_id, probs, generator)
        self.logits = logits if self.drafter.draws_from_logits else None
        return draft


def dflash_draft_fn(drafter: nn.Module, embed_weight: Tensor, lm_head_weight: Tensor) -> DFlashDraftFn:
    return DFlashDraftFn(drafter, embed_weight, lm_head_weight)
