"""A transformers cache for one sequence that can forget its last tokens, on dense and hybrid targets alike.

Speculative decoding verifies a block of drafted tokens in one target forward and then keeps only the accepted
prefix. Full-attention layers drop the rejected tokens' keys and values (`crop`). A linear-attention layer
(Qwen3.5/3.6's Gated DeltaNet) keeps a conv state and a recurrent state that already absorbed every token of
the block and cannot be cut back (transformers' `crop` refuses, or with past recording rolls back the conv
state only). So before each forward that may be rolled back, `RollbackCache` copies every linear layer's conv
and recurrent states and keeps the inputs its linear-attention modules saw; a rollback restores the copies and
runs only those modules (not the MLPs or attention layers) over the kept tokens' inputs, which are the same
inputs as in the verify forward because the model is causal. The states then equal those of a forward over
exactly the kept tokens (tested against that on the tiny hybrid).

Contract:
- `RollbackCache.support(model)` -> (kind, reason): "dense" (every layer a plain KV layer), "hybrid" (KV layers
  plus linear-attention layers this class can roll back) or None (e.g. sliding-window KV layers) with why.
- `forward(ids, **kw)` runs the model on new tokens with the cache; `rollback(keep)` keeps the first `keep`
  tokens. On a hybrid cache it can only drop tokens of the latest forward (speculative decoding never needs
  more); the prefill (first forward) is not snapshotted.
- `describe()` says which rollback ran, for reports. `close()` removes the hooks.
Works with transformers 5.x's layered caches (`cache.layers[i]` with `conv_states` / `recurrent_states`); this
file is torch + transformers only because exported drafters ship a copy of it.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn


def _cache_kwarg(fn) -> str:
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else ("cache_params" if "cache_params" in params else "past_key_values")


def _new_cache(model: nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _is_linear(layer) -> bool:
    return isinstance(getattr(layer, "conv_states", None), dict) and isinstance(getattr(layer, "recurrent_states", None), dict)


def _is_kv(layer) -> bool:
    return type(layer).__name__ == "DynamicLayer"


def _token_count(layer) -> Optional[torch.Tensor]:
    """A copy of the tokens a linear-attention cache layer has seen (transformers >= 5.25 counts them, and the
    cache's length is layer 0's count when layer 0 is a linear one); None where the layer keeps no count."""
    count = getattr(layer, "cumulative_length_linear", None)
    return count.clone() if isinstance(count, torch.Tensor) else None


def _linear_modules(model: nn.Module) -> dict[int, nn.Module]:
    """layer index -> the linear-attention (token mixer) module of that decoder layer."""
    out = {}
    for mod in model.modules():
        inner = getattr(mod, "linear_attn", None)
        if isinstance(inner, nn.Module) and hasattr(inner, "layer_idx"):
            out[int(inner.layer_idx)] = inner
    return out


class RollbackCache:
    def __init__(self, model: nn.Module):
        self.model = model
        self.kw = _cache_kwarg(model.forward)
        self.cache = _new_cache(model)
        self.linear = _linear_modules(model)
        self._inputs: dict[int, torch.Tensor] = {}
        self._snapshot: Optional[dict] = None
        self._last_len = 0  # tokens in the latest forward
        self._recording = False
        self._hooks = [m.register_forward_pre_hook(self._keep_input(i), with_kwargs=True) for i, m in self.linear.items()]
        self.forwards = 0
        self.replays = 0

    @staticmethod
    def support(model: nn.Module) -> tuple[Optional[str], str]:
        layers = getattr(_new_cache(model), "layers", None)
        if layers is None or not layers:
            return "dense", "legacy key/value cache"
        kinds = ["kv" if _is_kv(layer) else "linear" if _is_linear(layer) else type(layer).__name__ for layer in layers]
        others = sorted({k for k in kinds if k not in ("kv", "linear")})
        if others:
            return None, f"cache layers {others} cannot be rolled back"
        if "linear" not in kinds:
            return "dense", f"{len(kinds)} KV layers"
        n_lin = kinds.count("linear")
        missing = [i for i, k in enumerate(kinds) if k == "linear" and i not in _linear_modules(model)]
        if missing:
            return None, f"no linear_attn module found for linear-attention layers {missing[:4]}"
        return "hybrid", f"{kinds.count('kv')} KV layers, {n_lin} linear-attention layers"

    def _keep_input(self, idx: int):
        def hook(_mod, args, kwargs):
            if self._recording:
                h = kwargs.get("hidden_states", args[0] if args else None)
                self._inputs[idx] = h.detach()

        return hook

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def _linear_layers(self):
        return [(i, layer) for i, layer in enumerate(getattr(self.cache, "layers", []) or []) if _is_linear(layer)]

    def forward(self, ids: torch.Tensor, **kwargs):
        """model(input_ids=ids, <cache>, use_cache=True, **kwargs), snapshotting the linear states first unless
        this is the prefill."""
        lin = self._linear_layers()
        self._recording = bool(lin) and self.length > 0
        if self._recording:
            self._snapshot = {i: ({s: t.clone() for s, t in layer.conv_states.items() if t is not None},
                                  {s: t.clone() for s, t in layer.recurrent_states.items() if t is not None},
                                  _token_count(layer))
                              for i, layer in lin}
        else:
            self._snapshot = None
        self._inputs.clear()
        try:
            out = self.model(input_ids=ids, use_cache=True, **{self.kw: self.cache}, **kwargs)
        finally:
            self._recording = False
        self._last_len = int(ids.shape[-1])
        self.forwards += 1
        return out

    def rollback(self, keep: int) -> None:
        drop = self.length - keep
        if drop <= 0:
            return
        layers = getattr(self.cache, "layers", None)
        if layers is None:  # legacy cache
            self.cache.crop(keep)
            return
        for layer in layers:
            if not _is_linear(layer):
                layer.crop(-drop)
        lin = self._linear_layers()
        if lin:
            if self._snapshot is None or drop > self._last_len:
                raise RuntimeError(f"cannot roll back {drop} tokens on a hybrid target: only tokens of the latest "
                                   f"forward after the prefill can be dropped (it had {self._last_len})")
            kept = self._last_len - drop
            for i, layer in lin:
                conv, rec, count = self._snapshot[i]
                for s, t in conv.items():
                    layer.conv_states[s].copy_(t)
                for s, t in rec.items():
                    layer.recurrent_states[s].copy_(t)
                if count is not None:  # the replay below counts the kept tokens again
                    layer.cumulative_length_linear.copy_(count)
            if kept > 0:
                self._replay(kept)
            self._snapshot = None
        if self.length != keep:
            raise RuntimeError(f"cache rollback left {self.length} tokens, expected {keep}")

    def _replay(self, kept: int) -> None:
        """Advance the restored linear states over the first `kept` tokens of the latest forward."""
        for i, mod in sorted(self.linear.items()):
            h = self._inputs[i][:, :kept]
            mod(hidden_states=h, **{_cache_kwarg(mod.forward): self.cache})
        self.replays += 1

    def describe(self) -> str:
        return self.describe_model(self.model)

    @classmethod
    def describe_model(cls, model: nn.Module) -> str:
        """How rollback works on this model's cache, for reports (builds no hooks)."""
        kind, why = cls.support(model)
        if kind == "hybrid":
            return (f"kv cache ({why}): attention KV cropped; linear-attention conv+recurrent states restored "
                    "from a snapshot and advanced over the accepted tokens only")
        return f"kv cache ({why}): cropped"

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
