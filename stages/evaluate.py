"""`dflash eval`: does the trained drafter accelerate the target? Offline (store only) and online (real decoding).

Contract:
- DRAFTER is an exported directory (config.json + model.safetensors) or a training checkpoint (.ckpt); the
  kind is detected. A drafter inside a run directory (RUN/export, RUN/checkpoints/x.ckpt) finds its run:
  RUN/config.yaml is the default config and RUN/logs/metrics.csv gives the training curves.
- Offline (no target compute): validation samples of the store (at most `max_samples`, in store order; all
  samples, flagged, when the store has no validation split). Candidate anchors: positions a with m[a] and
  m[a+1] (as training). Each anchor is drafted as serving would: context = features of positions < a, block
  [token a, MASK...], greedy through the frozen lm_head (`draft_blocks`). Slot k is labelled with token a+k
  when it exists and is supervised. Acceptance length = 1 + number of leading slots whose draft equals the
  label (stops at the first mismatch, the sequence end or an unsupervised token).
  * uniform: at most eval.max_anchors_per_sample evenly spaced anchors per sample (deterministic): mean tau,
    per-slot accuracy (unconditional: hits / labelled slots), tau implied by the per-slot accuracies (the
    training metric) and the histogram. Every position weighs the same.
  * serving walk: decoding replayed on the stored responses (`serving_walk`): from each assistant turn's
    first token, a step yields its anchor's acceptance length (never past the turn's end-of-turn token) and
    the next step anchors where it stopped. Tokens per verify step, as the online eval counts them; when the
    responses are the target's own greedy outputs it predicts online tau. It is lower than the uniform mean:
    decoding steps over easy stretches in long strides and visits hard positions one by one, so they weigh more.
- Online (`--online`): the target (load_target, on CUDA when present, else CPU) greedy-decodes held-out
  prompts (the conversation up to its first assistant turn, from data.validation_files, else the validation
  split of data.train_files) rendered with the chat template, add_generation_prompt=True and
  data.enable_thinking; then decodes them speculatively (stages/speculate.py). Reports tau (tokens per
  verify step), tokens per target forward (prefill included), wall-clock speedup (sum of greedy times / sum of
  speculative times: same machine, same cache policy, same threads, interleaved per prompt after a warm-up)
  and the prompts whose speculative output differs from greedy (must be 0; anything else is a bug: the command
  prints a banner with the target's logit gap at the first difference and exits 1).
- Writes OUT/report.json and PNG plots (acceptance histogram, per-slot accuracy, training curves).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from torch import Tensor, nn

from pipeline import store as st
from pipeline.config import Config, ConfigError, config_from_dict, load_config, parse_override
from pipeline.drafter import draft_blocks
from pipeline.encoding import decode, from_storage
from stages.eval_plots import read_metrics, write_plots

MISMATCH_BANNER = "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"


class EvalError(RuntimeError):
    """A problem the user can fix (wrong path, mismatched store/drafter); the message says how."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# the drafter and where it came from
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DrafterSource:
    path: str
    kind: str  # "export" | "checkpoint"
    run_dir: Optional[Path]  # the training run it belongs to, when recognisable
    store: Optional[str]  # the store it was trained from (recorded at training time)
    config: Optional[dict]  # the training config (checkpoints carry it)
    encoding: Optional[str]  # the store's feature encoding (checkpoints carry it)


def load_drafter(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(drafter in eval mode on device/dtype, DrafterSource). Exported directory or training checkpoint."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").exists() or not (p / "model.safetensors").exists():
            raise EvalError(f"{p} is a directory but not an exported drafter (needs config.json and model.safetensors)")
        from pipeline.export import load_exported

        drafter, _arch, meta = load_exported(p, device=device, dtype=dtype)
        extra = meta.get("dflash_meta") or {}
        run_dir = p.parent if _looks_like_run(p.parent) else None
        return drafter, DrafterSource(str(p), "export", run_dir, extra.get("store"), None, None)
    if p.is_file():
        from stages.export_stage import load_checkpoint_drafter

        drafter, meta = load_checkpoint_drafter(str(p), device)
        drafter = drafter.to(dtype)
        run_dir = p.parent.parent if p.parent.name == "checkpoints" and _looks_like_run(p.parent.parent) else None
        return drafter, DrafterSource(str(p), "checkpoint", run_dir, meta.get("store"), meta.get("config"),
                                      meta.get("encoding"))
    raise FileNotFoundError(f"drafter {path} does not exist: pass an exported directory (RUN/export) or a "
                            "training checkpoint (RUN/checkpoints/last.ckpt)")


