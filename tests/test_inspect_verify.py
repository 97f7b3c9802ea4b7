"""`dflash inspect` and `dflash verify` for a newcomer (issue 43 item 3): the provenance summarised in a few lines
(layer types counted, not one line each), `inspect --json` for scripts, and a path that is another dflash output
(a run directory, a checkpoint, an export, an eval output) named as what it is instead of a store to remove."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import dflash  # noqa: E402
from pipeline import store as st  # noqa: E402
from stages.inspect import inspect_store  # noqa: E402
from stages.verify import verify_store  # noqa: E402


def test_inspect_summarises_the_provenance_and_prints_json(tiny_store):
    out = dflash("inspect", tiny_store).stdout
    a = st.read_root_attrs(tiny_store)
    lines = out.splitlines()
    assert [ln for ln in lines if ln.startswith("target at")] == [
        f"target at  {a['target']['path']}  config {a['target']['config_sha256'][:12]}...  weights "
        f"{a['target']['weights_sha256'][:12]}... (content)  layer types 8 x full_attention"]
    assert any(ln.startswith(f"made by    dflash {a['dflash_version']} (schema 1) at {a['created_at']}: dflash "
                             "extract ") for ln in lines)
    assert any(ln.startswith(f"data       240 samples ({a['dataset']['validation_samples']} validation), ")
               for ln in lines)
    assert '"full_attention"' not in out and "provenance {" not in out and len(lines) < 25
    s = json.loads(dflash("inspect", "--json", tiny_store).stdout)
    assert s["samples"] == 240 and s["complete"] and s["provenance"] == a


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_another_dflash_directory_is_named_as_what_it_is(tmp_path, command):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (run / "config.yaml").write_text("store:\n  path: /data/s.zarr\n")
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"x")
    (export / "config.json").write_text("{}")
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "report.json").write_text("{}")
    said = {run: f"is a training run directory, not a store (this command reads a STORE.zarr that `dflash extract` "
                 f"wrote); see it with `dflash status {run}`; it trained on the store /data/s.zarr",
            run / "checkpoints" / "last.ckpt": "is a training checkpoint, not a store",
            export: "is an exported drafter, not a store",
            ev: "is an eval output directory, not a store"}
    r = dflash(command, str(run), check=False)  # through the command line once; the other kinds in-process
    assert r.returncode == 2 and r.stderr == f"error: {run} {said.pop(run)}\n", r.stderr
    for path, text in said.items():
        with pytest.raises(st.StoreError) as e:
            (verify_store if command == "verify" else inspect_store)(str(path))
        assert str(e.value).startswith(f"{path} {text}") and "remove it" not in str(e.value)
    assert list((run / "checkpoints").iterdir()) == [run / "checkpoints" / "last.ckpt"]  # nothing written
