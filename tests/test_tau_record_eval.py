"""The τ an export achieved, kept with it (issue 42 items 2 and 6, stages/eval_record.py): `dflash eval` writes
dflash_tau.json beside its report and into the export it evaluated (covered by its checksums), with τ by
context-length bucket and its plot; `dflash export` copies the run's eval of the same step, or records that
nothing was evaluated and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY
from pipeline.config import load_config
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.export import export_drafter
from pipeline.export_dir import CHECKSUMS, verify_checksums
from stages.eval_record import bucket_taus, by_context, online_pairs, record_for_export

pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)


def test_context_buckets_of_offline_anchors_and_online_steps():
    assert bucket_taus([(10, 3), (600, 2), (700, 4), (9000, 1)]) == {
        "<512": {"tau": 3.0, "n": 1}, "512-2K": {"tau": 3.0, "n": 2}, ">8K": {"tau": 1.0, "n": 1}}
    steps = online_pairs([{"prompt_tokens": 500, "acceptance_lengths": [3, 9, 1]}, {"prompt_tokens": 20,
                                                                                   "acceptance_lengths": [2]}])
    assert steps == [(500, 3), (503, 9), (512, 1), (20, 2)]  # a step's context: the tokens before its block
    report = {"offline": {"by_context": bucket_taus([(100, 4), (3000, 2)])}, "online": {"per_prompt": [
        {"prompt_tokens": 500, "acceptance_lengths": [3, 9, 1]}]}}
    assert by_context(report) == {"<512": {"tau_offline": 4.0, "tau_online": 6.0, "n": 3},
                                  "512-2K": {"tau_offline": None, "tau_online": 1.0, "n": 1},
                                  "2K-8K": {"tau_offline": 2.0, "tau_online": None, "n": 1}}


def _export(path: Path) -> Path:
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterArch.from_config(load_config(TINY).drafter, [1, 3, 5]))
    return export_drafter(drafter, None, path, vocab_size=576, num_target_layers=8, tie_word_embeddings=True,
                          dtype="float32")


def test_eval_of_an_export_records_its_tau_there_covered_by_the_checksums(tmp_path, capsys):
    from stages.eval import run_eval

    export = _export(tmp_path / "export")
    out = tmp_path / "eval"
    assert run_eval(str(export), overrides=["eval.num_prompts=2", "eval.max_new_tokens=8"],
                    store=str(tmp_path / "no-store"), online=True, out=str(out), device="cpu") == 0
    first = capsys.readouterr().err.splitlines()[0]  # the start-up line (issue 43): config, target, store, run, OUT
    assert first == (f"eval: config configs/tiny.yaml (no --config and no run config.yaml: the tiny demo config); "
                     f"target {load_config(TINY).target.path}; store {tmp_path / 'no-store'}; "
                     f"run dir - (the drafter is not in a run directory); report in {out}")
    report = json.loads((out / "report.json").read_text())
    beside, inside = (json.loads((d / "dflash_tau.json").read_text()) for d in (out, export))
    assert beside == inside
    assert inside["evaluated"] is True and inside["reason"] is None and inside["tau_offline"] is None  # no store
    assert inside["tau_online"] == report["online"]["tau"] >= 1.0
    assert inside["tokens_per_target_forward"] == report["online"]["tokens_per_target_forward"]
    assert (inside["block_size"], inside["temperature"]) == (8, 0.0)
    assert len(inside["prompt_fingerprint"]) == 64 and len(inside["target_fingerprint"]) == 64
    steps = sum(len(p["acceptance_lengths"]) for p in report["online"]["per_prompt"])
    assert inside["by_context"] == report["by_context"] and list(inside["by_context"]) == ["<512"]
    assert inside["by_context"]["<512"]["n"] == steps and inside["by_context"]["<512"]["tau_offline"] is None
    assert "tau_by_context.png" in report["plots"] and (out / "tau_by_context.png").stat().st_size > 0
    assert "  dflash_tau.json" in (export / CHECKSUMS).read_text() and verify_checksums(export)


def _run_with_eval(tmp_path: Path, step: int) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "eval" / "report.json").write_text(json.dumps({"drafter": {"origin": {"step": step}}}))
    record = {"schema": 1, "evaluated": True, "reason": None, "tau_offline": 2.5, "tau_online": 2.25,
              "tokens_per_target_forward": 2.0, "block_size": 8, "temperature": 0.0, "prompt_fingerprint": "p" * 64,
              "target_fingerprint": "t" * 64, "by_context": {"<512": {"tau_offline": 2.5, "tau_online": 2.25, "n": 9}}}
    (run / "eval" / "dflash_tau.json").write_text(json.dumps(record))
    return run


def test_export_copies_the_runs_eval_of_its_step_or_says_why_there_is_none(tmp_path):
    run = _run_with_eval(tmp_path, step=40)
    ckpt = str(run / "checkpoints" / "best-step40.ckpt")
    same = record_for_export(ckpt, 40, 8)
    assert same["evaluated"] is True and same["tau_online"] == 2.25
    other = record_for_export(str(run / "checkpoints" / "best-step60.ckpt"), 60, 8)  # not a replace on the path:
    # pytest's base directory was once /tmp/pytest-of-root/pytest-40, and the run directory moved with it
    assert other["evaluated"] is False and "measured step 40, not this checkpoint's step 60" in other["reason"]
    (run / "eval" / "dflash_tau.json").unlink()
    none = record_for_export(ckpt, 40, 8)
    assert none["evaluated"] is False and "no `dflash eval` of the run" in none["reason"]
    assert "dflash eval OUT --online" in none["reason"] and none["tau_online"] is None and none["block_size"] == 8
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterArch.from_config(load_config(TINY).drafter, [1, 3, 5]))
    out = export_drafter(drafter, None, tmp_path / "export", tau=none, vocab_size=576, num_target_layers=8,
                         dtype="float32")
    assert json.loads((out / "dflash_tau.json").read_text()) == none
    assert "  dflash_tau.json" in (out / CHECKSUMS).read_text() and verify_checksums(out)


def test_dflash_export_of_a_run_checkpoint_writes_the_runs_record_under_its_checksums(tmp_path):
    from helpers_drafters import tiny_drafter
    from stages.export import export_checkpoint

    run = _run_with_eval(tmp_path, step=3)
    d = tiny_drafter(0, target_layer_ids=[1, 3, 5], sliding_window=6)
    ckpt = run / "checkpoints" / "step3.ckpt"
    torch.save({"global_step": 3, "state_dict": {f"drafter.{k}": v for k, v in d.state_dict().items()},
                "dflash": {"arch": d.arch.to_dict(), "step": 3, "vocab_size": 50,
                           "target": {"num_hidden_layers": 8}}}, ckpt)
    out = export_checkpoint(str(ckpt), str(tmp_path / "export"), dtype="float32")
    record = json.loads((out / "dflash_tau.json").read_text())
    assert record == json.loads((run / "eval" / "dflash_tau.json").read_text()) and record["evaluated"] is True
    assert "  dflash_tau.json" in (out / CHECKSUMS).read_text() and verify_checksums(out)
    (run / "eval" / "dflash_tau.json").unlink()
    again = export_checkpoint(str(ckpt), str(tmp_path / "export"), dtype="float32")
    assert json.loads((again / "dflash_tau.json").read_text())["evaluated"] is False