def _looks_like_run(d: Path) -> bool:
    return (d / "config.yaml").exists() or (d / "logs" / "metrics.csv").exists()


def resolve_config(src: DrafterSource, config_path: Optional[str], overrides: list[str]) -> tuple[Config, str]:
    """--config if given; else the run's config.yaml; else the checkpoint's embedded config; else tiny."""
    if config_path:
        return load_config(config_path, overrides), config_path
    if src.run_dir is not None and (src.run_dir / "config.yaml").exists():
        path = src.run_dir / "config.yaml"
        return load_config(path, overrides), str(path)
    if src.config is not None:
        raw = json.loads(json.dumps(src.config))
        for text in overrides:
            section, name, value = parse_override(text)
            if section not in raw:
                raise ConfigError(f"--set {text!r}: unknown section '{section}'")
            raw[section][name] = value
        return config_from_dict(raw, source=f"{src.path} (embedded config)"), f"{src.path} (embedded config)"
    return load_config(None, overrides), "configs/tiny.yaml (default)"


# ----------------------------------------------------------------------------------------------------------
# offline evaluation
# ----------------------------------------------------------------------------------------------------------


def select_anchors(loss_mask: Tensor, max_anchors: int) -> Tensor:
    """Positions a with m[a] and m[a+1]; at most max_anchors, evenly spaced over them (deterministic)."""
    m = loss_mask.bool()
    cand = torch.nonzero(m[:-1] & m[1:], as_tuple=False).flatten()
    if cand.numel() > max_anchors:
        idx = torch.linspace(0, cand.numel() - 1, max_anchors).round().long().unique()
        cand = cand[idx]
    return cand


