"""`dflash eval`'s phases, run in order by stages/eval.py's `run_eval` once the drafter is loaded, its config
resolved and the store checked: the report's drafter section (`drafter_report`), the offline eval on the store
(`offline_phase`), the online eval against the target (`online_phase`), then the report, plots and τ record
(`write_outputs`); `run_eval` prints the headline last.

Contract:
- The phases print the lines `dflash eval` always printed (stderr, through `log`), in the same order, and raise
  the same `EvalError`s; none of them writes a file before `write_outputs`, which creates OUT only then (a
  refused drafter or store leaves nothing behind).
- `offline_phase` and `online_phase` are handed the stage's own `run_offline` and `run_online` (keyword
  arguments, looked up in stages/eval.py at the call: tests replace them there); this module imports nothing of
  stages/eval.py (no import circle).
- `online_phase` returns the exit code: 1 when a speculative output differs from greedy (the banner says so), else 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from pipeline.config import Config
from stages.eval_online import MISMATCH_BANNER, EvalError, log
from stages.eval_plots import read_metrics, write_plots


def drafter_report(*, drafter: nn.Module, drafter_path: str, src, cfg_source: str, described: str) -> dict:
    """The report's first keys: the drafter (src: eval's DrafterSource; described: its `describe_origin` line),
    the config it was evaluated with and its run directory."""
    arch = drafter.arch
    return {
        "drafter": {"path": str(drafter_path), "kind": src.kind, "block_size": arch.block_size,
                    "target_layer_ids": arch.target_layer_ids, "mask_token_id": arch.mask_token_id,
                    "is_causal": arch.is_causal,  # the attention rule inside the block it was drafted with
                    "parameters": sum(p.numel() for p in drafter.parameters()),
                    "origin": src.origin, "described": described},
        "config": cfg_source,
        "run_dir": str(src.run_dir) if src.run_dir else None,
    }


def offline_phase(*, report: dict, run_offline: Callable[..., dict], drafter: nn.Module, src, drafter_path: str,
                  store_path: str, store_attrs: Optional[dict], online: bool, max_anchors: int, dev: torch.device,
                  max_samples: Optional[int]) -> None:
    """The offline eval into report["offline"] when the store exists (its summary logged); without a store, a
    refusal unless the eval is online, which goes on without it."""
    if store_attrs is not None:
        log(f"eval: offline on {store_path} (drafter: {src.kind} {drafter_path})")
        report["offline"] = o = run_offline(drafter, store_path, max_anchors, dev, max_samples=max_samples)
        log(f"eval: offline tau {o['tau']:.3f} (uniform over {o['blocks']} anchors of {o['samples']} samples; "
            f"from per-slot accuracy {o['tau_from_slot_acc']:.3f}), serving walk {o['serving_walk']['tau']:.3f} "
            f"tokens/step; slot accuracy " + " ".join(f"{a:.2f}" for a in o["slot_accuracy"]))
    elif not online:
        raise EvalError(f"no store at {store_path} for the offline eval; pass --store PATH (or --online to decode "
                        "with the target instead)")
    else:
        log(f"eval: no store at {store_path}; skipping the offline eval")


def online_phase(*, report: dict, run_online: Callable[..., dict], drafter: nn.Module, cfg: Config,
                 dev: torch.device, encoding: str, cache: str, store_attrs: Optional[dict],
                 threads: Optional[int]) -> int:
    """The online eval into report["online"], its summary and verdict logged, and its tau against the offline
    one's when both ran. The exit code: 1 when speculative output differs from greedy, else 0."""
    log(f"eval: online on {cfg.target.path} ({dev}), {cfg.eval.num_prompts} prompts x "
        f"{cfg.eval.max_new_tokens} new tokens")
    report["online"] = r = run_online(drafter, cfg, dev, encoding, cfg.eval.num_prompts, cfg.eval.max_new_tokens,
                                      cache, store_attrs, threads)
    base = "plain sampling" if r.get("temperature") else "greedy"
    log(f"eval: online tau {r['tau']:.3f} tokens/verify step, {r['tokens_per_target_forward']:.3f} tokens/target "
        f"forward, speedup {r['speedup']:.2f}x over {base} ({r['greedy_tokens_per_second']:.1f} -> "
        f"{r['speculative_tokens_per_second']:.1f} tok/s, cache={r['cache']}, {r['prompts']} prompts, "
        f"{r['new_tokens']} tokens)")
    code = verdict(online=r)
    if "offline" in report:
        compare_online_offline(report=report)
    return code


def verdict(*, online: dict) -> int:
    """The online eval's verdict logged: a mismatch banner (exit code 1), sampling's lossless-in-distribution
    note, or greedy's token-for-token equality (0)."""
    r = online
    if r["mismatches"]:
        first = r["mismatch_details"][0]
        log(f"{MISMATCH_BANNER}\neval: BUG: speculative output differs from plain greedy decoding on "
            f"{r['mismatches']} of {r['prompts']} prompts (speculative decoding must be lossless); "
            f"first: {first['sample_id']} at token {first['first_difference']} "
            f"(target logit gap between the two choices: {first['logit_margin']}; ~0 means a "
            f"numerical near-tie, e.g. bf16 kernels; try --set target.dtype=float32)\n{MISMATCH_BANNER}")
        return 1
    if r.get("temperature"):
        log(f"eval: sampled at temperature {r['temperature']} (top-p {r['top_p']}): lossless by the rejection "
            "rule in distribution; outputs are not compared token for token")
    else:
        log(f"eval: lossless: speculative output equals greedy token for token on all {r['prompts']} prompts")
    return 0


def compare_online_offline(*, report: dict) -> None:
    """report["online_vs_offline_tau"]: online tau relative to the offline serving walk's and uniform tau, logged."""
    r, o = report["online"], report["offline"]
    report["online_vs_offline_tau"] = {"vs_serving_walk": round(r["tau"] / o["serving_walk"]["tau"] - 1, 4),
                                       "vs_uniform": round(r["tau"] / o["tau"] - 1, 4)}
    rel = report["online_vs_offline_tau"]
    log(f"eval: online tau is {rel['vs_serving_walk']:+.1%} relative to the offline "
        f"serving walk ({o['serving_walk']['tau']:.3f}), {rel['vs_uniform']:+.1%} "
        f"relative to the uniform offline tau ({o['tau']:.3f})")


def write_outputs(*, report: dict, cfg: Config, out_dir: Path, src, store_attrs: Optional[dict]) -> None:
    """tau by context and the training run's last validation into the report; then OUT created (only now), the
    plots, OUT/report.json and the tau record written and logged; report["path"] set for the headline."""
    from stages.eval_record import by_context, describe_by_context, record_eval

    report["by_context"] = by_context(report)
    if report["by_context"]:
        log(f"eval: {describe_by_context(report['by_context'])}")
    metrics = read_metrics(src.run_dir) if src.run_dir else {}
    if metrics:
        report["training"] = {k: v[-1][1] for k, v in metrics.items() if k.startswith("val/")}
        report["training"]["steps"] = max(s for v in metrics.values() for s, _ in v)
    out_dir.mkdir(parents=True, exist_ok=True)  # only now: a refused drafter or store leaves nothing behind
    report["plots"] = write_plots(report, out_dir, metrics)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log("eval: tau record " + ", ".join(str(p) for p in record_eval(report, cfg, out_dir, src, store_attrs)))
    log(f"eval: report {out_dir / 'report.json'}; plots " + ", ".join(str(out_dir / p) for p in report["plots"]))
    report["path"] = str(out_dir / "report.json")  # stdout: one headline tau, or (--json) the whole report
