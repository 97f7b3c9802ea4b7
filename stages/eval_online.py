"""Online evaluation (`dflash eval --online`): speculative decoding against the real target, token for token.

Contract: held-out prompts (the conversation up to its first assistant turn, from data.validation_files, else
the validation split of data.train_files) rendered with the target's chat template and data.enable_thinking
are greedy-decoded and speculatively decoded (stages/speculate.py) on the same machine, interleaved per
prompt after a warm-up. Serving hands the drafter the target's bf16 hidden states whatever encoding its
training store used. Reports tau (tokens per verify step), tokens per target forward, the wall-clock speedup
and every prompt whose speculative output differs from greedy (must be none: that is a bug, reported with
the target's logit gap at the first difference), and which cache policy ran and how it rolled back rejected
drafts (`cache`, `cache_rollback`; hybrid targets restore their linear-attention states, stages/speculate.py).
A hybrid target's kernels are named in one line before loading (pipeline/kernels.py), and which forward it runs
in one after: dflash's fast forward where it applies (`eval.fast_forward`, pipeline/fast_forward.py), else
transformers', with the reason.
At eval.temperature > 0 both decoders sample (eval.top_p, eval.seed; each prompt's draws seeded from its
index) and the speculative one verifies drafts with the lossless rejection rule (pipeline/acceptance.py), as
serving does: outputs then differ from the baseline's by chance, so the token-for-token check is replaced by
the rule's distribution guarantee (tested in tests/test_sampling_eval.py); tau is tokens per verify step.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from pipeline.acceptance import histogram, mean_length
from pipeline.config import Config
from pipeline.errors import UserError

MISMATCH_BANNER = "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"


class EvalError(UserError, RuntimeError):
    """A problem the user can fix (wrong path, mismatched store/drafter); the message says how."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def heldout_prompts(cfg: Config, n: int) -> list[tuple[str, list[dict]]]:
    """(sample_id, messages before the first assistant turn) of up to n validation conversations, by sample id."""
    from data.ingest import is_validation, read_conversations, row_byte_cap, sample_id_of

    if cfg.data.validation_files:
        sources, keep = cfg.data.validation_files, (lambda sid: True)
        split = "validation"
    else:
        sources = cfg.data.train_files
        keep = lambda sid: is_validation(sid, cfg.data.validation_fraction)  # noqa: E731
        split = "train"
    found: dict[str, list[dict]] = {}
    for path in sources:
        for _src, _line, messages in read_conversations(path, "skip", split=split,
                                                        max_row_bytes=row_byte_cap(cfg.data.max_length)):
            sid = sample_id_of(messages)
            if not keep(sid):
                continue
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt = messages[:first]
            if prompt:
                found.setdefault(sid, prompt)
    seen, out = set(), []
    for sid in sorted(found):
        key = json.dumps(found[sid], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((sid, found[sid]))
        if len(out) >= n:
            break
    if not out:
        raise EvalError("no held-out prompts: set data.validation_files (or data.validation_fraction > 0) in the "
                        "config")
    return out


def stop_token_ids(tokenizer, model) -> set[int]:
    ids: set[int] = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    vocab = tokenizer.get_vocab()
    for name in ("<|end|>", "<|im_end|>", "<|endoftext|>"):
        if name in vocab:
            ids.add(int(vocab[name]))
    return ids


def _layer_types(path: str) -> Optional[list]:
    try:
        from pipeline.target import local_target_dir
        from pipeline.targets import read_target_config

        return read_target_config(local_target_dir(path)).layer_types
    except (OSError, ValueError):
        return None


def load_online_target(cfg: Config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target on `device` in the numerics `eval.target_precision` picks (pipeline/fp8_block.py: an FP8
    release's FP8 GEMMs, as served), with dflash's fast forward where it applies (`eval.fast_forward`: CUDA with
    flash-linear-attention, pipeline/fast_forward.py; it serves the cached prefill, decode and verify forwards);
    logs which forward runs, or why the reference does."""
    from pipeline import fp8_block
    from pipeline.fast_forward import enable
    from pipeline.fp8_weights import quantization
    from pipeline.target import load_target, local_target_dir

    precision, line = fp8_block.resolve(cfg.eval.target_precision, quantization(local_target_dir(cfg.target.path)),
                                        cfg.target.path, key="eval.target_precision")
    if line:
        log(f"eval: {line}")
    model = load_target(cfg.target.path, dtype, device, cfg.target.attn_implementation, cfg.target.trust_remote_code,
                        precision=precision)
    if precision != "bf16":
        log(f"eval: target precision {precision}: {fp8_block.describe(model)}")
    log(f"eval: {enable(model, device, cfg.eval.fast_forward, key='eval.fast_forward')}")
    return model


@torch.inference_mode()
def _margin(model, prefix: list[int], greedy: list[int], spec: list[int], i: int) -> Optional[float]:
    """Diagnostic for a mismatch: the target's logit gap (full forward, no cache) between the two tokens chosen
    at the first difference. A gap near 0 points at a numerical near-tie (e.g. bf16 kernels that differ between
    a 1-token and a block forward); a large gap is a logic bug."""
    if i >= len(greedy) or i >= len(spec):
        return None
    dev = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([prefix], device=dev), use_cache=False).logits[0, -1].float()
    return float(logits[greedy[i]] - logits[spec[i]])


def run_online(drafter: nn.Module, cfg: Config, device: torch.device, encoding: str, num_prompts: int,
               max_new_tokens: int, cache: str = "auto", store_attrs: Optional[dict] = None,
               threads: Optional[int] = None) -> dict:
    """See the module contract. threads (CPU only): torch threads while decoding; default 1 for targets under
    100M parameters (their matmuls are too small to split; thread hand-offs cost more than they save, and far
    more on a loaded machine), else torch's default. Greedy and speculative decoding run with the same."""
    saved = torch.get_num_threads()
    try:
        return _run_online(drafter, cfg, device, encoding, num_prompts, max_new_tokens, cache, store_attrs, threads)
    finally:
        torch.set_num_threads(saved)


@dataclass(frozen=True)
class _Online:
    """The target loaded and checked against the drafter, and what decoding the prompts needs."""
    arch: object  # the drafter's arch: target layer ids and block size
    dtype: torch.dtype
    model: nn.Module
    runner: object  # stages.speculate.TargetRunner: the cache policy and its rollback
    draft_fn: object
    stops: set
    encoded: list  # (sample_id, prompt token ids)
    spec_kw: dict  # speculative_decode's keywords


@dataclass
class _Tally:
    """Both decoders' totals over the prompts, the acceptance lengths, the mismatches and each prompt's record."""
    g_time: float = 0.0
    s_time: float = 0.0
    g_fwd: int = 0
    s_fwd: int = 0
    new_tokens: int = 0
    spec_tokens: int = 0
    steps: list = field(default_factory=list)
    mismatches: list = field(default_factory=list)
    per_prompt: list = field(default_factory=list)


def _run_online(drafter, cfg, device, encoding, num_prompts, max_new_tokens, cache, store_attrs, threads) -> dict:
    """The conductor: load the target (`_load_online`), warm up, decode each prompt both ways (`_decode_prompts`)
    and report (`_online_report`)."""
    from stages.sampling import Sampling
    from stages.speculate import greedy_decode, speculative_decode

    on = _load_online(drafter, cfg, device, num_prompts, cache, store_attrs, threads)
    # warm-up (untimed): first calls allocate and initialise kernels
    greedy_decode(on.runner, on.encoded[0][1], min(8, max_new_tokens), on.stops)
    speculative_decode(on.runner, on.draft_fn, on.encoded[0][1], max_new_tokens=min(8, max_new_tokens), **on.spec_kw)
    sampling = Sampling(cfg.eval.temperature, cfg.eval.top_p, cfg.eval.seed)
    if not sampling.greedy:
        log(f"eval: sampling at temperature {sampling.temperature}, top-p {sampling.top_p}, seed {sampling.seed}: "
            "drafts verified with the rejection rule (lossless in distribution, not token for token)")
    tally = _decode_prompts(on, sampling, device, max_new_tokens)
    return _online_report(on, tally, cfg, device, sampling, max_new_tokens)


def _load_online(drafter, cfg: Config, device: torch.device, num_prompts: int, cache: str,
                 store_attrs: Optional[dict], threads: Optional[int]) -> _Online:
    """The tokenizer, the target (its kernels said first) checked against the drafter's layers, the drafter on the
    target's device and dtype, the CPU threads, the held-out prompts rendered, and the cache policy (said)."""
    from pipeline.kernels import kernel_report, use_kernel_cache
    from pipeline.target import DTYPES, load_tokenizer
    from stages.speculate import TargetRunner, dflash_draft_fn

    arch = drafter.arch
    dtype = DTYPES[cfg.target.dtype if device.type == "cuda" else cfg.target.cpu_dtype]
    if store_attrs:
        think = (store_attrs.get("tokenizer") or {}).get("enable_thinking")
        if think is not None and think != cfg.data.enable_thinking:
            log(f"eval: WARNING: the store was extracted with enable_thinking={think} but data.enable_thinking="
                f"{cfg.data.enable_thinking}; the drafter is being served a different template than it learned")
    tokenizer = load_tokenizer(cfg.target.path, cfg.target.trust_remote_code)
    line = kernel_report(_layer_types(cfg.target.path), device.type, cfg.eval.fast_forward)
    if line:
        log(f"eval: {line}")
        if device.type == "cuda":
            use_kernel_cache()
    model = load_online_target(cfg, device, dtype)
    n_layers = model.config.get_text_config().num_hidden_layers
    if max(arch.target_layer_ids) >= n_layers:
        raise EvalError(f"the drafter uses target layers {arch.target_layer_ids} but {cfg.target.path} has {n_layers}")
    drafter = drafter.to(device=device, dtype=dtype)
    if device.type == "cpu":
        if threads is None and sum(p.numel() for p in model.parameters()) < 100_000_000:
            threads = 1
        if threads:
            torch.set_num_threads(threads)
    embed = model.get_input_embeddings().weight.detach()
    out_emb = model.get_output_embeddings()
    head = out_emb.weight.detach() if out_emb is not None else embed
    draft_fn = dflash_draft_fn(drafter, embed, head)
    stops = stop_token_ids(tokenizer, model)
    prompts = heldout_prompts(cfg, num_prompts)
    try:
        runner = TargetRunner(model, cache)
    except ValueError as e:
        raise EvalError(str(e)) from None
    log(f"eval: {runner.describe()}")

    def render(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=cfg.data.enable_thinking)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    encoded = [(sid, render(m)) for sid, m in prompts]
    # Serving hands the drafter the target's bf16 hidden states, whatever encoding the store used in training:
    # online tau measures how a drafter trained on (possibly lossy) stored features does on the real ones.
    spec_kw = dict(layer_ids=arch.target_layer_ids, block_size=arch.block_size, stop_ids=stops,
                   feature_encoding="bf16", feature_dtype=dtype)
    return _Online(arch=arch, dtype=dtype, model=model, runner=runner, draft_fn=draft_fn, stops=stops,
                   encoded=encoded, spec_kw=spec_kw)


def _decode_prompts(on: _Online, sampling, device: torch.device, max_new_tokens: int) -> _Tally:
    """Each prompt greedy-decoded and speculatively decoded in turn (sampled: each decoder's draws seeded from the
    prompt's index); a greedy run's first difference recorded with the target's logit gap there."""
    from stages.speculate import greedy_decode, speculative_decode

    runner, draft_fn, stops, spec_kw, model = on.runner, on.draft_fn, on.stops, on.spec_kw, on.model
    t = _Tally()
    for i, (sid, ids) in enumerate(on.encoded):
        gens = (None, None) if sampling.greedy else (sampling.generator(device, 2 * i), sampling.generator(device, 2 * i + 1))
        g = greedy_decode(runner, ids, max_new_tokens, stops, sampling, gens[0])
        s = speculative_decode(runner, draft_fn, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                               generator=gens[1], **spec_kw)
        t.g_time += g.seconds
        t.s_time += s.seconds
        t.g_fwd += g.forwards
        t.s_fwd += s.forwards
        t.new_tokens += len(g.tokens)
        t.spec_tokens += len(s.tokens)
        t.steps += s.steps
        same = g.tokens == s.tokens if sampling.greedy else None  # sampled outputs differ by chance
        if same is False:
            first = next((j for j, (a, b) in enumerate(zip(g.tokens, s.tokens)) if a != b),
                         min(len(g.tokens), len(s.tokens)))
            t.mismatches.append({"sample_id": sid, "first_difference": first, "greedy": g.tokens,
                                 "speculative": s.tokens,
                                 "logit_margin": _margin(model, ids + g.tokens[:first], g.tokens, s.tokens, first)})
        t.per_prompt.append({"sample_id": sid, "prompt_tokens": len(ids), "new_tokens": len(g.tokens),
                             "verify_steps": len(s.steps), "tau": round(mean_length(s.steps), 4),
                             "identical": same, "tokens": s.tokens, "acceptance_lengths": s.steps})
    return t


def _online_report(on: _Online, t: _Tally, cfg: Config, device: torch.device, sampling, max_new_tokens: int) -> dict:
    """The online result: target, device and cache, sampling, tau, forwards, times and speedup, the acceptance
    histogram, the mismatches and each prompt's record."""
    arch, dtype, runner, encoded, steps, mismatches = on.arch, on.dtype, on.runner, on.encoded, t.steps, t.mismatches
    g_time, s_time, g_fwd, s_fwd, new_tokens, spec_tokens = (t.g_time, t.s_time, t.g_fwd, t.s_fwd, t.new_tokens,
                                                             t.spec_tokens)
    per_prompt = t.per_prompt
    result = {
        "target": cfg.target.path,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "cache": runner.policy,
        "cache_rollback": runner.describe(),
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "enable_thinking": cfg.data.enable_thinking,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "sampling_seed": None if sampling.greedy else sampling.seed,
        "lossless_check": "token for token against greedy" if sampling.greedy else
                          "by construction (rejection rule, tested in distribution); no token comparison",
        "new_tokens": new_tokens,
        "verify_steps": len(steps),
        "tau": mean_length(steps),
        "tokens_per_target_forward": float(spec_tokens / max(s_fwd, 1)),
        "greedy_target_forwards": g_fwd,
        "speculative_target_forwards": s_fwd,
        "greedy_seconds": round(g_time, 4),
        "speculative_seconds": round(s_time, 4),
        "greedy_tokens_per_second": round(new_tokens / max(g_time, 1e-9), 2),
        "speculative_tokens_per_second": round(spec_tokens / max(s_time, 1e-9), 2),
        "speedup": float((spec_tokens / max(s_time, 1e-9)) / max(new_tokens / max(g_time, 1e-9), 1e-9)),
        "acceptance_histogram": histogram(steps, arch.block_size),
        "mismatches": len(mismatches),
        "lossless": not mismatches,
        "mismatch_details": mismatches[:5],
        "per_prompt": per_prompt,
    }
    return result
