"""Process-wide torch.compile settings that `dflash train` and the benchmarks apply before compiling anything.

Contract: `prepare_compile(limit)` is idempotent and changes no model math.
- Recompiles are logged, and reaching the recompile limit is an error instead of a silent fall-back to
  eager (`loud_recompiles`).
- `inductor_workarounds()` works around Inductor bugs of the torch versions we run, each one found by
  feature detection rather than by version number, so a torch that has no such bug is left alone:
  * "no x dim" persistent reductions (torch 2.11; gone by 2.13). For a persistent inner reduction of 256 or more
    elements, Inductor's Triton code generator may drop the kernel's X dimension. Then an index expression that
    still uses an X variable fails in `get_block_shape` with `TypeError: list indices must be integers or slices,
    not NoneType`. The 27B-shape training step hit this at 8K-token samples on torch 2.11; 2K compiled. Newer
    torch keeps the X dimension unless a kernel's fixed config asks otherwise; its `InductorChoices` no longer
    has `want_no_x_dim`. Where it has, we make `InductorChoices.want_no_x_dim` answer no, as newer torch
    does by default. The heuristic only chooses a kernel layout ("strangely this is faster than a [1, RBLOCK]
    block in some cases", says its docstring), so results are unchanged. Seen on the H200 (2026-12-01): torch
    2.11's choices.py has no `want_no_x_dim` either (its TritonKernel decides from a fixed config), so nothing
    is installed there; the 8K/16K failures came from elsewhere (next item; pipeline/masks.py `row_cumsum`).
- `layer_compile_options()`: the Inductor options the drafter's layers are compiled with (only there, through
  `torch.compile(options=...)`; no other compiled function changes). It turns off Inductor's "mix-order
  reduction", which fuses an RMSNorm backward's per-row reduction (the input gradient) with its per-column one
  (the weight gradient) into one persistent kernel started at XBLOCK 1, a layout without X dimension, once the
  rows reach 4,096 and twice the columns. torch 2.11's `get_block_shape` has no case for a range tree without
  a tensor dimension (2.13 has), hence the TypeError. Evidence (H200, torch 2.11, 2026-12-01, issue 28;
  docs/benchmarks.md, long samples): with it off the 5-layer 27B step compiled and ran at 2K, 8K and 16K tokens;
  with Inductor's defaults the issue's run failed at 8K and a later 16K run failed in `get_block_shape` again
  once the table builder's scan was fixed (pipeline/masks.py `row_cumsum`); a 2-layer model compiled at 8K with
  the defaults. The kernel itself is not yet named by a dump. The fusion is a speed choice only (off, the two
  reductions run as two kernels, same results; 2K step 229.9 ms off vs 230.0 ms on). Applied where it exists.
"""

from __future__ import annotations

from typing import Optional


def loud_recompiles(limit: Optional[int] = None) -> None:
    """Make dynamo recompiles visible and hitting the recompile limit an error instead of a silent slow path."""
    import torch._dynamo
    import torch._logging

    torch._logging.set_logs(recompiles=True)
    cfg = torch._dynamo.config
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(cfg, name):
            setattr(cfg, name, True)
            break
    if limit is not None:
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, limit)
                break


def inductor_workarounds() -> list[str]:
    """Install the workarounds this torch needs (see the module contract); -> the names of those installed."""
    from torch._inductor.choices import InductorChoices

    installed = []
    if hasattr(InductorChoices, "want_no_x_dim"):
        # on the class, not through `V.set_choices_handler`: that handler is per thread, and a backward compiled
        # lazily runs in autograd's device thread; nor through `config.inductor_choices_class`, part of the
        # compiled-graph cache key
        if not getattr(InductorChoices.want_no_x_dim, "dflash_keeps_x_dim", False):
            def want_no_x_dim(features) -> bool:
                return False

            want_no_x_dim.dflash_keeps_x_dim = True
            InductorChoices.want_no_x_dim = staticmethod(want_no_x_dim)
        installed.append("keep_x_dim")
    return installed


def layer_compile_options() -> dict:
    """Inductor options for `DFlashDrafter.compile_layers` (see the module contract); {} where none apply."""
    import torch._inductor.config as inductor_config

    options = {}
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        options["triton.mix_order_reduction"] = False
    return options


def no_duck_shapes() -> bool:
    """Dims of equal size at the first compile get their own symbols (torch's "duck shaping" off): with a dynamic
    compile (issue 46 item 2) a first batch whose block length happened to equal its context length would
    otherwise tie the two (one symbol, a guard Q == S) and recompile at the next batch. Changes no math; only
    which sizes a dynamic graph may take. -> whether this torch has the switch."""
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:
        return False
    if not hasattr(fx_config, "use_duck_shape"):
        return False
    fx_config.use_duck_shape = False
    return True


def import_inductor() -> None:
    """The imports `prepare_compile` makes (Inductor's choices, and Triton under them where installed) and the
    first compile's entry, made ahead by a caller with time to spare: `dflash train` does it while the frozen
    head's check and load finish in their thread (issue 46: the compile set-up was 3.4 s of a 27B run's fit set-up
    on the H100 host; 0.7 s on the 2-core CPU, where no Triton is installed). Changes no setting."""
    import torch._inductor.choices  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


def prepare_compile(limit: Optional[int] = None, dynamic: Optional[bool] = None) -> list[str]:
    """Everything above, once per process before the first compile; -> the workarounds installed. dynamic: the
    run compiles dynamic from its first step (batches of many shapes), so duck shaping is turned off too."""
    loud_recompiles(limit)
    if dynamic:
        no_duck_shapes()
    return inductor_workarounds()
