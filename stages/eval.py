"""`dflash eval`: does the trained drafter accelerate the target? Offline (store only) and online (real decoding).

Contract:
- DRAFTER is an exported directory (config.json + model.safetensors) or a training checkpoint (.ckpt); the
  kind is detected. A drafter inside a run directory (RUN/export, RUN/checkpoints/x.ckpt) finds its run:
  RUN/config.yaml is the default config and RUN/logs/metrics.csv gives the training curves. A checkpoint's
  embedded config gives the drafter and settings but never the target (pipeline.config.CODE_KEYS): `--online`
  with it needs `--set target.path=...` or `--config`, and a found RUN/config.yaml with trust_remote_code is
  refused unless `--set target.trust_remote_code=true` (one line each).
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
- Online (`--online`, stages/eval_online.py): the target (load_target, on CUDA when present, else CPU) greedy-decodes held-out
  prompts (the conversation up to its first assistant turn, from data.validation_files, else the validation
  split of data.train_files) rendered with the chat template, add_generation_prompt=True and
  data.enable_thinking; then decodes them speculatively (stages/speculate.py). Reports tau (tokens per
  verify step), tokens per target forward (prefill included), wall-clock speedup (sum of greedy times / sum of
  speculative times: same machine, same cache policy, same threads, interleaved per prompt after a warm-up)
  and the prompts whose speculative output differs from greedy (must be 0; anything else is a bug: the command
  prints a banner with the target's logit gap at the first difference and exits 1).
- Offline and online tau per context-length bucket (`by_context`, stages/eval_record.py: <512, 512-2K, 2K-8K,
  >8K, where there is data), logged, in the report and plotted.
- Writes OUT/report.json and PNG plots (acceptance histogram, per-slot accuracy, tau by context, training
  curves), and the tau record OUT/dflash_tau.json, also into DRAFTER when it is an export (stages/eval_record.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from torch import Tensor, nn

from pipeline import store as st
from pipeline.acceptance import AcceptanceStats, acceptance_lengths, checkpoint_val_tau, histogram, mean_length
from pipeline.config import Config, resolve_config
from pipeline.drafter import draft_blocks
from pipeline.encoding import decode, from_storage, part_names
from pipeline.masks import anchor_candidates
from pipeline.store_reader import StoreReader
from stages import eval_phases
from stages.eval_online import run_online

from stages.eval_online import MISMATCH_BANNER, EvalError, log  # noqa: F401 - re-exported (cli, tests)


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
    origin: Optional[dict] = None  # which checkpoint: {checkpoint, step, selected: best|last|step, val_tau}
    target: Optional[dict] = None  # what an export records of its target: {name, vocab_size}


def describe_origin(src: DrafterSource) -> str:
    """One line naming what is evaluated: the checkpoint (path, step, best or last, its val tau) or the export
    and the checkpoint it was made from."""
    o = src.origin or {}
    tau = o.get("val_tau")
    what = {"best": "the run's best by val tau", "last": "the run's last", "step": "a periodic step checkpoint"}.get(
        o.get("selected"), "checkpoint kind unknown")
    detail = f"step {o.get('step', '?')}, {what}" + (f", val tau {tau:.3f}" if tau is not None else "")
    if src.kind == "checkpoint":
        return f"checkpoint {src.path} ({detail})"
    if o.get("checkpoint"):
        return f"export {src.path} (from checkpoint {o['checkpoint']}: {detail})"
    return f"export {src.path} (no record of the checkpoint it came from: exported elsewhere or by an older dflash)"


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
        origin = {k: extra[k] for k in ("checkpoint", "step", "selected", "val_tau") if k in extra}
        target = {"name": extra.get("target"), "vocab_size": meta.get("vocab_size")}
        return drafter, DrafterSource(str(p), "export", run_dir, extra.get("store"), None, None, origin, target)
    if p.is_file():
        from stages.export import checkpoint_kind, load_checkpoint_drafter

        drafter, meta = load_checkpoint_drafter(str(p), device)
        drafter = drafter.to(dtype)
        run_dir = p.parent.parent if p.parent.name == "checkpoints" and _looks_like_run(p.parent.parent) else None
        origin = {"checkpoint": str(p.resolve()), "step": meta["step"], "selected": checkpoint_kind(p),
                  "val_tau": checkpoint_val_tau(meta.get("val"), meta["step"])}
        target = {"name": (meta.get("target") or {}).get("name"), "vocab_size": meta.get("vocab_size")}
        return drafter, DrafterSource(str(p), "checkpoint", run_dir, meta.get("store"), meta.get("config"),
                                      meta.get("encoding"), origin, target)
    if p.exists():  # a FIFO, a socket, a device: named as what it is, never opened
        from pipeline.ckpt_io import require_regular

        require_regular(p, "drafter (an exported directory or a training checkpoint)")
    raise FileNotFoundError(f"drafter {path} does not exist: pass an exported directory (RUN/export) or a "
                            "training checkpoint (RUN/checkpoints/last.ckpt)")


def _looks_like_run(d: Path) -> bool:
    return (d / "config.yaml").exists() or (d / "logs" / "metrics.csv").exists()


# ----------------------------------------------------------------------------------------------------------
# offline evaluation
# ----------------------------------------------------------------------------------------------------------


def select_anchors(loss_mask: Tensor, max_anchors: int) -> Tensor:
    """The anchor candidates (pipeline.masks.anchor_candidates); at most max_anchors, evenly spaced over them."""
    cand = anchor_candidates(loss_mask)
    if cand.numel() > max_anchors:
        idx = torch.linspace(0, cand.numel() - 1, max_anchors).round().long().unique()
        cand = cand[idx]
    return cand


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
    contexts: list[tuple[int, int]] = []  # (anchor position, acceptance length) of the uniform anchors
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
            acc_at.update(zip(a.tolist(), acceptance_lengths(d, labels, valid).tolist()))
            if pick.any():
                contexts += zip(a[pick].tolist(), stats.add(d[pick], labels[pick], valid[pick]).tolist())
        if walk:
            walk_steps += serving_walk(acc_at, supervised_runs(mask))
    from stages.eval_record import bucket_taus

    out = stats.summary()
    out["samples"] = n_samples
    out["by_context"] = bucket_taus(contexts)  # uniform tau per context-length bucket (stages/eval_record.py)
    if walk:
        out["serving_walk"] = {
            "tau": mean_length(walk_steps),
            "steps": len(walk_steps),
            "tokens": int(sum(walk_steps)),
            "acceptance_histogram": histogram(walk_steps, bs),
        }
    return out


def store_samples(reader: StoreReader, indices: list[int], device: torch.device, dtype: torch.dtype):
    for i in indices:
        s = reader.read(i)
        parts = {k: from_storage(s[k]).to(device) for k in part_names(reader.encoding)}
        feats = decode(parts, reader.encoding, dtype).flatten(1)  # [S, L*H]
        yield {"tokens": torch.from_numpy(s["tokens"].astype(np.int64)),
               "loss_mask": torch.from_numpy(s["loss_mask"].astype(np.bool_)), "features": feats}


def load_store_head(store_path: str, device, dtype) -> tuple[Tensor, Tensor]:
    head_path = st.frozen_head_path(store_path)
    if not st.exists(head_path):
        raise EvalError(f"{head_path} is missing: the store is incomplete; resume `dflash extract`")
    from pipeline.provenance import check_frozen_head, load_frozen_head

    check_frozen_head(store_path)  # its checksum
    return load_frozen_head(head_path, device, dtype)  # tied: the head is the embedding


def run_offline(drafter: nn.Module, store_path: str, max_anchors: int, device: torch.device,
                dtype: torch.dtype = torch.float32, max_samples: Optional[int] = None) -> dict:
    reader = StoreReader(store_path)
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


def check_eval_store(src: DrafterSource, cfg: Config, attrs: dict, known: bool) -> None:
    """Refuse a store of another target: train's check (stages.train.check_store_matches) against the drafter's
    config when it is known (--config, the run's, the checkpoint's), else against what the export recorded."""
    from pipeline.provenance import export_differences
    from stages.train import check_store_matches, store_mismatch

    if known:
        check_store_matches(cfg, attrs)
        return
    diffs = export_differences(attrs, src.target)
    if diffs:
        raise store_mismatch(diffs, f"the drafter {src.path}")


def _refuse_embedded_target(src: DrafterSource, overrides: list[str]) -> None:
    """The online eval of a checkpoint read with its embedded config: the target comes from the command line, never
    from the checkpoint (a planted one could name a directory or hub id whose code would run)."""
    from pipeline.config import embedded_code_values, on_command_line

    named = embedded_code_values(src.config).get("target.path")
    if named is not None and not on_command_line(overrides, "target", "path"):
        raise EvalError(f"eval --online: {src.path} names target.path {named!r} in its embedded config, and a "
                        "checkpoint never chooses the target (its files could run code); name it yourself: "
                        f"--set target.path=DIR_OR_HUB_ID or --config RUN/config.yaml")


def headline(report: dict) -> str:
    """The one line `dflash eval` prints on stdout: the tau serving will see, online where it was measured (tokens
    per verify step against the target), else the offline serving walk's (the same count replayed on the store)."""
    on, off = report.get("online"), report.get("offline")
    if on:
        how = f"at temperature {on['temperature']}" if on.get("temperature") else "greedy"
        return (f"tau {on['tau']:.3f} tokens per verify step (online, {on['prompts']} prompts {how}, speedup "
                f"{on['speedup']:.2f}x); details on stderr and in {report['path']}")
    walk = off.get("serving_walk") or off
    return (f"tau {walk['tau']:.3f} tokens per verify step (offline serving walk over "
            f"{off['samples']} stored samples; --online measures it against the target); details on stderr and in "
            f"{report['path']}")


