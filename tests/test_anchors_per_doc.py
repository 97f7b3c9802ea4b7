"""Issue 19.3: anchors per document (train.anchor_rule = proportional, pipeline/masks.py sample_anchors)."""

from __future__ import annotations

import pytest
import torch
from test_loader import small_store  # noqa: F401 - the module-scoped store fixture

from pipeline.config import ConfigError, anchors_per_token, load_config
from pipeline.masks import sample_anchors


def _mask(S: int, labelled: int, start: int = 0) -> torch.Tensor:
    m = torch.zeros(S, dtype=torch.bool)
    m[start:start + labelled] = True
    return m


def test_counts_are_proportional_to_labelled_tokens():
    g = torch.Generator().manual_seed(0)
    for labelled, want in [(10, 2), (40, 8), (100, 20), (400, 80), (2000, 256)]:  # 0.2 per token, cap 256
        a = sample_anchors(_mask(2100, labelled, start=50), 256, g, per_token=0.2)
        assert a.numel() == want, (labelled, a.numel())
    # the fixed rule gives the short and the long sample the same count
    assert sample_anchors(_mask(2100, 100), 64, g).numel() == sample_anchors(_mask(2100, 2000), 64, g).numel() == 64


def test_at_least_one_anchor_per_sample_with_a_candidate():
    g = torch.Generator().manual_seed(1)
    for labelled in (2, 3, 4):  # 0.01 * labelled rounds to 0: still one anchor
        a = sample_anchors(_mask(64, labelled, start=20), 32, g, per_token=0.01)
        assert a.numel() == 1 and 20 <= int(a[0]) < 20 + labelled - 1
    # no candidate (a lone labelled token has no labelled successor; nothing labelled): none, as the fixed rule
    assert sample_anchors(_mask(64, 1, start=5), 32, g, per_token=0.5).numel() == 0
    assert sample_anchors(_mask(64, 0), 32, g, per_token=0.5).numel() == 0
    # never more than the candidates
    assert sample_anchors(_mask(64, 5, start=3), 32, g, per_token=1.0).tolist() == [3, 4, 5, 6]


def test_anchors_only_where_the_fixed_rule_may_put_them():
    g = torch.Generator().manual_seed(2)
    m = torch.rand(500, generator=g) > 0.4  # ragged labelled spans
    allowed = set(sample_anchors(m, 10_000).tolist())  # the fixed rule's every candidate: m[a] and m[a+1]
    assert allowed == {a for a in range(499) if m[a] and m[a + 1]}
    for _ in range(20):
        a = sample_anchors(m, 64, g, per_token=0.1)
        assert set(a.tolist()) <= allowed and a.tolist() == sorted(set(a.tolist()))
        assert a.numel() == min(64, round(0.1 * int(m.sum())))


def test_deterministic_under_seed_and_fresh_across_seeds():
    m = _mask(300, 250, start=20)
    draw = [sample_anchors(m, 128, torch.Generator().manual_seed(s), per_token=0.1).tolist() for s in (5, 5, 6)]
    assert draw[0] == draw[1] and draw[0] != draw[2]


def test_config_keys_are_validated_and_default_rate_follows_max_length(tmp_path):
    cfg = load_config(None, ["train.anchor_rule=proportional", "train.num_anchors=32", "data.max_length=256"])
    assert anchors_per_token(cfg) == pytest.approx(0.125)
    assert anchors_per_token(load_config(None, [])) is None  # default rule: fixed
    cfg = load_config(None, ["train.anchor_rule=proportional", "train.anchors_per_token=0.3"])
    assert anchors_per_token(cfg) == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="anchor_rule.*not one of fixed, proportional"):
        load_config(None, ["train.anchor_rule=per_doc"])
    with pytest.raises(ConfigError, match=r"anchors_per_token must be in \(0, 1\]"):
        load_config(None, ["train.anchor_rule=proportional", "train.anchors_per_token=0"])
    with pytest.raises(ConfigError, match="only used with train.anchor_rule=proportional"):
        load_config(None, ["train.anchors_per_token=0.2"])


def test_training_loader_uses_the_rule(small_store):  # noqa: F811
    from pipeline.store_reader import StoreReader
    from stages.train import _dataloaders

    path, lengths = small_store
    cfg = load_config(None, ["train.anchor_rule=proportional", "train.anchors_per_token=0.1",
                             "train.num_anchors=64", "train.num_workers=0", "train.batch_size=2"])
    reader = StoreReader(path)
    train_dl, _, _ = _dataloaders(cfg, path, reader, 0, 1, 1)
    ds = train_dl.dataset  # the sampler hands it SampleRefs
    for ref, n in zip(reader.samples, lengths):
        labelled = n - 10  # the fixture's prompt is 10 unlabelled tokens
        assert ds[(ref, 0)]["anchors"].numel() == min(64, max(1, round(0.1 * labelled)))
