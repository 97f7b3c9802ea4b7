"""Which kernels a hybrid (linear-attention) target runs on, said before the heavy work; their autotuning cached.

transformers' Qwen3.5/3.6 modeling picks its Gated-DeltaNet kernels when the module is imported: flash-linear-
attention's Triton `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` (package `fla`) and the
`causal_conv1d` CUDA kernels when importable, else its torch reference paths, silently (a one-time logger
warning). Measured on one H200 at the 27B shape (layers 0..61, 8 x 2048 tokens, bf16): 6,413 tokens/s on the
torch paths against 9,291 with flash-linear-attention 0.6 (docs/benchmarks.md).

Contract:
- `kernel_report(layer_types, device_type, fast_forward)` -> one line naming what the target will use, or None for
  a target without linear-attention layers (fast_forward: the stage's switch, `extract.fast_forward` or
  `eval.fast_forward`; the fast forward's conv is fla's). It only looks for the packages (no import, no CUDA context: the extract
  parent must not touch the GPUs). On the torch fallback it gives the measured slowdown and the install command.
- `resolved_kernels()` -> {op: "module.function"} as transformers actually bound them (after the model's
  modeling module is imported); the worker logs it.
- `use_kernel_cache()` points Triton's cache (compiled kernels and autotuning results, TRITON_CACHE_AUTOTUNING=1)
  at a directory kept across runs, like the compile cache: only the first batch of the first run on a machine
  pays the autotuning (58 s at the 27B shape); later batches and resumed runs read it. Call it before the
  kernels are imported (Triton reads the switch when a kernel is defined). A TRITON_CACHE_DIR set by the user wins.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Optional

INSTALL = 'pip install -e ".[gpu]"'
MEASURED = "6,413 vs 9,291 tokens/s (0.69x) measured on one H200 at the 27B shape"
LINEAR_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
              "causal_conv1d_update")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def available() -> dict[str, Optional[str]]:
    """{"fla": version or None, "causal_conv1d": version or None}: importable packages, found without importing."""
    out = {}
    for mod, dists in (("fla", ("fla-core", "flash-linear-attention")), ("causal_conv1d", ("causal-conv1d",))):
        found = importlib.util.find_spec(mod) is not None
        out[mod] = next((v for v in map(_version, dists) if v), "unknown version") if found else None
    return out


def kernel_report(layer_types: Optional[list], device_type: str, fast_forward: bool = False) -> Optional[str]:
    from pipeline.targets import linear_layer_count

    n_linear = linear_layer_count(layer_types)
    if not n_linear:
        return None
    head = f"target kernels ({n_linear} linear-attention layers): "
    if device_type != "cuda":
        return head + "CPU: transformers' torch reference paths (the fast kernels are CUDA/Triton only)"
    have = available()
    conv = (f"causal_conv1d {have['causal_conv1d']}" if have["causal_conv1d"] else
            "causal conv1d on torch (causal-conv1d has no prebuilt wheel; a few % of the forward)")
    if fast_forward and have["fla"]:  # pipeline/fast_forward.py binds fla's own causal_conv1d
        conv = "causal conv1d on flash-linear-attention's Triton kernel (dflash's fast forward)"
    if have["fla"]:
        return head + f"Gated DeltaNet on flash-linear-attention {have['fla']} (Triton), {conv}; autotuning cached " \
                      f"in {kernel_cache_dir()}"
    return (head + f"WARNING: Gated DeltaNet on transformers' torch fallback, {MEASURED} against "
            f"flash-linear-attention; install the kernels: {INSTALL}, {conv}")


_WRAPPERS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
             "fused_recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
             "causal_conv1d_fn": "causal_conv1d_fn", "causal_conv1d_update": "causal_conv1d_update"}


def resolved_kernels(module_name: Optional[str] = None) -> dict[str, str]:
    """{op: "module.function"} that transformers' modeling module (default: the hybrid family's,
    pipeline/targets/qwen3_5.py) bound each linear-attention op to ("unknown" where its wrapper does not say).
    Imports the module."""
    import importlib

    from pipeline.targets import linear_families

    module_name = module_name or linear_families()[0].modeling_module
    mod = importlib.import_module(module_name)
    out = {}
    for op, attr in _WRAPPERS.items():
        fn = getattr(mod, attr, None)
        impl = _bound_implementation(fn) if fn is not None else None
        out[op] = f"{impl.__module__}.{impl.__name__}" if impl is not None else "unknown"
    return out


def _bound_implementation(fn):
    """The callable a transformers `use_kernel_func_from_hub_with_fallback` wrapper calls: its closure's
    `implementation` (the package's kernel, or the torch function it falls back to). With the `kernels` package
    installed (a dependency of transformers >= 5.25) the wrapper is itself wrapped in a `Func` module whose
    forward's closure holds it as `func`."""
    for _ in range(6):
        if getattr(fn, "__code__", None) is None and callable(getattr(type(fn), "forward", None)):
            fn = type(fn).forward  # kernels' Func(nn.Module): forward(self, ...) calls the closure's `func`
        code = getattr(fn, "__code__", None)
        cells = dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}
        if "implementation" in cells:
            return cells["implementation"].cell_contents
        fn = cells["func"].cell_contents if "func" in cells else getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def kernel_cache_dir() -> Path:
    """$TRITON_CACHE_DIR if the user set one, else compile_cache_root()/../kernels/KEY (KEY: torch, triton and
    fla versions), shared by every run on the machine."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    import hashlib

    from pipeline.preflight import compile_cache_root

    parts = "|".join(f"{d}={_version(d)}" for d in ("torch", "triton", "fla-core", "flash-linear-attention"))
    return compile_cache_root().parent / "kernels" / hashlib.sha256(parts.encode()).hexdigest()[:16]


def use_kernel_cache() -> Path:
    """Persist Triton's compiled kernels and autotuning results (see the module contract); returns the directory."""
    d = kernel_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(d)
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"  # every autotuned kernel writes its choice to the cache
    os.environ.setdefault("FLA_CACHE_RESULTS", "1")  # fla 0.6 passes cache_results=FLA_CACHE_RESULTS (default 1)
    return d
