"""Chunked weighted CE over a frozen head == plain F.cross_entropy in value and gradient; DDP normalisation."""

import pytest
import torch
import torch.nn.functional as F

from pipeline.acceptance import acceptance_length, slot_counts
from pipeline.loss import IGNORE_INDEX, chunked_weighted_ce, normalised_loss


def reference(hidden, W, labels, weights):
    ce = F.cross_entropy(hidden @ W.t(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return (ce * weights).sum()


@pytest.mark.parametrize("chunk_rows", [1, 5, 8, 1000])
def test_chunked_equals_reference_value_and_grad(chunk_rows):
    g = torch.Generator().manual_seed(0)
    N, Hd, V = 37, 12, 50
    hidden = torch.randn(N, Hd, generator=g, dtype=torch.float64)
    W = torch.randn(V, Hd, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = IGNORE_INDEX
    weights = torch.rand(N, generator=g, dtype=torch.float64)
    weights[labels == IGNORE_INDEX] = 0
    weights[3] = 0.0  # a labelled row with zero weight contributes nothing

    h1 = hidden.clone().requires_grad_(True)
    loss, correct = chunked_weighted_ce(h1, W, labels, weights, chunk_rows=chunk_rows)
    (2.5 * loss).backward()
    h2 = hidden.clone().requires_grad_(True)
    ref = reference(h2, W, labels, weights)
    (2.5 * ref).backward()
    assert torch.allclose(loss, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    live = (labels != IGNORE_INDEX) & (weights != 0)
    assert torch.equal(correct, ((hidden @ W.t()).argmax(-1) == labels) & live)


def test_batched_shape_and_no_grad_path():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    W = torch.randn(20, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 20, (2, 6), generator=g)
    weights = torch.ones(2, 6, dtype=torch.float64)
    loss, correct = chunked_weighted_ce(hidden, W, labels, weights, chunk_rows=5)
    assert correct.shape == (2, 6)
    assert torch.allclose(loss, reference(hidden.view(-1, 8), W, labels.view(-1), weights.view(-1)))


def test_frozen_head_required():
    with pytest.raises(ValueError, match="frozen"):
        chunked_weighted_ce(torch.randn(3, 4), torch.randn(5, 4, requires_grad=True), torch.zeros(3).long(),
                            torch.ones(3))


def test_normalised_loss_uses_global_weight_sum():
    """Two ranks with 3 and 1 units of loss weight: averaging their gradients (what DDP does) must give the
    gradient of the global weighted mean, sum(loss_sum) / W_global, not the mean of the two per-rank means."""
    theta = torch.tensor(2.0, requires_grad=True)
    sums = [lambda: 3.0 * theta**2, lambda: 1.0 * theta]  # each rank's weighted loss sum
    weights = [torch.tensor(3.0), torch.tensor(1.0)]
    w_global = weights[0] + weights[1]  # what the step's all-reduce gives
    grad = lambda loss: torch.autograd.grad(loss, theta)[0]  # noqa: E731
    ddp = (grad(normalised_loss(sums[0](), w_global, world_size=2))
           + grad(normalised_loss(sums[1](), w_global, world_size=2))) / 2
    torch.testing.assert_close(ddp, grad((sums[0]() + sums[1]()) / w_global))
    per_rank_mean = (grad(sums[0]() / weights[0]) + grad(sums[1]() / weights[1])) / 2
    assert not torch.isclose(ddp, per_rank_mean)  # the mistake this guards against differs here
    assert torch.isclose(normalised_loss(torch.tensor(6.0), torch.tensor(3.0)), torch.tensor(2.0))


def test_slot_counts_and_tau():
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, 7, IGNORE_INDEX, 1, IGNORE_INDEX, IGNORE_INDEX]])
    correct = torch.tensor([[False, True, False, True, False, True, False, False]])
    hits, total = slot_counts(correct, labels, 4)
    assert hits.tolist() == [2.0, 0.0, 1.0] and total.tolist() == [2.0, 1.0, 1.0]
    assert acceptance_length(torch.tensor([1.0, 0.5, 0.5])) == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert acceptance_length([1.2, -0.1, 0.5]) == pytest.approx(2.0)  # clamped to [0, 1]