def _choose_store(store: Optional[str], src: DrafterSource, cfg: Config) -> str:
    if store:
        return store
    if src.store and st.exists(src.store):
        return src.store
    return cfg.store.path


def startup_line(cfg_source: str, target: Optional[str], store: str, run_dir: Optional[Path], out: Path) -> str:
    """Eval's first line (issue 43): the config it took and from where (saying so when it is the tiny default:
    no --config and no run config.yaml), the target (online only), the store, the run directory and OUT."""
    if cfg_source.endswith("(default)"):
        cfg_source = f"{cfg_source.removesuffix(' (default)')} (no --config and no run config.yaml: the tiny demo config)"
    return (f"eval: config {cfg_source}; target {target or '- (offline only: no --online)'}; store {store}; "
            f"run dir {run_dir or '- (the drafter is not in a run directory)'}; report in {out}")


def run_eval(drafter_path: str, *, config_path: Optional[str] = None, overrides: list[str] | tuple = (),
             store: Optional[str] = None, online: bool = False, out: Optional[str] = None,
             device: Optional[str] = None, cache: str = "auto", max_samples: Optional[int] = 1000,
             threads: Optional[int] = None, as_json: bool = False) -> int:
    """`dflash eval` (the module contract): the drafter and its config resolved, the store checked, then the phases
    of stages/eval_phases.py (offline, online, the outputs) and the headline (or, --json, the report) on stdout.
    The exit code: 1 when speculative output differs from greedy, else 0."""
    overrides = list(overrides)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    drafter, src = load_drafter(drafter_path, "cpu", torch.float32)
    cfg, cfg_source = resolve_config(config_path, overrides,  # --config, else the run's, else the checkpoint's, else tiny
                                     run_config=src.run_dir / "config.yaml" if src.run_dir is not None else None,
                                     embedded=src.config, embedded_source=f"{src.path} (embedded config)")
    embedded = cfg_source == f"{src.path} (embedded config)"
    if embedded and online:
        _refuse_embedded_target(src, overrides)
    out_dir = Path(out) if out else ((src.run_dir / "eval") if src.run_dir else Path("runs/eval"))
    report = eval_phases.drafter_report(drafter=drafter, drafter_path=drafter_path, src=src, cfg_source=cfg_source,
                                        described=describe_origin(src))
    store_path = _choose_store(store, src, cfg)
    log(startup_line(cfg_source, cfg.target.path if online else None, store_path, src.run_dir, out_dir))
    log(f"eval: evaluating {describe_origin(src)}")
    store_attrs = st.read_root_attrs(store_path)
    if store_attrs is not None:  # before anything is written, the same refusal as train's
        # an embedded config has no target.path of its own (pipeline.config.CODE_KEYS): what the drafter recorded
        known = bool(config_path) or not (cfg_source.endswith("(default)") or embedded)
        check_eval_store(src, cfg, store_attrs, known=known)
    encoding = (store_attrs or {}).get("encoding") or src.encoding or cfg.store.encoding
    eval_phases.offline_phase(report=report, run_offline=run_offline, drafter=drafter, src=src,
                              drafter_path=drafter_path, store_path=store_path, store_attrs=store_attrs,
                              online=online, max_anchors=cfg.eval.max_anchors_per_sample, dev=dev,
                              max_samples=max_samples)
    code = 0
    if online:  # run_online looked up here at the call (tests replace stages.eval.run_online)
        code = eval_phases.online_phase(report=report, run_online=run_online, drafter=drafter, cfg=cfg, dev=dev,
                                        encoding=encoding, cache=cache, store_attrs=store_attrs, threads=threads)
    eval_phases.write_outputs(report=report, cfg=cfg, out_dir=out_dir, src=src, store_attrs=store_attrs)
    print(json.dumps(report, indent=1) if as_json else headline(report), flush=True)
    return code
