"""`dflash eval`'s plots (issue 43 item 3): each names the run and labels both axes, the slot-accuracy plot's y range
shows the fall-off over the slots, and the training validation line is drawn only where it is not the evaluated
step's own (the same line twice)."""

from __future__ import annotations

import pytest

from stages import eval_plots


def _report(step: int) -> dict:
    hist = {"1": 6, "2": 3, "3": 1}
    return {"run_dir": "/somewhere/runs/my-run",
            "drafter": {"path": "/somewhere/runs/my-run/checkpoints/last.ckpt", "block_size": 4,
                        "origin": {"step": step}},
            "offline": {"tau": 1.5, "acceptance_histogram": hist, "slot_accuracy": [0.16, 0.14, 0.12],
                        "serving_walk": {"tau": 1.6, "acceptance_histogram": hist}}}


METRICS = {**{f"val/acc_slot{k}": [(6, 0.1), (12, 0.2 - 0.02 * k)] for k in (1, 2, 3)},
           "train/loss": [(5, 5.0), (10, 4.5), (12, 4.4)], "val/loss": [(6, 4.8), (12, 4.3)],
           "train/tau": [(5, 1.1), (10, 1.2), (12, 1.2)], "val/tau": [(6, 1.1), (12, 1.2)]}


def _figures(report: dict, tmp_path, monkeypatch) -> dict:
    """write_plots' figures, kept open: {file name: figure}."""
    plt = eval_plots._plt()
    saved: dict = {}
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    real = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: (saved.__setitem__(path.name, fig),
                                                                         real(fig, path, **kw)))
    files = eval_plots.write_plots(report, tmp_path, METRICS)
    assert sorted(saved) == sorted(files) and all((tmp_path / f).stat().st_size > 0 for f in files)
    return saved


def test_plots_name_the_run_label_the_axes_and_show_the_fall_off(tmp_path, monkeypatch):
    figs = _figures(_report(step=12), tmp_path, monkeypatch)
    try:
        assert {"acceptance_histogram.png", "slot_accuracy.png", "training_curves.png"} <= set(figs)
        for name, fig in figs.items():
            for ax in fig.axes:
                assert ax.get_title().startswith("my-run: "), (name, ax.get_title())
                assert ax.get_xlabel() and ax.get_ylabel(), (name, ax.get_title())
        slot = figs["slot_accuracy.png"].axes[0]
        lo, hi = slot.get_ylim()
        assert 0.1 < lo < 0.12 and 0.16 < hi < 0.2  # not [0, 1]: 0.16 -> 0.12 is visible
        assert [ln.get_label() for ln in slot.get_lines()] == ["offline eval (greedy)"]  # step 12's val: the same
    finally:
        eval_plots._plt().close("all")


def test_another_steps_validation_is_drawn_beside_the_eval(tmp_path, monkeypatch):
    figs = _figures(_report(step=6), tmp_path, monkeypatch)
    try:
        slot = figs["slot_accuracy.png"].axes[0]
        assert [ln.get_label() for ln in slot.get_lines()] == ["offline eval (greedy)", "training validation (step 12)"]
        assert slot.get_ylim()[1] >= 0.18  # the validation's 0.18 is in range too
    finally:
        eval_plots._plt().close("all")
