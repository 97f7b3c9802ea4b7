"""Plots and training curves for `dflash eval`: acceptance-length histogram, per-slot accuracy, tau by
context-length bucket (the report's `by_context`, stages/eval_record.py), and the training curves read from a run's logs/metrics.csv. Matplotlib (the `plots` extra) is imported lazily; without
it the report is still written and the plots are skipped with a note."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import numpy as np


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    path = run_dir / "logs" / "metrics.csv"
    series: dict[str, list[tuple[int, float]]] = {}
    if not path.exists():
        return series
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                try:
                    series.setdefault(key, []).append((step, float(value)))
                except ValueError:
                    continue
    return series


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_name(report: dict) -> str:
    """What the plots are of: the run directory's name, else the drafter's (an export, a checkpoint file)."""
    where = Path(report.get("run_dir") or report["drafter"]["path"])
    return where.name if where.name not in ("export", "checkpoints", "") else where.parent.name


def slot_ylim(*curves) -> tuple[float, float]:
    """A y range that shows how accuracy falls off over the slots (not squashed into [0, 1])."""
    ys = [float(y) for c in curves for y in c]
    lo, hi = min(ys), max(ys)
    pad = max(0.05 * (hi - lo), 0.01)
    return max(0.0, lo - pad), min(1.0, hi + pad)


def write_plots(report: dict, out: Path, metrics: dict) -> list[str]:
    """The PNG plots of the report into `out`, in this order, each where it has data: the acceptance histogram
    (always), per-slot accuracy (offline), tau by context length and the training curves (a run's metrics).
    Returns their file names."""
    plt = _plt()
    name = run_name(report)
    off, on = report.get("offline"), report.get("online")
    bs = report["drafter"]["block_size"]
    files = [plot_acceptance(plt=plt, out=out, name=name, off=off, on=on, bs=bs)]
    if off:
        files.append(plot_slot_accuracy(plt=plt, out=out, name=name, off=off, bs=bs, metrics=metrics,
                                        origin=report["drafter"].get("origin")))
    table = report.get("by_context") or {}
    if table:  # tau per context-length bucket (stages/eval_record.py), the buckets with data, in order
        files.append(plot_by_context(plt=plt, out=out, table=table))
    if metrics:
        files.append(plot_training(plt=plt, out=out, name=name, metrics=metrics))
    return files


def _save(*, plt, fig, out: Path, file: str) -> str:
    """The figure laid out, saved as out/file (110 dpi) and closed; its file name."""
    fig.tight_layout()
    fig.savefig(out / file, dpi=110)
    plt.close(fig)
    return file


def plot_acceptance(*, plt, out: Path, name: str, off: Optional[dict], on: Optional[dict], bs: int) -> str:
    """acceptance_histogram.png: the fraction of blocks (verify steps) per acceptance length 1..bs, one bar series
    each for the offline uniform anchors, the offline serving walk and the online eval, where they ran."""
    ks = np.arange(1, bs + 1)  # [bs] acceptance lengths
    series = []
    if off:
        series.append((f"offline uniform (tau {off['tau']:.2f})", off["acceptance_histogram"]))
        if off.get("serving_walk"):
            series.append((f"offline serving walk (tau {off['serving_walk']['tau']:.2f})",
                           off["serving_walk"]["acceptance_histogram"]))
    if on:
        series.append((f"online (tau {on['tau']:.2f})", on["acceptance_histogram"]))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(len(series), 1)
    for j, (label, hist) in enumerate(series):
        h = np.array([hist.get(str(k), 0) for k in ks], dtype=float)  # [bs] counts
        ax.bar(ks + (j - (len(series) - 1) / 2) * width, h / max(h.sum(), 1), width=width, label=label)
    ax.set_xlabel("tokens per block / verify step (accepted drafts + 1)")
    ax.set_ylabel("fraction of blocks")
    ax.set_xticks(ks)
    ax.set_title(f"{name}: acceptance-length distribution")
    ax.legend(fontsize=8)
    return _save(plt=plt, fig=fig, out=out, file="acceptance_histogram.png")


def plot_slot_accuracy(*, plt, out: Path, name: str, off: dict, bs: int, metrics: dict,
                       origin: Optional[dict]) -> str:
    """slot_accuracy.png: the offline per-slot accuracy, with the training run's last validation per slot unless
    that validation is of the evaluated step itself (origin: the drafter's checkpoint record)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    slots = np.arange(1, bs)  # [bs-1] block slots
    ax.plot(slots, off["slot_accuracy"], "o-", label="offline eval (greedy)")
    val = [v for k, v in sorted(((int(k.rsplit("slot", 1)[1]), v[-1][1]) for k, v in metrics.items()
                                 if k.startswith("val/acc_slot")))]
    val_step = metrics["val/acc_slot1"][-1][0] if "val/acc_slot1" in metrics else None
    same = val_step is not None and val_step == (origin or {}).get("step")
    if len(val) == bs - 1 and not same:  # the evaluated step's own validation would draw the same line again
        ax.plot(slots, val, "s--", alpha=0.7, label=f"training validation (step {val_step})")
    ax.set_ylim(*slot_ylim(off["slot_accuracy"], val if len(val) == bs - 1 and not same else []))
    ax.set_xticks(slots)
    ax.set_xlabel("block slot k (predicts token anchor+k)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{name}: per-slot accuracy")
    ax.legend()
    return _save(plt=plt, fig=fig, out=out, file="slot_accuracy.png")


def plot_by_context(*, plt, out: Path, table: dict) -> str:
    """tau_by_context.png: offline and online tau per context-length bucket (the report's `by_context`), each
    line where it has a value."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = np.arange(len(table))  # [buckets]
    for key, label, style in (("tau_offline", "offline (uniform anchors)", "o-"), ("tau_online", "online", "s-")):
        ys = [np.nan if v[key] is None else v[key] for v in table.values()]
        if not all(np.isnan(ys)):
            ax.plot(xs, ys, style, label=label)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{k}\n(n {v['n']})" for k, v in table.items()])
    ax.set_xlabel("context length (tokens before the block)")
    ax.set_ylabel("tau")
    ax.set_title("tau by context length")
    ax.legend()
    return _save(plt=plt, fig=fig, out=out, file="tau_by_context.png")


def plot_training(*, plt, out: Path, name: str, metrics: dict) -> str:
    """training_curves.png: train and val loss, train and val tau (from per-slot accuracy) over optimizer steps."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, ax in (("train/loss", a1), ("val/loss", a1), ("train/tau", a2), ("val/tau", a2)):
        if key in metrics:
            s, v = zip(*metrics[key])
            ax.plot(s, v, "-" if key.startswith("train") else "o-", label=key)
    for ax, t in ((a1, "loss"), (a2, "tau (from per-slot accuracy)")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(t.split(" (")[0])
        ax.set_title(f"{name}: {t}")
        ax.legend()
    return _save(plt=plt, fig=fig, out=out, file="training_curves.png")
