"""Inputs that used to end in a traceback are one line naming the input and the fix, exit 2, before any run
directory or store exists (issue 40 item 6; issue 43 item 3: --set typos, a missing target path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import ROOT, TINY  # noqa: E402
from stages.cli import main  # noqa: E402

TINY_TARGET = ROOT / "data" / "assets" / "tiny-target"


def refused(args: list[str], tmp_path: Path, *, command: str = "train") -> str:
    """Run `dflash COMMAND ARGS` in-process with its run dir and store under tmp_path/out; assert exit 2, one
    `error:` line and that nothing was created; return that line."""
    out = tmp_path / "out"
    store = ["--set", f"store.path={out / 's.zarr'}"] if command == "regenerate" else ["--store", str(out / "s.zarr")]
    r = CliRunner().invoke(main, [command, *args, "--set", f"train.run_dir={out / 'run'}", *store])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "\n" not in str(r.exception or "") and not out.exists(), r.output
    return lines[0]


def test_a_duplicate_yaml_key_is_an_error_naming_both_lines(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(Path(TINY).read_text() + "train:\n  lr: 1.0e-3\n")  # a second `train:` section
    line = refused(["--config", str(cfg)], tmp_path)
    assert line.startswith(f"error: {cfg}: key 'train' is given twice in one mapping (lines ")
    assert "keep one of them" in line
    cfg.write_text("train:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 2.0e-3\n")
    assert "key 'lr' is given twice in one mapping (lines 2 and 4)" in refused(["--config", str(cfg)], tmp_path)


@pytest.mark.parametrize("setting,text", [
    ("train.lrr=1e-3", "--set 'train.lrr=1e-3': unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("trian.lr=1e-3", "--set 'trian.lr=1e-3': unknown section 'trian' (did you mean 'train'?)"),
    ("drafter.blok_size=8", "--set 'drafter.blok_size=8': unknown key 'drafter.blok_size' (did you mean "
                            "'drafter.block_size'?)"),
    ("train.epochs=six", "--set 'train.epochs=six': train.epochs: expected an integer, got str 'six'"),
])
def test_a_set_typo_is_blamed_on_the_set_option_with_the_nearest_key(setting, text, tmp_path):
    line = refused(["--config", TINY, "--set", setting], tmp_path)
    assert line.startswith(f"error: {text}"), line
    assert TINY not in line  # the YAML file is not blamed for what --set said


def test_a_yaml_typo_suggests_the_nearest_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  warmup_ratoi: 0.1\n")
    assert refused(["--config", str(cfg)], tmp_path).startswith(
        f"error: {cfg}: unknown key 'train.warmup_ratoi' (did you mean 'warmup_ratio'?)")


@pytest.mark.parametrize("settings,text", [
    (["drafter.block_size=100000"], "drafter.block_size must be in [2, 128]"),
    (["train.packing=true", "train.pack_tokens=1000000"], "train.pack_tokens must be in [1, 131072]"),
    (["train.packing=true", "train.pack_tokens=100000"], "train.pack_tokens (100000) is more than 64 x "
                                                         "data.max_length (256)"),
])
def test_sizes_that_build_tensors_are_bounded_before_anything_is_made(settings, text, tmp_path):
    sets = [w for s in settings for w in ("--set", s)]
    assert text in refused(["--config", TINY, *sets], tmp_path)


def _unreadable_target(tmp_path: Path) -> Path:
    d = tmp_path / "no-config-target"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")  # a directory, but not a checkpoint: no config.json
    return d


@pytest.mark.parametrize("command", ["extract", "regenerate"])
@pytest.mark.parametrize("kind", ["missing", "file", "no config.json"])
def test_a_bad_target_path_is_one_line_naming_the_path_and_the_key(command, kind, tmp_path):
    target = {"missing": tmp_path / "typo" / "Qwen3-8B", "file": Path(TINY),
              "no config.json": _unreadable_target(tmp_path)}[kind]
    extra = ["--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out" / "regen")] \
        if command == "regenerate" else ["--shards", "1"]
    line = refused(["--config", TINY, "--set", f"target.path={target}", *extra], tmp_path, command=command)
    assert line.startswith(f"error: target.path {target} ")
    assert {"missing": "does not exist", "file": "is not a directory", "no config.json": "has no config.json"}[kind] in line
    assert "set target.path (in the config or --set target.path=DIR)" in line


@pytest.mark.parametrize("edit,text", [
    (lambda cfg: "{not json", "its config.json is not readable JSON (Expecting property name"),
    (lambda cfg: cfg.replace('"num_hidden_layers": 8', '"num_hidden_layers": "eight"'),
     "transformers cannot load its config and tokenizer (StrictDataclassFieldValidationError: Validation error for "
     "field 'num_hidden_layers':"),
])
def test_a_target_config_json_with_odd_values_is_one_line(edit, text, tmp_path):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target, ignore=shutil.ignore_patterns("*.safetensors"))  # the weights are not read
    original = (target / "config.json").read_text()
    assert '"num_hidden_layers": 8' in original
    (target / "config.json").write_text(edit(original))
    line = refused(["--config", TINY, "--shards", "1", "--set", f"target.path={target}"], tmp_path, command="extract")
    assert line.startswith(f"error: target.path {target}") and text in line, line


def test_a_target_layer_past_the_targets_depth_is_refused_before_the_store_is_made(tmp_path):
    line = refused(["--config", TINY, "--shards", "1", "--set", "target.layer_ids=[1,3,50]",
                    "--set", "data.max_samples=8"], tmp_path, command="extract")
    assert line == ("error: target.layer_ids [50] out of range for a target with 8 layers: use ids in 0..7, or leave "
                    "target.layer_ids unset (target.num_feature_layers picks them)")


def test_every_stage_starts_with_one_line_naming_config_target_store_and_run_dir(tmp_path, monkeypatch):
    """The tiny config only when no --config is given, and then the line says so (issue 43 item 3)."""
    monkeypatch.chdir(tmp_path)
    store, run, target = tmp_path / "nowhere.zarr", tmp_path / "run", TINY_TARGET
    r = CliRunner().invoke(main, ["train", "--store", str(store), "--set", f"train.run_dir={run}"])
    assert r.output.splitlines()[0] == (f"train: config {TINY} (no --config given: the tiny demo config); target "
                                        f"{target}; store {store}; run dir {run}")
    assert r.exit_code == 2 and f"no store at {store}" in r.output and not run.exists()
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(Path(TINY).read_text().replace("runs/tiny/store.zarr", str(store)))
    r = CliRunner().invoke(main, ["extract", "--config", str(cfg), "--plan", "--set", "data.max_samples=8"])
    assert r.output.splitlines()[0] == f"extract: config {cfg}; target {target}; store {store}; run dir runs/tiny/train"


@pytest.mark.parametrize("port", ["abc", "99999", "0"])
def test_a_master_port_that_is_no_tcp_port_is_refused_before_the_run_dir(port, tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", port)
    line = refused(["--config", TINY, "--devices", "2"], tmp_path)
    assert line == (f"error: MASTER_PORT={port!r} is not a TCP port: set it to a free port in 1..65535 (node 0's, "
                    "the same on every node), or unset it for a one-node run")


def _export(tmp_path: Path) -> Path:
    import torch

    from pipeline.config import load_config
    from pipeline.drafter import DFlashDrafter, DrafterArch
    from pipeline.export import export_drafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterArch.from_config(load_config(TINY).drafter, [1, 3, 5]))
    out = export_drafter(drafter, None, tmp_path / "export", vocab_size=576, num_target_layers=8, dtype="float32")
    (out / "checksums.sha256").unlink()  # a hand-edited export: its checksums would name the edit first
    return out


def test_an_exports_value_of_the_wrong_type_is_not_offered_as_a_set_fix(tmp_path):
    import json

    from pipeline.config import load_config
    from stages.init_from import differences

    meta = json.loads((_export(tmp_path) / "config.json").read_text())
    meta["num_attention_heads"], meta["head_dim"] = [4], "32"
    text = "\n".join(differences(load_config(TINY), {"hidden_size": 128, "target": {"vocab_size": 576}}, [1, 3, 5],
                                 meta))
    assert "--set drafter.num_attention_heads" not in text and "--set drafter.head_dim" not in text
    assert ("drafter.num_attention_heads: the export's config.json has [4], not an integer: the export is damaged or "
            "was edited; export its run again (`dflash export RUN DIR`)") in text
    assert "drafter.head_dim: the export's config.json has \"32\", not an integer" in text


@pytest.mark.parametrize("damage", ["header", "config.json"])
def test_eval_of_a_damaged_export_is_one_line_before_its_report_dir(damage, tmp_path):
    export = _export(tmp_path)
    if damage == "header":  # a header length far past the file's end
        with open(export / "model.safetensors", "r+b") as f:
            f.write(b"\xff\xff\xff\xff\x00\x00\x00\x00")
        where = f"{export / 'model.safetensors'} is not a readable safetensors file (Error while deserializing header"
    else:
        (export / "config.json").write_text('{"architectures": ["DFlashDraftModel"], ')
        where = f"{export / 'config.json'} is not readable JSON ("
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["eval", str(export), "--config", TINY, "--out", str(out), "--device", "cpu"])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert r.exit_code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {where}"), r.output
    assert errors[0].endswith("the export is damaged or was edited: export the run again (`dflash export RUN DIR`)")
    assert not out.exists()


@pytest.mark.slow  # the session's tiny store (tests/conftest.py), extracted once
def test_train_refuses_a_target_layer_past_the_stores_target_before_the_run_dir(tiny_store, tmp_path):
    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--config", TINY, "--store", tiny_store, "--set", f"train.run_dir={run}",
                                  "--set", "target.layer_ids=[1,3,50]"])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert r.exit_code == 2 and errors == [
        "error: target.layer_ids [50] out of range for a target with 8 layers: use ids in 0..7, or leave "
        "target.layer_ids unset (target.num_feature_layers picks them)"], r.output
    assert not run.exists()


@pytest.mark.parametrize("command", ["export", "eval"])
def test_a_checkpoint_arch_with_an_unknown_key_is_one_line_before_any_output(command, tmp_path):
    import torch

    from helpers_drafters import tiny_drafter

    d = tiny_drafter(0, target_layer_ids=[1, 3, 5], sliding_window=6)
    ckpt = tmp_path / "x.ckpt"
    torch.save({"global_step": 3, "state_dict": {f"drafter.{k}": v for k, v in d.state_dict().items()},
                "dflash": {"arch": {**d.arch.to_dict(), "rope_scalling": 2.0}, "step": 3, "vocab_size": 50,
                           "target": {"num_hidden_layers": 8}}}, ckpt)
    out = tmp_path / "out"
    args = [str(ckpt), str(out)] if command == "export" else [str(ckpt), "--config", TINY, "--out", str(out)]
    r = CliRunner().invoke(main, [command, *args])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert errors[0].startswith(f"error: {ckpt}: its stored architecture is not one a drafter can have (")
    assert "unexpected keyword argument 'rope_scalling'" in errors[0] and not out.exists()
