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


def test_layers_compile_without_mix_order_reduction_and_nothing_else_changes(monkeypatch):
    """Issue 28.1: the drafter's layers (only they) are compiled with Inductor's mix-order reduction off where
    this torch has it; an explicit options= replaces the default; the process-wide Inductor config is untouched."""
    import torch
    import torch._inductor.config as inductor_config

    from pipeline.compile_setup import layer_compile_options
    from pipeline.drafter import DFlashDrafter, DrafterArch

    has = hasattr(inductor_config.triton, "mix_order_reduction")
    assert layer_compile_options() == ({"triton.mix_order_reduction": False} if has else {})
    before = inductor_config.triton.mix_order_reduction if has else None
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    arch = DrafterArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, target_layer_ids=[1],
                       layer_types=["sliding_attention", "full_attention"], sliding_window=16, block_size=4)
    d = DFlashDrafter(arch)
    d.compile_layers()
    assert seen == [{"options": layer_compile_options() or None}] * 2
    seen.clear()
    d.compile_layers(options={"max_autotune": False})
    assert seen == [{"options": {"max_autotune": False}}] * 2
    if has:
        assert inductor_config.triton.mix_order_reduction == before


def test_train_compile_auto_compiles_on_cuda_only():
    """train.compile: on compiles on any device, auto on CUDA alone, off never (the device type comes from
    torch.device, as Lightning places the rank; stages/train.py passes "cuda" for --gpus runs)."""
    from types import SimpleNamespace

    from stages.train_task import DrafterTask

    def compiles(mode, device_type):
        return DrafterTask.compiles(SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(compile=mode))),
                                    device_type)

    assert [compiles("on", d) for d in ("cuda", "cpu")] == [True, True]
    assert [compiles("auto", d) for d in ("cuda", "cpu", "gpu")] == [True, False, False]
    assert [compiles("off", d) for d in ("cuda", "cpu")] == [False, False]
