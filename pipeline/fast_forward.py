"""The fast forward of the hybrid Qwen3.5/3.6 target (issue 30): the non-matrix third of its layers on fused kernels.

transformers' Qwen3_5 forward spends about 40% of an H200's time outside the GEMMs (docs/benchmarks.md): the
zero-centred RMSNorm as six fp32 elementwise kernels, SwiGLU and residual adds as separate passes, the causal
depthwise conv on torch's fallback behind two [B, T, D] <-> [B, D, T] transposes, the GDN gates as elementwise
math, the gated RMSNorm unfused. This module rebinds, per module instance (never the class), the forwards of a
loaded Qwen3_5 text model to flash-linear-attention's (fla 0.6) Triton kernels:

- decoder layer: input norm = fla `rms_norm`; post-attention norm fused with the residual add (`rms_norm(...,
  residual=, prenorm=True)`); MLP = down(`swiglu`(gate(x), up(x))); the zero-centred weight 1 + w is made once, fp32;
- Gated DeltaNet: fla `causal_conv1d` on the projection's own [B, T, D] layout (no transposes); the decay
  -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) computed inside `chunk_gated_delta_rule`
  (`gate_in_kernel`); the gated RMSNorm as fla `rms_norm_gated`;
- every other Qwen3_5RMSNorm (q/k norms of the attention layers, the final norm): fla `rms_norm`.
The attention itself (SDPA, rotary, output gate, its KV cache) and every GEMM stay transformers'.

With a cache (generation: regenerate's embedded engine; speculative decoding: the online eval) the decoder layer
still runs its norms, fused residual+norm and SwiGLU fast (they are per token) and hands the cache to its token
mixer. The GDN serves two kinds of cached call itself, writing the cache as transformers' forward does:
- prefill (the layer has no state yet): the fused conv and delta rule as above, then the conv's T inputs go to
  `cache.update_conv_state` (it keeps the last W = conv-kernel ones, the [B, D, W] tensor transformers stores,
  and from transformers 5.25 counts the T tokens) and the delta rule's final state (fp32, [B, HV, K, V]) to `cache.update_recurrent_state`;
- a block of T > 1 tokens after a state (a verify forward, RollbackCache's replay of the accepted tokens): the
  conv over [the cached W inputs; the new ones] (transformers' cat) keeping the last T outputs, the delta rule
  from the cached recurrent state, both states written back the same way.
A one-token decode step keeps transformers' forward of the GDN (its per-step kernels: causal_conv1d_update and
fla's fused_recurrent_gated_delta_rule where fla is importable), as does a cache recording its past for `crop`
and a cache without transformers 5's linear-attention methods.

Contract:
- `choose(model, device, enabled, key=)` -> (fast: bool, line): the fast forward runs only when enabled (the
  stage's switch `key`: `extract.fast_forward`, `regenerate.fast_forward` (the embedded engine),
  `eval.fast_forward` (online eval); all three on by default: the GPU tests without and with a cache passed on
  the H200, 2026-12-02), on CUDA, with fla importable, on a target whose decoder
  layers are all Qwen3_5DecoderLayer; otherwise the line names the reason and transformers' reference forward
  runs, unchanged. `enable(model, device, enabled, key=)` is choose() plus install(), returning the line each
  stage logs.
- `install(model, ops, gate_in_kernel)` rebinds; `remove(model)` gives back the reference forwards. Parameters and
  the state dict are untouched. Calls with a cache: as above. Packed sequences (`cu_seq_lens_q`) take the
  reference GDN forward (norms and MLP stay fast).
- `fla_ops()` are the kernels; `torch_ops()` the same signatures in plain torch (CPU tests and the bench's CPU
  smoke run check the wiring with them). Equality with the reference forward: tests/test_fast_forward.py (CPU,
  torch_ops: features without a cache; with a cache the cache contents after a prefill, decode steps and blocks,
  generate()'s and the embedded engine's tokens, speculative decoding's accepted lengths) and its GPU tests
  (fla, bf16 tolerance against an fp32 forward: max/mean relative error per tap layer; with a cache the states,
  decode and verify logits around rollbacks).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.targets.qwen3_5 import QWEN3_5

LAYER, GDN, NORM = QWEN3_5.fast_forward_classes  # the hybrid family's decoder layer, Gated DeltaNet and norm
COVERED = (LAYER,)
_PATCHED = "_dflash_fast"  # attribute marking a module whose forward this module rebound


def fla_ops() -> SimpleNamespace:
    """flash-linear-attention's Triton kernels (CUDA), under the names the fast forward calls."""
    from fla.modules.activations import swiglu
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return SimpleNamespace(name="fla", causal_conv1d=causal_conv1d, rms_norm=rms_norm, rms_norm_gated=rms_norm_gated,
                           swiglu=swiglu, chunk_gated_delta_rule=chunk_gated_delta_rule)


