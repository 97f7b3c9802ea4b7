"""Warm start (`dflash train --init-from EXPORT_DIR`, stages/init_from.py): the drafter starts from the export's
exact weights with a fresh optimizer; an export that does not fit the config/store is refused before anything
is written, naming each field and its fix; --init-from with --resume is refused; DFlash 2 exports fit only a
DFlash 2 drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY, dflash
from pipeline.config import ConfigError, load_config
from pipeline.train_step import build_drafter
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.export import export_drafter
from stages.init_from import check_init_from, differences

pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)

IDS = [1, 3, 5]  # the tiny config's target layers
ATTRS = {"hidden_size": 128, "target": {"vocab_size": 576}}  # the tiny store's


def _export(tmp_path: Path, seed: int = 7, name: str = "donor", **changes) -> tuple[Path, DFlashDrafter]:
    cfg = load_config(TINY)
    for k, v in changes.items():
        setattr(cfg.drafter, k, v)
    torch.manual_seed(seed)
    ids = changes.pop("layer_ids", IDS)
    donor = DFlashDrafter(DrafterArch.from_config(cfg.drafter, ids))
    out = export_drafter(donor, None, tmp_path / name, vocab_size=576, num_target_layers=8, dtype="float32")
    return out, donor


def test_init_from_gives_the_exports_exact_weights(tmp_path):
    out, donor = _export(tmp_path)
    cfg = load_config(TINY, [f"drafter.init_from={out}"])
    torch.manual_seed(0)  # another seed than the donor's: only the copy can make them equal
    drafter = build_drafter(cfg, IDS, 576)
    theirs = donor.state_dict()
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, theirs[k]), k
    torch.manual_seed(0)
    fresh = build_drafter(load_config(TINY), IDS, 576)
    assert not torch.equal(fresh.state_dict()["fc.weight"], theirs["fc.weight"])  # the default still starts fresh


def test_every_misfit_is_named_with_its_fix(tmp_path):
    cfg = load_config(TINY)
    out, _ = _export(tmp_path, block_size=16, num_hidden_layers=3, layer_types=None, intermediate_size=256)
    meta = json.loads((out / "config.json").read_text())
    meta["dflash_config"]["target_layer_ids"] = [1, 4, 6]
    meta["vocab_size"] = 1000
    meta["hidden_size"] = 256
    text = "\n".join(differences(cfg, ATTRS, IDS, meta))
    for field in ("hidden size: the export has 256", "target layer ids: the export conditions on [1, 4, 6]",
                  "target.layer_ids=[1, 4, 6]", "vocabulary: the export was made for 1000 tokens",
                  "drafter.num_hidden_layers: the export has 3", "--set drafter.num_hidden_layers=3",
                  "drafter.block_size: the export has 16", "drafter.intermediate_size: the export has 256",
                  "drafter.layer_types: the export has"):
        assert field in text, (field, text)
    same, _ = _export(tmp_path, name="same")
    check_init_from(cfg, ATTRS, IDS, str(same))  # a fitting export passes
    with pytest.raises(ConfigError, match="not an exported drafter"):
        check_init_from(cfg, ATTRS, IDS, str(tmp_path))


def test_dflash2_export_fits_only_a_dflash2_drafter(tmp_path):
    cfg2 = load_config(TINY, ["drafter.arch=dflash2", "drafter.dflash2.selector_top_k=4", "drafter.dflash2.selector_rank=8"])
    torch.manual_seed(3)
    donor2 = build_drafter(cfg2, IDS, 576)
    out2 = export_drafter(donor2, None, tmp_path / "d2", vocab_size=576, num_target_layers=8, dtype="float32")
    text = "\n".join(differences(load_config(TINY), ATTRS, IDS, json.loads((out2 / "config.json").read_text())))
    assert "drafter.arch: the export is a DFlash 2 drafter" in text and "--set drafter.arch=dflash2" in text
    with pytest.raises(ConfigError, match="DFlash 2 export"):
        build_drafter(load_config(TINY, [f"drafter.init_from={out2}"]), IDS, 576)
    cfg2b = load_config(TINY, ["drafter.arch=dflash2", "drafter.dflash2.selector_top_k=4", "drafter.dflash2.selector_rank=8",
                               f"drafter.init_from={out2}"])
    assert not differences(cfg2b, ATTRS, IDS, json.loads((out2 / "config.json").read_text()))
    torch.manual_seed(0)
    got = build_drafter(cfg2b, IDS, 576).state_dict()
    for k, v in donor2.state_dict().items():  # every weight, the convolutions and the selector too
        assert torch.equal(got[k], v), k


# small_store: the session's one-shard 48-sample store (tests/conftest.py)
def _train(store, run, *extra, check=True):
    return dflash("train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set",
                  "train.num_workers=0", "--set", "train.batch_size=8", "--no-export", *extra, check=check)


@pytest.mark.slow
def test_cli_starts_from_the_export_and_refuses_misfits_and_resume(small_store, tmp_path):
    out, donor = _export(tmp_path)
    run = tmp_path / "warm"
    # lr 0: the one optimizer step changes nothing, so the checkpoint holds the weights training started from
    r = _train(small_store, run, "--init-from", str(out), "--set", "train.max_steps=1", "--set", "train.lr=0.0")
    assert f"starting from the weights of {out}" in r.stderr
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    theirs = donor.state_dict()
    for k, v in ckpt["state_dict"].items():
        assert torch.equal(v, theirs[k.removeprefix("drafter.")]), k
    assert ckpt["dflash"]["config"]["drafter"]["init_from"] == str(out)
    assert ckpt["optimizer_states"][0]["state"][0]["step"] == 1  # a fresh optimizer: one step, not the donor's
    r = _train(small_store, run, "--init-from", str(out), "--resume", check=False)
    assert r.returncode == 2 and "--init-from" in r.stderr and "--resume" in r.stderr and "not both" in r.stderr
    bad, _ = _export(tmp_path, name="bad", num_hidden_layers=3, layer_types=None)
    fresh = tmp_path / "refused"
    r = _train(small_store, fresh, "--init-from", str(bad), check=False)
    assert r.returncode == 2 and "drafter.num_hidden_layers: the export has 3" in r.stderr, r.stderr[-2000:]
    assert not fresh.exists()  # nothing written
