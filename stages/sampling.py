"""Sampling for the online eval at temperature > 0: the target's sampling distribution and the lossless
speculative-sampling rejection rule, as serving engines verify drafts.

Contract:
- `Sampling(temperature, top_p, seed)`: temperature 0 means greedy, and then nothing here is used (the
  decoders in stages/speculate.py take their exact greedy path). `probs(logits)` is softmax(logits / T)
  restricted to the top-p nucleus (the smallest set of most likely tokens whose mass reaches top_p, the first
  token always kept) and renormalised: the distribution p that plain sampling draws from.
- `verify(draft, q, p, generator)`: draft = the drafter's tokens x_1..x_n, q [n, V] the distributions they
  were drawn from (None: a deterministic drafter, q = one-hot on x_i, e.g. DFlash 2's selector walk), p
  [n + 1, V] the target's distributions after [..., last, x_1..x_{i-1}]. Slot i accepts x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection it emits a token drawn from norm(max(0, p_i - q_i))
  and stops; when all n are accepted it emits a bonus token drawn from p_{n+1}. Returns (accepted n, the
  emitted token). Every emitted token is then distributed exactly as if sampled from p (Leviathan et al.
  2023, Chen et al. 2023), whatever q is: the rule is lossless in distribution, not token for token
  (tests/test_sampling_eval.py checks the distribution statistically).
- All draws use one torch.Generator on the target's device, seeded per prompt: a run repeats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def generator(self, device: torch.device, offset: int = 0) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + offset)

    def probs(self, logits: Tensor) -> Tensor:
        """logits [..., V] -> sampling distribution [..., V] (fp32): temperature, then top-p."""
        p = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p >= 1.0:
            return p
        sorted_p, order = p.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= self.top_p, 0.0)  # keeps the first token: before = 0
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p)
        return p / p.sum(-1, keepdim=True)


def draw(p: Tensor, generator: torch.Generator) -> Tensor:
    """One token per row of p [..., V] -> LongTensor [...]."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def verify(draft: list[int], q: Optional[Tensor], p: Tensor, generator: torch.Generator) -> tuple[int, int]:
    """The rejection rule of the module contract: (accepted drafts n, the token emitted after them)."""
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