# ---- the same contract in plain torch (fla's signatures, the reference arithmetic) ------------------------------

def _t_rms_norm(x, weight, bias=None, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    xf = x.float() + (residual.float() if residual is not None else 0)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return (y, xf.to(residual.dtype if residual is not None else x.dtype)) if prenorm else y


def _t_rms_norm_gated(x, g, weight, bias=None, activation="swish", residual=None, prenorm=False,
                      residual_in_fp32=False, eps=1e-6):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(g.float())).to(x.dtype)


def _t_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                     activation=None, **kw):
    """x [B, T, D], weight [D, W] -> ([B, T, D], None)."""
    T, D, W = x.shape[1], x.shape[2], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=W - 1, groups=D)[..., :T]
    y = F.silu(y) if activation in ("silu", "swish") else y
    return y.transpose(1, 2).to(x.dtype), None


def _t_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, **kw):
    """q, k [B, T, H, K], v [B, T, HV, V], g/beta [B, T, HV], initial_state [B, HV, K, V] or None -> ([B, T, HV, V],
    the final state [B, HV, K, V] fp32 when output_final_state else None); the token recurrence."""
    if kw.get("use_gate_in_kernel"):
        g = -kw["A_log"].float().exp() * F.softplus(g.float() + kw["dt_bias"])
    beta = beta.float().sigmoid() if use_beta_sigmoid_in_kernel else beta.float()
    r = v.shape[2] // q.shape[2]
    q, k = (t.float().repeat_interleave(r, dim=2) for t in (q, k))  # value head i reads key head i // r
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    B, T, HV, V = v.shape
    S = (initial_state.float().clone() if initial_state is not None else  # [B, HV, K, V], fla's layout
         torch.zeros(B, HV, q.shape[-1], V, dtype=torch.float32, device=v.device))
    out = torch.empty(B, T, HV, V, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * g[:, t].float().exp()[..., None, None]
        delta = (v[:, t].float() - (S * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + k[:, t, ..., None] * delta[..., None, :]
        out[:, t] = (S * q[:, t, ..., None]).sum(-2)
    return out.to(v.dtype), (S if output_final_state else None)  # the final state in fp32, as fla's


def torch_ops() -> SimpleNamespace:
    return SimpleNamespace(name="torch", causal_conv1d=_t_causal_conv1d, rms_norm=_t_rms_norm,
                           rms_norm_gated=_t_rms_norm_gated, swiglu=lambda x, y: (F.silu(x.float()) * y.float()).to(x.dtype),
                           chunk_gated_delta_rule=_t_chunk_gated_delta_rule)


# ---- selection ----------------------------------------------------------------------------------------------

def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _layers(model: nn.Module) -> Optional[nn.ModuleList]:
    from pipeline.target import decoder_layers

    try:
        return decoder_layers(model)
    except ValueError:
        return None


def choose(model: nn.Module, device: torch.device, enabled: bool = True, have_fla: Optional[bool] = None,
           key: str = "extract.fast_forward"):
    """(fast, line): whether the fast forward can run for this model and device, and the log line saying so
    (`key`: the config switch the line names when it is off)."""
    layers = _layers(model)
    kinds = sorted({type(m).__name__ for m in layers}) if layers is not None else [type(model).__name__]
    if not enabled:
        return False, f"target forward: transformers' reference ({key}: false)"
    if not layers or any(k not in COVERED for k in kinds):
        return False, (f"target forward: transformers' reference ({'/'.join(kinds)} is not covered by dflash's fast "
                       "forward, which serves the Qwen3.5/3.6 hybrid)")
    act = getattr(getattr(model, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):  # swiglu and the conv's activation are SiLU's
        return False, f"target forward: transformers' reference (hidden_act {act!r}; the fast forward's kernels are SiLU's)"
    if device.type != "cuda":
        return False, "target forward: transformers' reference (CPU; the fast forward's fused kernels are CUDA/Triton)"
    if not (fla_available() if have_fla is None else have_fla):
        return False, ("target forward: transformers' reference (flash-linear-attention is not installed: "
                       'pip install -e ".[gpu]")')
    return True, ("target forward: dflash's fast forward (flash-linear-attention rms_norm / fused add+norm, swiglu, "
                  "causal_conv1d on [B, T, D], in-kernel GDN gates, fused gated norm)")


def enable(model: nn.Module, device: torch.device, enabled: bool = True, key: str = "extract.fast_forward") -> str:
    """choose() and, when it says fast, install(model, fla_ops()); returns the line to log."""
    fast, line = choose(model, device, enabled, key=key)
    if fast:
        install(model, fla_ops())
    return line


# ---- the rebound forwards -----------------------------------------------------------------------------------

def _zero_centred(norm: nn.Module) -> torch.Tensor:
    return (1.0 + norm.weight.detach().float()).contiguous()  # [H] fp32: Qwen3_5RMSNorm is x_hat * (1 + w)


def _bind(module: nn.Module, forward) -> None:
    module.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
    setattr(module, _PATCHED, True)


def _norm_forward(norm: nn.Module, ops):
    w1, eps = _zero_centred(norm), norm.eps

    def forward(x):  # [..., D] -> [..., D]
        return ops.rms_norm(x, w1, None, eps=eps)

    return forward


def _cache_name(fn) -> str:
    """The keyword under which transformers' `fn` takes the cache: `cache` (transformers >= 5.2x), `cache_params`
    (a GDN of 5.1x) or `past_key_values` (an attention or decoder layer of 5.1x). Handing it under another
    name drops it into **kwargs, and the module silently runs without its cache (issue 30's GPU failure on the
    device's transformers 5.17)."""
    from pipeline.target_cache import _cache_kwarg

    return _cache_kwarg(fn)


def _linear_states(cache, idx: int):
    """(conv state [B, D, W] or None, recurrent state [B, HV, K, V] or None) of linear-attention layer `idx`, None
    when neither holds yet; raises ValueError if layer `idx` of the cache is not a linear-attention one. Through
    the cache's getters where transformers has them (5.2x), else its layer's own dicts (5.1x: the same ones)."""
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(idx), cache.get_recurrent_state(idx)
    layer = cache.layers[idx]
    if not isinstance(getattr(layer, "conv_states", None), dict):
        raise ValueError(f"cache layer {idx} is not a linear-attention layer")
    if not layer.has_previous_state[0]:
        return None, None
    return layer.conv_states[0], layer.recurrent_states[0]


def _cached_mode(gdn: nn.Module, cache, T: int) -> Optional[str]:
    """How the fast GDN serves a call with `cache`: "prefill" (the layer has no state yet), "extend" (T > 1 new
    tokens after a state: a verify block, a rollback's replay) or None (transformers' forward: a one-token
    decode step, a cache recording its past for crop, a cache without transformers 5's linear-attention API)."""
    idx = gdn.layer_idx
    if not all(hasattr(cache, f) for f in ("update_conv_state", "update_recurrent_state", "layers")):
        return None
    if idx >= len(cache.layers):
        return None
    recording = getattr(cache, "is_recording_past", None)
    if (recording(idx) if recording is not None else getattr(cache.layers[idx], "record_past", False)):
        return None
    try:
        conv, rec = _linear_states(cache, idx)
    except (ValueError, AttributeError, KeyError, TypeError):  # not a linear-attention layer, or an unknown cache
        return None
    if conv is None and rec is None:
        return "prefill"
    if conv is not None and rec is not None and T > 1:
        return "extend"
    return None


def _gdn_forward(gdn: nn.Module, ops, gate_in_kernel: bool):
    ref = type(gdn).forward
    ref_kw = _cache_name(ref)
    conv_w = gdn.conv1d.weight.detach().squeeze(1)  # [D, W], a view
    W = gdn.conv_kernel_size
    K, V, dk, dv = gdn.key_dim, gdn.value_dim, gdn.head_k_dim, gdn.head_v_dim

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("cache_params", None)  # the name of transformers 5.1x
        mode = _cached_mode(gdn, cache, hidden_states.shape[1]) if cache is not None else None
        if (cache is not None and mode is None) or kwargs.get("cu_seq_lens_q") is not None:
            return ref(gdn, hidden_states, attention_mask=attention_mask, **{ref_kw: cache}, **kwargs)
        if attention_mask is not None:  # zero the padded tokens, as transformers does
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        B, T, _ = hidden_states.shape
        pre = gdn.in_proj_qkv(hidden_states)  # [B, T, 2K + V], before the conv
        conv_kw = dict(weight=conv_w, bias=gdn.conv1d.bias, activation=gdn.activation)
        if mode == "extend":  # the conv reads the cached last W inputs first, as transformers' cat does
            state = _linear_states(cache, gdn.layer_idx)[0]  # [B, D, W]
            qkv = ops.causal_conv1d(torch.cat([state.transpose(1, 2).to(pre.dtype), pre], dim=1), **conv_kw)[0][:, -T:]
        else:
            qkv, _ = ops.causal_conv1d(pre, **conv_kw)  # [B, T, 2K + V], no transposes
        initial = _linear_states(cache, gdn.layer_idx)[1] if mode == "extend" else None
        if cache is not None:  # the cache keeps the last W conv inputs, [B, D, W]; it is handed all T new ones, as
            # transformers hands them (from 5.25 the linear layer counts its tokens by what it is handed)
            cache.update_conv_state(pre.transpose(1, 2), gdn.layer_idx, conv_kernel_size=W)
        q, k, v = torch.split(qkv, [K, K, V], dim=-1)
        q, k, v = q.reshape(B, T, -1, dk), k.reshape(B, T, -1, dk), v.reshape(B, T, -1, dv)  # [B, T, H|HV, d]
        z = gdn.in_proj_z(hidden_states)  # [B, T, HV * dv]
        b, a = gdn.in_proj_b(hidden_states), gdn.in_proj_a(hidden_states)  # [B, T, HV]
        state_kw = dict(initial_state=initial, output_final_state=cache is not None)
        if gate_in_kernel:
            o, final = ops.chunk_gated_delta_rule(q, k, v, g=a, beta=b, use_qk_l2norm_in_kernel=True,
                                                  use_gate_in_kernel=True, A_log=gdn.A_log, dt_bias=gdn.dt_bias,
                                                  use_beta_sigmoid_in_kernel=True, **state_kw)
        else:
            g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
            o, final = ops.chunk_gated_delta_rule(q, k, v, g=g, beta=b.sigmoid(), use_qk_l2norm_in_kernel=True,
                                                  **state_kw)
        if cache is not None:  # [B, HV, K, V] fp32
            cache.update_recurrent_state(final, gdn.layer_idx)
        o = ops.rms_norm_gated(o.reshape(-1, dv), z.reshape(-1, dv), gdn.norm.weight, None, activation="silu",
                               eps=gdn.norm.variance_epsilon)  # [B * T * HV, dv]
        return gdn.out_proj(o.reshape(B, T, -1))  # [B, T, H]

    return forward


def _layer_forward(layer: nn.Module, ops):
    w_in, w_post = _zero_centred(layer.input_layernorm), _zero_centred(layer.post_attention_layernorm)
    eps_in, eps_post = layer.input_layernorm.eps, layer.post_attention_layernorm.eps
    mlp = layer.mlp
    mixer = layer.linear_attn if layer.block_type == QWEN3_5.linear_layer_type else layer.self_attn
    mixer_kw = _cache_name(type(mixer).forward)  # the name transformers' mixer takes (ours, rebound, takes both)

    def forward(hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, cache=None,
                **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # the name of transformers 5.1x
        # norms, residual adds and MLP are per token: the same with or without a cache; the token mixer gets the
        # cache and decides (the GDN above; attention is transformers' own, KV cache included)
        h = ops.rms_norm(hidden_states, w_in, None, eps=eps_in)  # [B, T, H]
        if layer.block_type == QWEN3_5.linear_layer_type:
            h = layer.linear_attn(hidden_states=h, attention_mask=attention_mask, **{mixer_kw: cache}, **kwargs)
        else:
            h, _ = layer.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                   position_embeddings=position_embeddings, **{mixer_kw: cache}, **kwargs)
        h, residual = ops.rms_norm(h, w_post, None, residual=hidden_states, eps=eps_post, prenorm=True)
        return residual + mlp.down_proj(ops.swiglu(mlp.gate_proj(h), mlp.up_proj(h)))  # [B, T, H]

    return forward


def install(model: nn.Module, ops: Optional[SimpleNamespace] = None, gate_in_kernel: bool = True) -> int:
    """Rebind the forwards of `model`'s Qwen3_5 modules to `ops` (default fla_ops()); returns how many modules."""
    ops = ops or fla_ops()
    remove(model)
    n = 0
    for mod in model.modules():
        kind = type(mod).__name__
        if kind == LAYER:
            _bind(mod, _layer_forward(mod, ops))
        elif kind == GDN:
            _bind(mod, _gdn_forward(mod, ops, gate_in_kernel))
        elif kind == NORM:
            _bind(mod, _norm_forward(mod, ops))
        else:
            continue
        n += 1
    return n


def remove(model: nn.Module) -> int:
    """Give every rebound module its class's (transformers') forward back; returns how many."""
    n = 0
    for mod in model.modules():
        if mod.__dict__.pop(_PATCHED, False):
            mod.__dict__.pop("forward", None)
            n += 1
    return n


def installed(model: nn.Module) -> int:
    return sum(bool(m.__dict__.get(_PATCHED)) for m in model.modules())
