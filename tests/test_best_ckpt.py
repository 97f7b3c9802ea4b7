"""The best checkpoint by held-out tau (stages/best_checkpoint.py): the selection rule, the callback across a
resume (its state and the files on disk), the export of the best by default (or the last, asked for), the
message naming the one exported, `dflash export RUN`, and `dflash eval` naming what it evaluated."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY, dflash
from pipeline.config import ConfigError
from stages.best_checkpoint import BestCheckpoint, best_files, choose_checkpoint, resolve_checkpoint
from stages.export import checkpoint_kind
from helpers_cli import dflash_all  # independent commands side by side


def _ckpt(path: Path, step: int, tau, val_step=None) -> Path:
    val = {} if tau is None else {"val/tau": tau, "step": step if val_step is None else val_step}
    torch.save({"global_step": step, "dflash": {"step": step, "val": val}}, path)
    return path


def test_choose_best_or_last_and_say_why(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    _ckpt(d / "step40.ckpt", 40, 1.3)
    (d / "last.ckpt").symlink_to("step40.ckpt")
    with pytest.raises(ConfigError, match="best, last"):
        choose_checkpoint(d, "newest")
    c = choose_checkpoint(d)
    assert c.kind == "last" and c.step == 40 and "no best checkpoint" in c.reason  # no validation, no best
    _ckpt(d / "best-step20.ckpt", 20, 1.5)
    c = choose_checkpoint(d)
    assert (c.path.name, c.kind, c.step, c.tau) == ("best-step20.ckpt", "best", 20, 1.5)
    assert c.reason == "step 20 (best val tau 1.500; the last step, 40, had 1.300)"
    c = choose_checkpoint(d, "last")
    assert c.path == d / "last.ckpt" and c.kind == "last" and "as asked" in c.reason and "1.500 at step 20" in c.reason
    _ckpt(d / "step40.ckpt", 40, 1.3, val_step=30)  # last validated before its step: its tau is not claimed
    assert choose_checkpoint(d).reason.endswith("had no validation at that step)")
    assert choose_checkpoint(d, last_tau=1.25).reason.endswith("had 1.250)")  # training knows its final tau
    # a run directory or its checkpoints directory; a file is itself, and --which makes no sense there
    assert resolve_checkpoint(str(tmp_path), None).path.name == "best-step20.ckpt"
    assert resolve_checkpoint(str(d), "last").path.name == "last.ckpt"
    assert resolve_checkpoint(str(d / "step40.ckpt"), None) == d / "step40.ckpt"
    with pytest.raises(ConfigError, match="already one checkpoint"):
        resolve_checkpoint(str(d / "step40.ckpt"), "best")
    assert [checkpoint_kind(d / n) for n in ("best-step20.ckpt", "last.ckpt", "step40.ckpt")] == ["best", "last", "last"]


def test_a_dangling_last_link_takes_the_newest_step_present_and_says_so(tmp_path):
    """last.ckpt naming a removed step file (a crash between the link and the write it named) is read as the
    newest step checkpoint present, the reason says why, and the run directory is left as it was."""
    d = tmp_path / "checkpoints"
    d.mkdir()
    _ckpt(d / "step20.ckpt", 20, None)
    _ckpt(d / "step30.ckpt", 30, None)
    (d / "last.ckpt").symlink_to("step40.ckpt")  # dangling
    c = choose_checkpoint(d, "last")
    assert (c.path.name, c.kind, c.step) == ("step30.ckpt", "last", 30)
    assert "last.ckpt names step40.ckpt, which is missing, so the last step is step30.ckpt" in c.reason
    assert os.readlink(d / "last.ckpt") == "step40.ckpt"  # read only: `dflash train --resume` repairs the link
    assert resolve_checkpoint(str(tmp_path), None).path.name == "step30.ckpt"  # a run directory finds it too
    (d / "last.ckpt").unlink()
    assert "last.ckpt is missing" in choose_checkpoint(d).reason
    for f in d.glob("step*.ckpt"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="train first"):
        choose_checkpoint(d)


class _IO:
    def remove_checkpoint(self, path):  # TorchCheckpointIO's: at once (AsyncCheckpointIO: after the write)
        Path(path).unlink(missing_ok=True)


class _Strategy:
    checkpoint_io = _IO()

    def broadcast(self, obj, src=0):
        return obj


class _Trainer:
    """What BestCheckpoint uses of a Trainer; save_checkpoint writes what the module's hook would record."""

    def __init__(self, module):
        self.is_global_zero, self.sanity_checking, self.global_step = True, False, 0
        self.strategy, self.module = _Strategy(), module

    def save_checkpoint(self, path, weights_only=False):
        assert weights_only  # the best is for export and eval, not for resuming
        torch.save({"dflash": {"step": self.global_step, "val": dict(self.module.last_val)}}, path)


class _Module:
    last_val: dict = {}


def _validate(cb, trainer, step, tau):
    trainer.global_step = step
    trainer.module.last_val = {"val/tau": tau, "step": step}
    cb.on_validation_end(trainer, trainer.module)


