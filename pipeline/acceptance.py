"""Acceptance: what one verify step keeps, and how acceptance is counted. The one place for training and
validation (per-slot counts, tau), the offline and online eval (lengths, histograms, tau), speculation
(stages/speculate.py) and the export's `spec_generate` (pipeline/modeling_dflash.py). Torch only, plus the
sibling masks.py: this file is copied beside the exported modeling file, so spec_generate runs these rules
without dflash installed; it must not import the rest of the project or transformers.

One verify step: the drafter proposed x_1..x_n after the last verified token `last`; the target ran
[last, x_1..x_n] in ONE forward, so its output i (i = 0..n) is its choice after [..., last, x_1..x_i].

The rules:
- `greedy_accept(draft, target_logits [n + 1, V])` -> (n accepted, the next token): the longest prefix of drafts
  equal to the target's argmax, then the target's own token after it (the bonus). Lossless token for token.
- `sampling_probs(logits, temperature, top_p, top_k)`: the distribution plain sampling draws from: logits /
  temperature, the top_k best kept (0: all), softmax, then the top-p nucleus (the smallest set of most likely
  tokens whose mass reaches top_p, the first token always kept), renormalised. `draw(p, generator)` samples it.
- `target_token` (the target's own token: argmax or a draw) and `accept_step` (greedy_accept or verify) are the
  two rules a decoder applies per step; the drafter's side is pipeline/drafter.py `draft_tokens`.
- `verify(draft, q, p, generator)`: the speculative-sampling rejection rule. draft = x_1..x_n, q [n, V] the
  distributions they were drawn from (None: a deterministic drafter, q = one-hot on x_i, e.g. DFlash 2's
  selector walk), p [n + 1, V] the target's distributions after [..., last, x_1..x_{i-1}]. Slot i accepts x_i
  with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection it emits a token drawn from
  norm(max(0, p_i - q_i)) and stops; when all n are accepted it emits a bonus token drawn from p_{n+1}.
  Returns (accepted n, the emitted token). Every emitted token is then distributed exactly as if sampled from p
  (Leviathan et al. 2023, Chen et al. 2023), whatever q is: lossless in distribution, not token for token
  (tests/test_sampling_eval.py checks the distribution statistically). The n uniforms are drawn at once from
  `generator` (None: torch's default generator of p's device).

The counts (a block's or a verify step's acceptance length = accepted drafts + 1, the target's own token):
- `acceptance_lengths(draft, labels, valid)` [A, bs-1] -> [A]: 1 + the leading slots whose draft equals the label
  (the offline eval's blocks; stops at the first mismatch or unlabelled slot).
- `histogram(lengths, block_size)` -> {"1": n_1, ..., str(block_size): n_bs}; `mean_length(lengths)`: tau, the
  mean acceptance length (tokens per block, or per verify step online).
- `slot_counts(correct, labels, block_size)` -> per-slot (hits, supervised) over slots 1..bs-1;
  `slot_accuracy(hits, supervised)`; `acceptance_length(slot_acc)`: tau = 1 + sum_k prod_{i<=k} acc_i, the tau
  implied by per-slot accuracies (training's train/tau and val/tau, eval's tau_from_slot_acc).
- `AcceptanceStats`: the offline eval's accumulator (histogram, per-slot hits, its summary).
- `checkpoint_val_tau(val, step)`: a checkpoint's own val tau (`VAL_TAU` of its latest validation, only when
  that validation ran at the checkpoint's step).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .masks import IGNORE_INDEX

VAL_TAU = "val/tau"  # the metric training logs and the best checkpoint is chosen by


# ----------------------------------------------------------------------------------------------------------
# the rules of one verify step
# ----------------------------------------------------------------------------------------------------------


def greedy_accept(draft: list[int], target_logits: Tensor) -> tuple[int, int]:
    """draft [n] token ids, target_logits [n + 1, V] -> (accepted drafts n', the target's token after them)."""
    greedy = target_logits.argmax(-1).tolist()  # greedy[i]: the target's token after [..., last, x_1..x_i]
    n = 0
    while n < len(draft) and draft[n] == greedy[n]:
        n += 1
    return n, greedy[n]


def target_token(logits: Tensor, probs=None, generator: Optional[torch.Generator] = None) -> int:
    """The target's own next token from its logits [V]: the argmax (probs None: greedy), else one draw from
    probs(logits) (a sampling distribution, e.g. `sampling_probs` with the decoder's settings). The online
    eval's first token and plain decoding (stages/speculate.py), and the export's spec_generate's first token."""
    if probs is None:
        return int(logits.argmax())
    return int(draw(probs(logits), generator))


def accept_step(draft: list[int], q: Optional[Tensor], target_logits: Tensor, probs=None,
                generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """THE rule of one verify step, for the online eval (stages/speculate.py) and the export's spec_generate
    alike: greedy (probs None) `greedy_accept`; sampling `verify(draft, q, probs(target_logits), generator)`,
    q the distributions the drafts were drawn from (None: a deterministic drafter, pipeline/drafter.py
    `draft_tokens`). target_logits [n + 1, V] (fp32) -> (accepted drafts n, the token emitted after them)."""
    if probs is None:
        return greedy_accept(draft, target_logits)
    return verify(draft, q, probs(target_logits), generator)


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """logits [..., V] -> sampling distribution [..., V] in the logits' dtype (the eval passes fp32): temperature,
    then top-k, then top-p."""
    scores = logits / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # keeps the first token: before = 0
    p = torch.zeros_like(p).scatter_(-1, order, sorted_p)
    return p / p.sum(-1, keepdim=True)


def draw(p: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """One token per row of p [..., V] -> LongTensor [...]."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def verify(draft: list[int], q: Optional[Tensor], p: Tensor,
           generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """The rejection rule of the module docstring: (accepted drafts n, the token emitted after them)."""
    n = len(draft)
    if n == 0:
        return 0, int(draw(p[0], generator))
    x = torch.as_tensor(draft, dtype=torch.long, device=p.device)  # [n]
    p_x = p[:n].gather(1, x[:, None])[:, 0]  # [n] p_i(x_i)
    if q is None:  # a deterministic drafter: q_i is one-hot on x_i
        q = torch.zeros_like(p[:n]).scatter_(1, x[:, None], 1.0)
    q = q[:n].to(p.dtype)
    q_x = q.gather(1, x[:, None])[:, 0]  # [n] q_i(x_i) (> 0: x_i was drawn from q_i)
    u = torch.rand(n, generator=generator, device=p.device)
    rejected = (u * q_x >= p_x).nonzero()  # accept iff u < p/q, i.e. u * q < p
    if rejected.numel() == 0:
        return n, int(draw(p[n], generator))  # all accepted: the bonus token from the target
    i = int(rejected[0, 0])
    residual = (p[i] - q[i]).clamp(min=0.0)
    total = residual.sum()
    if total <= 0:  # p_i == q_i up to rounding: rejection had probability ~0; p_i is then the right draw
        residual, total = p[i], p[i].sum()
    return i, int(draw(residual / total, generator))


# ----------------------------------------------------------------------------------------------------------
# counting acceptance
# ----------------------------------------------------------------------------------------------------------


def acceptance_lengths(draft: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
    """draft/labels/valid [A, bs-1] -> acceptance lengths [A] (1 + leading valid matches)."""
    match = (draft == labels) & valid
    return 1 + torch.cumprod(match.long(), dim=1).sum(dim=1)


def histogram(lengths, block_size: int) -> dict[str, int]:
    """Acceptance lengths (a list or tensor of ints 1..block_size) -> {"1": count, ..., str(block_size): count}."""
    counts = torch.bincount(torch.as_tensor(lengths, dtype=torch.long).reshape(-1).cpu(), minlength=block_size + 1)
    return histogram_of_counts(counts[: block_size + 1])


def histogram_of_counts(hist: Tensor) -> dict[str, int]:
    """hist [bs + 1] (index = acceptance length; index 0 unused) -> the `histogram` dict."""
    return {str(k): int(hist[k]) for k in range(1, hist.shape[0])}


def mean_length(lengths) -> float:
    """tau: the mean of acceptance lengths (a list of ints; 0 when there are none)."""
    return float(sum(lengths) / max(len(lengths), 1))


@torch.no_grad()
def slot_counts(correct: Tensor, labels: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Per-slot (hits, supervised) counts over blocks: correct/labels [B, A*bs] -> two [bs-1] fp32 tensors.

    Sum them over ranks and steps, then acc_k = hits_k / supervised_k (`slot_accuracy`), and tau =
    1 + sum_k prod_{i<=k} acc_i (`acceptance_length`)."""
    lab = labels.reshape(-1, block_size)[:, 1:]  # [blocks, bs-1]
    hit = correct.reshape(-1, block_size)[:, 1:] & (lab != IGNORE_INDEX)
    return hit.float().sum(0), (lab != IGNORE_INDEX).float().sum(0)


def slot_accuracy(hits: Tensor, supervised: Tensor) -> Tensor:
    """Per-slot accuracy hits / supervised (a slot never supervised: 0), in the counts' dtype."""
    return hits / supervised.clamp(min=1)


def acceptance_length(slot_acc) -> float:
    """tau = 1 + sum_k prod_{i<=k} acc_i (expected accepted drafts per block plus the target's own token), from
    the per-slot accuracies acc [bs-1] (slots 1..bs-1; a tensor, array or list; clamped to [0, 1]). The one tau
    from slot accuracies: training's train/tau and val/tau and eval's tau_from_slot_acc."""
    acc = torch.as_tensor(slot_acc, dtype=torch.float64).clamp(0, 1)
    return float(1.0 + torch.cumprod(acc, 0).sum())


class AcceptanceStats:
    """Accumulates acceptance lengths and per-slot hits over drafted blocks of size bs (the offline eval)."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.hist = torch.zeros(block_size + 1, dtype=torch.long)  # index = acceptance length (1..bs)
        self.hits = torch.zeros(block_size, dtype=torch.long)  # index k = slot k (1..bs-1)
        self.counts = torch.zeros(block_size, dtype=torch.long)

    def add(self, draft: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
        """draft/labels/valid [A, bs-1] -> acceptance lengths [A] (1 + leading valid matches)."""
        acc_len = acceptance_lengths(draft, labels, valid)
        self.hist += torch.bincount(acc_len.cpu(), minlength=self.bs + 1)[: self.bs + 1]
        self.hits[1:] += ((draft == labels) & valid).sum(0).cpu()
        self.counts[1:] += valid.sum(0).cpu()
        return acc_len

    def summary(self) -> dict:
        n = int(self.hist.sum())
        acc = slot_accuracy(self.hits[1:].double(), self.counts[1:].double())  # slots 1..bs-1, fp64
        return {
            "blocks": n,
            "tau": float(int((self.hist * torch.arange(self.bs + 1)).sum()) / max(n, 1)),
            "tau_from_slot_acc": acceptance_length(acc),
            "slot_accuracy": [round(float(a), 6) for a in acc],  # slots 1..bs-1
            "slot_labelled": [int(c) for c in self.counts[1:]],
            "acceptance_histogram": histogram_of_counts(self.hist),
        }


def checkpoint_val_tau(val: Optional[dict], step) -> Optional[float]:
    """A checkpoint's own val tau: its latest validation's `VAL_TAU` when that validation ran at `step` (the
    checkpoint's), else None (no validation yet, or an older one)."""
    val = val or {}
    tau, at = val.get(VAL_TAU), val.get("step")
    if tau is None or at is None or step is None or int(at) != int(step):
        return None
    return float(tau)
