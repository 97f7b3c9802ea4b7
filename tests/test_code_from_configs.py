"""A config never comes from a file the user did not name as a config (issue 40 item 1; pipeline/config.py
CODE_KEYS): a checkpoint's embedded config carries the drafter but never target.path, trust_remote_code or another
key that loads code, in eval, export, --init-from and --resume; a run directory's config.yaml found by eval may
not turn trust_remote_code on unless the command line says so. Each planted file points target.path at a
directory whose Python modules write a marker file when imported: the marker must never appear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY
from pipeline.config import ConfigError, dump_config, load_config, resolve_config
from pipeline.drafter import DFlashDrafter, DrafterArch
from stages.eval import EvalError, run_eval

pytestmark = pytest.mark.usefixtures("one_thread")
CODE = "open({marker!r}, 'w').write('imported')\nclass Evil: pass\n"


def evil_target(d: Path) -> tuple[Path, Path]:
    """(a target directory whose config, model and tokenizer name its own module, the marker that module writes)."""
    d.mkdir(parents=True)
    marker = d.parent / f"{d.name}-imported"
    (d / "evil.py").write_text(CODE.format(marker=str(marker)))
    auto = {"AutoConfig": "evil.Evil", "AutoModel": "evil.Evil", "AutoModelForCausalLM": "evil.Evil"}
    (d / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": auto, "architectures": ["Evil"]}))
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Evil", None]}}))
    return d, marker


def planted_config(target: Path) -> dict:
    cfg = load_config(TINY).to_dict()
    cfg["target"].update(path=str(target), trust_remote_code=True, attn_implementation="kernels-community/evil")
    return cfg


def plant_checkpoint(path: Path, config: dict) -> Path:
    """A dflash training checkpoint of a fresh tiny drafter whose embedded config is `config`."""
    cfg = load_config(TINY)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterArch.from_config(cfg.drafter, [1, 3, 5]))
    target = {"name": cfg.target.name, "num_hidden_layers": 8, "vocab_size": 576, "tie_word_embeddings": True}
    meta = {"config": config, "arch": drafter.arch.to_dict(), "target": target, "vocab_size": 576, "step": 3,
            "layer_ids": [1, 3, 5], "encoding": "bf16", "store": str(path.parent / "no-store"), "val": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 3, "dflash": meta,
                "state_dict": {f"drafter.{k}": v for k, v in drafter.state_dict().items()}}, path)
    return path


def _eval(drafter: Path, tmp_path: Path, *sets: str) -> int:
    return run_eval(str(drafter), overrides=["eval.num_prompts=1", "eval.max_new_tokens=2", *sets], online=True,
                    store=str(tmp_path / "no-store"), out=str(tmp_path / "ev"), device="cpu")


def test_an_embedded_config_never_gives_the_target_or_its_code(tmp_path):
    evil, marker = evil_target(tmp_path / "evil")
    embedded = planted_config(evil)
    embedded["drafter"]["init_from"] = str(evil)
    cfg, source = resolve_config(None, ["train.seed=5"], embedded=embedded, embedded_source="x.ckpt (embedded config)")
    assert source == "x.ckpt (embedded config)" and cfg.train.seed == 5
    tiny = load_config(TINY)
    assert (cfg.target.path, cfg.target.trust_remote_code, cfg.target.attn_implementation) == (
        tiny.target.path, False, "sdpa")
    assert cfg.drafter.init_from is None and cfg.drafter.hidden_size == tiny.drafter.hidden_size
    cfg, _ = resolve_config(None, [f"target.path={tiny.target.path}", "target.trust_remote_code=true"],
                            embedded=embedded)  # what the command line says is taken
    assert cfg.target.path == tiny.target.path and cfg.target.trust_remote_code
    assert embedded["target"]["path"] == str(evil)  # the checkpoint's own dict is left as it was
    assert not marker.exists()


def test_eval_online_of_a_planted_checkpoint_refuses_its_target_in_one_line(tmp_path):
    evil, marker = evil_target(tmp_path / "evil")
    ckpt = plant_checkpoint(tmp_path / "x.ckpt", planted_config(evil))
    with pytest.raises(EvalError) as e:
        _eval(ckpt, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and f"names target.path {str(evil)!r} in its embedded config" in msg
    assert "--set target.path=DIR_OR_HUB_ID or --config RUN/config.yaml" in msg
    assert not marker.exists() and not (tmp_path / "ev").exists()


def test_eval_online_with_the_target_named_ignores_the_embedded_trust_remote_code(tmp_path, monkeypatch):
    import stages.eval as ev

    evil, marker = evil_target(tmp_path / "evil")
    ckpt = plant_checkpoint(tmp_path / "x.ckpt", planted_config(evil))
    seen = {}

    def online(drafter, cfg, *args):  # the decoding itself is the online eval's tests'
        seen.update(path=cfg.target.path, trust=cfg.target.trust_remote_code, attn=cfg.target.attn_implementation)
        raise EvalError("stop here")

    monkeypatch.setattr(ev, "run_online", online)
    tiny = load_config(TINY).target.path
    with pytest.raises(EvalError, match="stop here"):
        _eval(ckpt, tmp_path, f"target.path={tiny}")
    assert seen == {"path": tiny, "trust": False, "attn": "sdpa"}
    assert not marker.exists()


def test_a_found_run_config_that_trusts_remote_code_is_refused_unless_the_command_line_says_so(tmp_path):
    evil, marker = evil_target(tmp_path / "evil")
    run = tmp_path / "shared-run"
    cfg = load_config(TINY, [f"target.path={evil}", "target.trust_remote_code=true"])
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    ckpt = plant_checkpoint(run / "checkpoints" / "step3.ckpt", planted_config(evil))
    with pytest.raises(ConfigError) as e:
        _eval(ckpt, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{run / 'config.yaml'}: target.trust_remote_code is true")
    assert "pass --set target.trust_remote_code=true" in msg
    assert not marker.exists() and not (tmp_path / "ev").exists()
    cfg, _ = resolve_config(None, ["target.trust_remote_code=true"], run_config=run / "config.yaml")
    assert cfg.target.trust_remote_code  # said on the command line too: taken (not loaded here)
    cfg.target.trust_remote_code, cfg.target.attn_implementation = False, "kernels-community/evil"
    (run / "config.yaml").write_text(dump_config(cfg))
    with pytest.raises(ConfigError, match="attn_implementation = 'kernels-community/evil' in a run directory"):
        resolve_config(None, (), run_config=run / "config.yaml")
    assert not marker.exists()


def test_export_of_a_planted_checkpoint_carries_no_path_or_flag_of_its_config(tmp_path):
    from stages.export import export_checkpoint

    evil, marker = evil_target(tmp_path / "evil")
    ckpt = plant_checkpoint(tmp_path / "x.ckpt", planted_config(evil))
    out = export_checkpoint(str(ckpt), str(tmp_path / "export"))
    for f in out.iterdir():
        if f.suffix in (".json", ".sha256"):
            assert str(evil) not in f.read_text() and "trust_remote_code" not in f.read_text(), f
    drafter, src = __import__("stages.eval", fromlist=["load_drafter"]).load_drafter(str(out))
    assert src.kind == "export" and src.config is None  # an export carries no config at all
    assert not marker.exists()


def test_init_from_and_eval_of_an_export_never_import_its_modeling_file(tmp_path):
    from pipeline.export import load_exported
    from stages.export import export_checkpoint
    from stages.init_from import read_export_config

    evil, marker = evil_target(tmp_path / "evil")
    out = export_checkpoint(str(plant_checkpoint(tmp_path / "x.ckpt", planted_config(evil))), str(tmp_path / "exp"))
    (out / "modeling_dflash.py").write_text(CODE.format(marker=str(marker)))  # a planted modeling file
    (out / "checksums.sha256").unlink()  # (edited on purpose: no checksums to refuse it first)
    meta = read_export_config(str(out))
    assert meta["auto_map"]["AutoModel"].startswith("modeling_dflash.")  # it names the file, and nothing runs it
    load_exported(out)
    assert not marker.exists()


def _train(*args: str, check: bool = True):
    from helpers_cli import FEW_ANCHORS, TINY_STORE_OPTS, dflash

    return dflash("train", "--config", TINY, *TINY_STORE_OPTS, "--set", "train.num_workers=0", "--set",
                  "train.batch_size=8", "--set", "train.val_every=1000", "--set", "train.checkpoint_every=2",
                  *FEW_ANCHORS, *args, check=check)


@pytest.mark.slow  # three tiny `dflash train` runs (~10 s each on 2 busy cores)
def test_resume_and_init_from_never_take_code_from_a_planted_checkpoint_or_export(tiny_store, tmp_path):
    from pipeline.ckpt_io import load_training_checkpoint

    evil, marker = evil_target(tmp_path / "evil")
    run = tmp_path / "run"
    _train("--store", tiny_store, "--set", f"train.run_dir={run}", "--set", "train.max_steps=2")
    last = (run / "checkpoints" / "last.ckpt").resolve()
    ckpt = load_training_checkpoint(last)
    ckpt["dflash"]["config"] = planted_config(evil)  # the resumed checkpoint names the evil target
    torch.save(ckpt, last)
    r = _train("--store", tiny_store, "--set", f"train.run_dir={run}", "--set", "train.max_steps=4", "--resume")
    assert "Traceback" not in r.stderr
    assert load_training_checkpoint(run / "checkpoints" / "last.ckpt", mmap=True)["global_step"] == 4
    assert str(evil) not in (run / "config.yaml").read_text()
    assert not marker.exists()
    export = run / "export"  # a planted modeling file and config entries in the export it warm-starts from
    (export / "modeling_dflash.py").write_text(CODE.format(marker=str(marker)))
    meta = json.loads((export / "config.json").read_text())
    meta["auto_map"] = {"AutoConfig": "modeling_dflash.Evil", "AutoModel": "modeling_dflash.Evil"}
    (export / "config.json").write_text(json.dumps(meta))
    (export / "checksums.sha256").unlink()
    warm = tmp_path / "warm"
    r = _train("--store", tiny_store, "--set", f"train.run_dir={warm}", "--set", "train.max_steps=1", "--init-from",
               str(export), "--no-export")
    assert f"starting from the weights of {export}" in r.stderr, r.stderr[-3000:]
    assert not marker.exists()
