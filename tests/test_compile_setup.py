"""pipeline/compile_setup.py: the process-wide compile settings `dflash train` applies before compiling."""

from __future__ import annotations

import torch._dynamo
import torch._logging
from torch._inductor.choices import InductorChoices

from pipeline.compile_setup import inductor_workarounds, loud_recompiles


def test_the_no_x_dim_workaround_applies_only_where_the_heuristic_exists(monkeypatch):
    """torch 2.11's Inductor drops a persistent reduction's X dimension by a heuristic on InductorChoices and
    then failed to generate the 8K-token step's kernels; newer torch has no such heuristic and is left alone."""
    had = hasattr(InductorChoices, "want_no_x_dim")
    if not had:  # this torch (the CPU wheel CI installs): nothing to work around
        assert inductor_workarounds() == []
        assert not hasattr(InductorChoices, "want_no_x_dim")
    # a torch with the heuristic (as 2.11 has it: a staticmethod taking the kernel's features)
    monkeypatch.setattr(InductorChoices, "want_no_x_dim", staticmethod(lambda features: True), raising=False)
    assert InductorChoices().want_no_x_dim(object()) is True
    assert inductor_workarounds() == ["keep_x_dim"]
    assert InductorChoices().want_no_x_dim(object()) is False  # every instance, every thread
    patched = InductorChoices.__dict__["want_no_x_dim"]
    assert inductor_workarounds() == ["keep_x_dim"]  # idempotent: the same function, not wrapped again
    assert InductorChoices.__dict__["want_no_x_dim"] is patched


def test_loud_recompiles_sets_the_limit_and_makes_hitting_it_an_error():
    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    fail = "fail_on_recompile_limit_hit" if hasattr(cfg, "fail_on_recompile_limit_hit") else "fail_on_cache_limit_hit"
    before = {limit: getattr(cfg, limit), fail: getattr(cfg, fail)}
    try:
        setattr(cfg, fail, False)
        loud_recompiles(limit=16)
        assert getattr(cfg, limit) == 16 and getattr(cfg, fail) is True
    finally:  # dynamo's config is the process's: restored for the tests after this one
        for k, v in before.items():
            setattr(cfg, k, v)
        torch._logging.set_logs()