class AcceptanceStats:
    """Accumulates acceptance lengths and per-slot hits over drafted blocks of size bs."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.hist = np.zeros(block_size + 1, dtype=np.int64)  # index = acceptance length (1..bs)
        self.hits = np.zeros(block_size, dtype=np.int64)  # index k = slot k (1..bs-1)
        self.counts = np.zeros(block_size, dtype=np.int64)

    def add(self, draft: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
        """draft/labels/valid [A, bs-1] -> acceptance lengths [A] (1 + leading valid matches)."""
        match = (draft == labels) & valid
        acc_len = 1 + torch.cumprod(match.long(), dim=1).sum(dim=1)
        self.hist += np.bincount(acc_len.numpy(), minlength=self.bs + 1)[: self.bs + 1]
        self.hits[1:] += match.sum(0).numpy()
        self.counts[1:] += valid.sum(0).numpy()
        return acc_len

    def summary(self) -> dict:
        n = int(self.hist.sum())
        lengths = np.arange(self.bs + 1)
        acc = (self.hits[1:] / np.maximum(self.counts[1:], 1)).astype(float)
        return {
            "blocks": n,
            "tau": float((self.hist * lengths).sum() / max(n, 1)),
            "tau_from_slot_acc": float(1.0 + np.cumprod(np.clip(acc, 0, 1)).sum()),
            "slot_accuracy": [round(float(a), 6) for a in acc],  # slots 1..bs-1
            "slot_labelled": [int(c) for c in self.counts[1:]],
            "acceptance_histogram": {str(k): int(self.hist[k]) for k in range(1, self.bs + 1)},
        }


DraftFn = Callable[..., Tensor]


def supervised_runs(loss_mask: Tensor) -> list[tuple[int, int]]:
    """[(first, last)] inclusive position ranges of consecutive supervised tokens (one per assistant turn)."""
    m = loss_mask.bool().tolist()
    runs, start = [], None
    for i, v in enumerate(m + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i - 1))
            start = None
    return runs


def serving_walk(acc_len: dict[int, int], runs: list[tuple[int, int]]) -> list[int]:
    """Replay speculative decoding on the stored responses: tokens produced per verify step.

    Each assistant turn [first, last] is decoded as serving would when the response is the target's own greedy
    output: the first token comes from the prefill; from anchor a the step yields acc_len[a] tokens (accepted
    drafts + the target's bonus) but never past the turn's last token (its end-of-turn token stops decoding),
    and the next step anchors at the last token produced."""
    steps = []
    for first, last in runs:
        a = first
        while a < last:
            take = min(acc_len[a], last - a)
            steps.append(take)
            a += take
    return steps


def offline_eval(drafter: nn.Module, samples: Iterable[dict], embed_weight: Tensor, lm_head_weight: Tensor,
                 max_anchors: int, block_size: Optional[int] = None, anchor_chunk: int = 64,
                 draft: DraftFn = draft_blocks, walk: bool = True) -> dict:
    """samples: dicts with tokens [S] long, loss_mask [S], features [S, L*H] float. See the module contract.

    The uniform statistics (tau, per-slot accuracy, histogram) use at most max_anchors evenly spaced anchors
    per sample; with walk=True every candidate anchor is drafted so that `serving_walk` can replay decoding
    (tau_serving: tokens per verify step, the number the online eval measures)."""
    bs = block_size or drafter.arch.block_size
    stats = AcceptanceStats(bs)
    walk_steps: list[int] = []
    n_samples = 0
    k = torch.arange(1, bs)
    for s in samples:
        tokens, mask, feats = s["tokens"].long(), s["loss_mask"].bool(), s["features"]
        S = tokens.numel()
        chosen = select_anchors(mask, max_anchors)
        if chosen.numel() == 0:
            continue
        n_samples += 1
        anchors = select_anchors(mask, S) if walk else chosen  # all candidates for the walk
        is_chosen = torch.isin(anchors, chosen)
        acc_at: dict[int, int] = {}
        for c in range(0, anchors.numel(), anchor_chunk):
            a, pick = anchors[c : c + anchor_chunk], is_chosen[c : c + anchor_chunk]
            d = draft(drafter, feats, a, tokens[a], embed_weight, lm_head_weight).cpu()  # [A, bs-1]
            pos = a[:, None] + k  # [A, bs-1]
            pos_c = pos.clamp(max=S - 1)
            labels, valid = tokens[pos_c], (pos < S) & mask[pos_c]
            match = (d == labels) & valid
            acc_at.update(zip(a.tolist(), (1 + torch.cumprod(match.long(), 1).sum(1)).tolist()))
            if pick.any():
                stats.add(d[pick], labels[pick], valid[pick])
        if walk:
            walk_steps += serving_walk(acc_at, supervised_runs(mask))
    out = stats.summary()
    out["samples"] = n_samples
    if walk:
        hist = np.bincount(np.asarray(walk_steps, dtype=np.int64), minlength=bs + 1)[: bs + 1]
        out["serving_walk"] = {
            "tau": float(sum(walk_steps) / max(len(walk_steps), 1)),
            "steps": len(walk_steps),
            "tokens": int(sum(walk_steps)),
            "acceptance_histogram": {str(i): int(hist[i]) for i in range(1, bs + 1)},
        }
    return out


def store_samples(reader: st.StoreReader, indices: list[int], device: torch.device, dtype: torch.dtype):
    for i in indices:
        s = reader.read(i)
        parts = {k: from_storage(v).to(device) for k, v in s.items() if k not in ("tokens", "loss_mask")}
        feats = decode(parts, reader.encoding, dtype).flatten(1)  # [S, L*H]
        yield {"tokens": torch.from_numpy(s["tokens"].astype(np.int64)),
               "loss_mask": torch.from_numpy(s["loss_mask"].astype(np.bool_)), "features": feats}


def load_store_head(store_path: str, device, dtype) -> tuple[Tensor, Tensor]:
    from safetensors.torch import load

    head_path = st.frozen_head_path(store_path)
    if not st.exists(head_path):
        raise EvalError(f"{head_path} is missing: the store is incomplete; resume `dflash extract`")
    t = load(st.read_bytes(head_path))
    embed = t["embed_tokens.weight"].to(device, dtype)
    head = t["lm_head.weight"].to(device, dtype) if "lm_head.weight" in t else embed  # tied: the embedding
    return embed, head


def run_offline(drafter: nn.Module, store_path: str, max_anchors: int, device: torch.device,
                dtype: torch.dtype = torch.float32, max_samples: Optional[int] = None) -> dict:
    reader = st.StoreReader(store_path)
    arch = drafter.arch
    drafter = drafter.to(device=device, dtype=dtype)
    if list(reader.layer_ids) != list(arch.target_layer_ids):
        raise EvalError(f"the drafter conditions on target layers {arch.target_layer_ids} but the store at "
                        f"{store_path} holds layers {reader.layer_ids}; evaluate it on the store it was trained on "
                        "(--store PATH)")
    if reader.hidden_size != arch.hidden_size:
        raise EvalError(f"the store's hidden size {reader.hidden_size} differs from the drafter's {arch.hidden_size}")
    split = "validation"
    indices = reader.indices("validation")
    if not indices:
        split, indices = "all (the store has no validation split: optimistic)", list(range(len(reader.samples)))
        log(f"eval: WARNING: {store_path} has no validation samples; evaluating on training samples")
    if max_samples is not None:
        indices = indices[:max_samples]
    embed, head = load_store_head(store_path, device, dtype)
    t0 = time.perf_counter()
    out = offline_eval(drafter, store_samples(reader, indices, device, dtype), embed, head, max_anchors)
    out.update({"store": store_path, "split": split, "encoding": reader.encoding,
                "max_anchors_per_sample": max_anchors, "max_samples": max_samples,
                "seconds": round(time.perf_counter() - t0, 2)})
    return out


# ----------------------------------------------------------------------------------------------------------
# online evaluation
# ----------------------------------------------------------------------------------------------------------


def heldout_prompts(cfg: Config, n: int) -> list[tuple[str, list[dict]]]:
    """(sample_id, messages before the first assistant turn) of up to n validation conversations, by sample id."""
    from data.ingest import is_validation, read_conversations, sample_id_of

    if cfg.data.validation_files:
        sources, keep = cfg.data.validation_files, (lambda sid: True)
        split = "validation"
    else:
        sources = cfg.data.train_files
        keep = lambda sid: is_validation(sid, cfg.data.validation_fraction)  # noqa: E731
        split = "train"
    found: dict[str, list[dict]] = {}
    for path in sources:
        for _src, _line, messages in read_conversations(path, "skip", split=split):
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


def _run_online(drafter, cfg, device, encoding, num_prompts, max_new_tokens, cache, store_attrs, threads) -> dict:
    from pipeline.target import DTYPES, load_target, load_tokenizer
    from stages.speculate import TargetRunner, dflash_draft_fn, greedy_decode, speculative_decode

    arch = drafter.arch
    dtype = DTYPES[cfg.target.dtype if device.type == "cuda" else cfg.target.cpu_dtype]
    if store_attrs:
        think = (store_attrs.get("tokenizer") or {}).get("enable_thinking")
        if think is not None and think != cfg.data.enable_thinking:
            log(f"eval: WARNING: the store was extracted with enable_thinking={think} but data.enable_thinking="
                f"{cfg.data.enable_thinking}; the drafter is being served a different template than it learned")
    tokenizer = load_tokenizer(cfg.target.path, cfg.target.trust_remote_code)
    model = load_target(cfg.target.path, dtype, device, cfg.target.attn_implementation, cfg.target.trust_remote_code)
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
    runner = TargetRunner(model, cache)

    def render(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=cfg.data.enable_thinking)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    encoded = [(sid, render(m)) for sid, m in prompts]
    # Serving hands the drafter the target's bf16 hidden states, whatever encoding the store used in training:
    # online tau measures how a drafter trained on (possibly lossy) stored features does on the real ones.
    spec_kw = dict(layer_ids=arch.target_layer_ids, block_size=arch.block_size, stop_ids=stops,
                   feature_encoding="bf16", feature_dtype=dtype)
    # warm-up (untimed): first calls allocate and initialise kernels
    greedy_decode(runner, encoded[0][1], min(8, max_new_tokens), stops)
    speculative_decode(runner, draft_fn, encoded[0][1], max_new_tokens=min(8, max_new_tokens), **spec_kw)
    g_time = s_time = 0.0
    g_fwd = s_fwd = new_tokens = 0
    steps: list[int] = []
    mismatches = []
    per_prompt = []
    for sid, ids in encoded:
        g = greedy_decode(runner, ids, max_new_tokens, stops)
        s = speculative_decode(runner, draft_fn, ids, max_new_tokens=max_new_tokens, **spec_kw)
        g_time += g.seconds
        s_time += s.seconds
        g_fwd += g.forwards
        s_fwd += s.forwards
        new_tokens += len(g.tokens)
        steps += s.steps
        same = g.tokens == s.tokens
        if not same:
            first = next((j for j, (a, b) in enumerate(zip(g.tokens, s.tokens)) if a != b),
                         min(len(g.tokens), len(s.tokens)))
            mismatches.append({"sample_id": sid, "first_difference": first, "greedy": g.tokens, "speculative": s.tokens,
                               "logit_margin": _margin(model, ids + g.tokens[:first], g.tokens, s.tokens, first)})
        per_prompt.append({"sample_id": sid, "prompt_tokens": len(ids), "new_tokens": len(g.tokens),
                           "verify_steps": len(s.steps), "tau": round(sum(s.steps) / max(len(s.steps), 1), 4),
                           "identical": same})
    hist = np.bincount(np.asarray(steps, dtype=np.int64), minlength=arch.block_size + 1)[: arch.block_size + 1]
    result = {
        "target": cfg.target.path,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "cache": runner.policy,
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "enable_thinking": cfg.data.enable_thinking,
        "new_tokens": new_tokens,
        "verify_steps": len(steps),
        "tau": float(sum(steps) / max(len(steps), 1)),
        "tokens_per_target_forward": float(new_tokens / max(s_fwd, 1)),
        "greedy_target_forwards": g_fwd,
        "speculative_target_forwards": s_fwd,
        "greedy_seconds": round(g_time, 4),
        "speculative_seconds": round(s_time, 4),
        "greedy_tokens_per_second": round(new_tokens / max(g_time, 1e-9), 2),
        "speculative_tokens_per_second": round(new_tokens / max(s_time, 1e-9), 2),
        "speedup": float(g_time / max(s_time, 1e-9)),
        "acceptance_histogram": {str(k): int(hist[k]) for k in range(1, arch.block_size + 1)},
        "mismatches": len(mismatches),
        "lossless": not mismatches,
        "mismatch_details": mismatches[:5],
        "per_prompt": per_prompt,
    }
    return result


def _choose_store(store: Optional[str], src: DrafterSource, cfg: Config) -> str:
    if store:
        return store
    if src.store and st.exists(src.store):
        return src.store
    return cfg.store.path


def run_eval(drafter_path: str, config_path: Optional[str] = None, overrides: list[str] | tuple = (),
             store: Optional[str] = None, online: bool = False, out: Optional[str] = None,
             device: Optional[str] = None, cache: str = "auto", max_samples: Optional[int] = 1000,
             threads: Optional[int] = None) -> int:
    overrides = list(overrides)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    drafter, src = load_drafter(drafter_path, "cpu", torch.float32)
    cfg, cfg_source = resolve_config(src, config_path, overrides)
    arch = drafter.arch
    out_dir = Path(out) if out else ((src.run_dir / "eval") if src.run_dir else Path("runs/eval"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "drafter": {"path": str(drafter_path), "kind": src.kind, "block_size": arch.block_size,
                    "target_layer_ids": arch.target_layer_ids, "mask_token_id": arch.mask_token_id,
                    "parameters": sum(p.numel() for p in drafter.parameters())},
        "config": cfg_source,
        "run_dir": str(src.run_dir) if src.run_dir else None,
    }
    store_path = _choose_store(store, src, cfg)
    store_attrs = st.read_root_attrs(store_path)
    encoding = (store_attrs or {}).get("encoding") or src.encoding or cfg.store.encoding
    if store_attrs is not None:
        log(f"eval: offline on {store_path} (drafter: {src.kind} {drafter_path})")
        report["offline"] = run_offline(drafter, store_path, cfg.eval.max_anchors_per_sample, dev,
                                        max_samples=max_samples)
        o = report["offline"]
        log(f"eval: offline tau {o['tau']:.3f} (uniform over {o['blocks']} anchors of {o['samples']} samples; "
            f"from per-slot accuracy {o['tau_from_slot_acc']:.3f}), serving walk {o['serving_walk']['tau']:.3f} "
            f"tokens/step; slot accuracy " + " ".join(f"{a:.2f}" for a in o["slot_accuracy"]))
    elif not online:
        raise EvalError(f"no store at {store_path} for the offline eval; pass --store PATH (or --online to decode "
                        "with the target instead)")
    else:
        log(f"eval: no store at {store_path}; skipping the offline eval")
    code = 0
    if online:
        log(f"eval: online on {cfg.target.path} ({dev}), {cfg.eval.num_prompts} prompts x "
            f"{cfg.eval.max_new_tokens} new tokens")
        report["online"] = r = run_online(drafter, cfg, dev, encoding, cfg.eval.num_prompts, cfg.eval.max_new_tokens,
                                          cache, store_attrs, threads)
        log(f"eval: online tau {r['tau']:.3f} tokens/verify step, {r['tokens_per_target_forward']:.3f} tokens/target "
            f"forward, speedup {r['speedup']:.2f}x over greedy ({r['greedy_tokens_per_second']:.1f} -> "
            f"{r['speculative_tokens_per_second']:.1f} tok/s, cache={r['cache']}, {r['prompts']} prompts, "
            f"{r['new_tokens']} tokens)")
        if r["mismatches"]:
            code = 1
            first = r["mismatch_details"][0]
            log(f"{MISMATCH_BANNER}\neval: BUG: speculative output differs from plain greedy decoding on "
                f"{r['mismatches']} of {r['prompts']} prompts (speculative decoding must be lossless); "
                f"first: {first['sample_id']} at token {first['first_difference']} "
                f"(target logit gap between the two choices: {first['logit_margin']}; ~0 means a "
                f"numerical near-tie, e.g. bf16 kernels; try --set target.dtype=float32)\n{MISMATCH_BANNER}")
        else:
            log(f"eval: lossless: speculative output equals greedy token for token on all {r['prompts']} prompts")
        if "offline" in report:
            o = report["offline"]
            report["online_vs_offline_tau"] = {"vs_serving_walk": round(r["tau"] / o["serving_walk"]["tau"] - 1, 4),
                                               "vs_uniform": round(r["tau"] / o["tau"] - 1, 4)}
            rel = report["online_vs_offline_tau"]
            log(f"eval: online tau is {rel['vs_serving_walk']:+.1%} relative to the offline "
                f"serving walk ({o['serving_walk']['tau']:.3f}), {rel['vs_uniform']:+.1%} "
                f"relative to the uniform offline tau ({o['tau']:.3f})")
    metrics = read_metrics(src.run_dir) if src.run_dir else {}
    if metrics:
        report["training"] = {k: v[-1][1] for k, v in metrics.items() if k.startswith("val/")}
        report["training"]["steps"] = max(s for v in metrics.values() for s, _ in v)
    report["plots"] = write_plots(report, out_dir, metrics)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"eval: report {out_dir / 'report.json'}; plots " + ", ".join(str(out_dir / p) for p in report["plots"]))
    return code