def test_callback_keeps_one_best_file_and_remembers_it_across_a_resume(tmp_path):
    m = _Module()
    t = _Trainer(m)
    cb = BestCheckpoint(tmp_path)
    cb.on_train_start(t, m)
    for step, tau in ((10, 1.2), (20, 1.5), (30, 1.4), (40, 1.5), (50, float("nan"))):
        _validate(cb, t, step, tau)
    assert [f.name for f in tmp_path.iterdir()] == ["best-step20.ckpt"]  # ties keep the earlier step
    assert cb.state_dict() == {"tau": 1.5, "step": 20}
    # a resume from a checkpoint written at step 20 *before* that step's validation: its state knew step 10 only.
    # A kill between saving a new best and removing the old one left a beaten file (step 30, 1.4) too.
    _ckpt(tmp_path / "best-step30.ckpt", 30, 1.4)
    _ckpt(tmp_path / "best-step10.ckpt", 10, 1.2)
    resumed = BestCheckpoint(tmp_path)
    resumed.load_state_dict({"tau": 1.2, "step": 10})
    resumed.on_train_start(t, m)
    assert resumed.state_dict() == {"tau": 1.5, "step": 20}
    assert [f.name for f in tmp_path.iterdir()] == ["best-step20.ckpt"]
    _validate(resumed, t, 60, 1.45)  # not better than the best before the resume: nothing written
    assert [(s, tau) for tau, s, _ in best_files(tmp_path)] == [(20, 1.5)]
    _validate(resumed, t, 70, 1.6)
    assert [(s, tau) for tau, s, _ in best_files(tmp_path)] == [(70, 1.6)]


# ------------------------------------------------------------------------------------------------------------
# end to end on the tiny target
# ------------------------------------------------------------------------------------------------------------


def _val_taus(run: Path) -> list[float]:
    with open(run / "logs" / "metrics.csv") as f:
        return [float(r["val/tau"]) for r in csv.DictReader(f) if r.get("val/tau")]


@pytest.mark.slow
def test_best_is_exported_resume_keeps_it_and_eval_names_it(quality_run, tiny_store, tmp_path):
    store = tiny_store  # the session's (tests/conftest.py: 240 samples); training and eval only read it
    common = ["--config", TINY, "--store", store, "--set", "train.num_workers=0", "--set", "train.batch_size=8"]
    # a drafter that has learned something (conftest's quality run, built once per session: tau ~2 offline; this
    # test trained a donor of its own before, tau ~1.2 after 20 steps) ...
    donor = quality_run[1]
    # ... then trained on with a learning rate that rises to 0.05 (warmup over the whole run): it gets worse, so
    # the best validation is an early one, not the last
    run = tmp_path / "run"
    bad_lr = ["--set", f"train.run_dir={run}", "--set", "train.val_every=1", "--set", "train.lr=0.05",
              "--set", "train.warmup_ratio=1.0"]
    r = dflash("train", *common, *bad_lr, "--set", "train.max_steps=8", "--init-from", str(donor / "export"))
    taus = _val_taus(run)
    assert len(taus) == 8, taus  # steps 1..8
    best_i = max(range(8), key=lambda i: (taus[i], -i))  # the highest, the earliest on a tie
    assert best_i < 7, taus  # the rising learning rate made the last validation worse than an earlier one
    step = best_i + 1
    files = best_files(run / "checkpoints")
    assert [(s, round(t, 6)) for t, s, _ in files] == [(step, round(taus[best_i], 6))], (files, taus)
    assert (run / "checkpoints" / "last.ckpt").exists()
    said = re.search(r"train: exported step (\d+) \(best val tau ([0-9.]+); the last step, 8, had ([0-9.]+)\) to (\S+)",
                     r.stderr)
    assert said and int(said.group(1)) == step and float(said.group(2)) == pytest.approx(taus[best_i], abs=1e-3)
    assert float(said.group(3)) == pytest.approx(taus[7], abs=1e-3), r.stderr[-2000:]
    meta = json.loads((run / "export" / "dflash_meta.json").read_text())
    assert meta["selected"] == "best" and meta["step"] == step and meta["checkpoint"].endswith(f"best-step{step}.ckpt")
    assert json.loads((run / "summary.json").read_text())["exported"]["step"] == step
    # a resumed run knows the best so far: its validations write a best file only if they beat it (a run that
    # forgot would write one at its first validation)
    dflash("train", *common, *bad_lr, "--set", "train.max_steps=10", "--resume", "--no-export")
    taus = _val_taus(run)
    assert len(taus) == 10, taus
    best_i = max(range(10), key=lambda i: (taus[i], -i))
    assert [(s, round(t, 6)) for t, s, _ in best_files(run / "checkpoints")] == [(best_i + 1, round(taus[best_i], 6))]
    # four commands that only read the run (eval writes to its --out, and the export's tau record beside the
    # weights, which none of the others reads), side by side: the two exports and the two evals below
    ckpt = run / "checkpoints" / "last.ckpt"
    again, last, ev, ev2 = dflash_all(
        ["export", run, tmp_path / "again"], ["export", run, tmp_path / "last", "--which", "last"],
        ["eval", run / "export", "--store", store, "--max-samples", "4", "--out", tmp_path / "ev"],
        ["eval", ckpt, "--store", store, "--max-samples", "4", "--out", tmp_path / "ev2"])
    # dflash export on the run directory: the best by default, the last when asked
    r = again
    assert f"exported step {best_i + 1} (best val tau" in r.stdout
    r = last
    assert "exported the last step, 10" in r.stdout and "as asked" in r.stdout
    assert json.loads((tmp_path / "last" / "dflash_meta.json").read_text())["selected"] == "last"
    # dflash eval says what it evaluated, in its output and its report
    r = ev
    assert f"eval: evaluating export {run / 'export'} (from checkpoint" in r.stderr
    assert f"step {step}, the run's best by val tau" in r.stderr
    origin = json.loads((tmp_path / "ev" / "report.json").read_text())["drafter"]["origin"]
    assert origin["selected"] == "best" and origin["step"] == step
    r = ev2
    assert f"eval: evaluating checkpoint {ckpt} (step 10, the run's last, val tau" in r.stderr, r.stderr[-2000:]
