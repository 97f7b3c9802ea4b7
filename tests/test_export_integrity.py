"""Exports that protect what they hold (issue 40 item 5): checksums.sha256 must list every weight, config and
code file; a non-finite weight is refused at load by tensor name, by eval and by --init-from, even with a
rewritten checksum file; the best-checkpoint scan names the best-step files it skipped and why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers_cli import TINY
from pipeline.config import load_config
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.export import export_drafter
from pipeline.export_dir import CHECKSUMS, ExportError, write_checksums
from stages.best_checkpoint import choose_checkpoint
from stages.eval import load_drafter
from stages.init_from import check_init_from

IDS = [1, 3, 5]
ATTRS = {"hidden_size": 128, "target": {"vocab_size": 576}}  # the tiny store's


@pytest.fixture()
def export(tmp_path) -> Path:
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterArch.from_config(load_config(TINY).drafter, IDS))
    return export_drafter(drafter, None, tmp_path / "export", vocab_size=576, num_target_layers=8, dtype="float32")


def _drop_entry(export: Path, name: str) -> None:
    listed = export / CHECKSUMS
    lines = [line for line in listed.read_text().splitlines(keepends=True) if not line.endswith(f"  {name}\n")]
    listed.write_text("".join(lines))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "modeling_dflash.py"])
def test_a_checksum_file_that_leaves_out_a_weight_config_or_code_file_is_refused(export, name):
    _drop_entry(export, name)
    with pytest.raises(ExportError, match=f"{name} is not covered by .*checksums.sha256"):
        load_drafter(str(export))  # eval's loader
    with pytest.raises(ExportError, match=f"^--init-from: .*{name} is not covered"):
        check_init_from(load_config(TINY), ATTRS, IDS, str(export))


def test_a_file_added_beside_the_listed_ones_is_refused_too(export):
    (export / "dflash_tau.json").write_text("{}\n")  # written after the checksums, never listed
    with pytest.raises(ExportError, match="dflash_tau.json is not covered"):
        load_drafter(str(export))
    write_checksums(export)
    load_drafter(str(export))  # listed: accepted


def test_a_nan_weight_with_a_rewritten_checksum_file_is_refused_by_name(export):
    f = export / "model.safetensors"
    state = load_file(str(f))
    state["layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(state, str(f), metadata={"format": "pt"})
    write_checksums(export)  # the damage re-blessed: the checksums alone no longer catch it
    with pytest.raises(ExportError, match=r"tensor layers\.1\.mlp\.up_proj\.weight holds 1 non-finite value"):
        load_drafter(str(export))
    with pytest.raises(ExportError, match=r"^--init-from: .*tensor layers\.1\.mlp\.up_proj\.weight holds 1 non-finite"):
        check_init_from(load_config(TINY), ATTRS, IDS, str(export))


def _ckpt(path: Path, step: int, tau) -> Path:
    torch.save({"global_step": step, "dflash": {"step": step, "val": {"val/tau": tau, "step": step}}}, path)
    return path


def test_the_best_checkpoint_scan_names_what_it_skipped_and_why(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    _ckpt(d / "step40.ckpt", 40, 1.3)
    (d / "last.ckpt").symlink_to("step40.ckpt")
    (d / "best-step20.ckpt").symlink_to(_ckpt(tmp_path / "elsewhere.ckpt", 20, 1.5))
    (d / "best-step30.ckpt").write_bytes(b"not a checkpoint at all")
    c = choose_checkpoint(d)
    assert c.kind == "last" and c.step == 40
    assert "had no validation" not in c.reason
    assert "best-step20.ckpt (a symlink" in c.reason and "best-step30.ckpt (refused: " in c.reason
