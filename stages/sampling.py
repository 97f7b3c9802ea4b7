"""Sampling for the online eval at temperature > 0: the target's sampling distribution and the seeded
generators; the lossless speculative-sampling rejection rule that verifies drafts is pipeline/acceptance.py's
`verify` (shipped with the export, whose spec_generate runs the same rule), re-exported here with `draw`.

Contract:
- `Sampling(temperature, top_p, seed)`: temperature 0 means greedy, and then nothing here is used (the
  decoders in stages/speculate.py take their exact greedy path). `probs(logits)` is softmax(logits / T)
  restricted to the top-p nucleus (the smallest set of most likely tokens whose mass reaches top_p, the first
  token always kept) and renormalised: the distribution p that plain sampling draws from
  (pipeline.acceptance.sampling_probs, without top-k).
- `verify(draft, q, p, generator)`: draft = the drafter's tokens x_1..x_n, q [n, V] the distributions they
  were drawn from (None: a deterministic drafter, q = one-hot on x_i), p [n + 1, V] the target's; returns
  (accepted n, the emitted token): every emitted token is distributed exactly as if sampled from p (see
  pipeline/acceptance.py; tests/test_sampling_eval.py checks the distribution statistically).
- All draws use one torch.Generator on the target's device, seeded per prompt: a run repeats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.acceptance import draw, sampling_probs, verify  # noqa: F401 - draw, verify re-exported (tests)


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
        return sampling_probs(logits.float(), self.temperature, self.top_p)
