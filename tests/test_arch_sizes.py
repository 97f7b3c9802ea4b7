"""Sizes read from a file are checked before anything is allocated (issue 40 item 4): a checkpoint's or an
export's stored architecture within its ranges and fitting the weights stored with it (pipeline/archs.py:
check_sizes), else one line; a hidden size of 10^7 hung export and eval before. The subprocesses run under a
4 GiB address-space limit, so a regression fails at once instead of taking the machine's memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
import torch

from helpers_cli import ROOT
from helpers_drafters import tiny_drafter
from pipeline.archs import ArchError
from pipeline.export import export_drafter, load_exported
from stages.export import load_checkpoint_drafter

pytestmark = pytest.mark.usefixtures("one_thread")
REFUSE_S = 300  # a refusal takes seconds: only a hang guard on a busy machine


def _save_ckpt(path, **arch_changes):
    d = tiny_drafter(0, target_layer_ids=[1, 3, 5], sliding_window=6)
    arch = {**d.arch.to_dict(), **arch_changes}
    torch.save({"global_step": 3, "state_dict": {f"drafter.{k}": v for k, v in d.state_dict().items()},
                "dflash": {"arch": arch, "step": 3, "vocab_size": 50, "target": {"num_hidden_layers": 8}}}, path)
    return path


def _export(tmp_path, **config_changes):
    d = tiny_drafter(0, target_layer_ids=[1, 3, 5], sliding_window=6)
    out = export_drafter(d, d.arch, tmp_path / "export", vocab_size=50, num_target_layers=8, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    (out / "checksums.sha256").unlink()  # the edit is the point here (checksums are item 5's)
    return out


def _limited(args, **kw):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          preexec_fn=limit, capture_output=True, text=True, timeout=REFUSE_S, **kw)


@pytest.mark.parametrize("change, says", [
    ({"hidden_size": 17}, "(hidden_size 17, intermediate_size 32, num_attention_heads 4, num_key_value_heads 2, "
                          "head_dim 8) does not fit its weights: layers.0.input_layernorm.weight is [16], the "
                          "architecture needs [17]"),
    ({"num_hidden_layers": 3, "layer_types": None}, "num_hidden_layers 3, its weights 2 layers"),
    ({"hidden_size": -4}, "architecture's hidden_size must be 1 or more, got -4"),
    ({"head_dim": "8"}, "architecture's head_dim must be 2 or more, got '8'"),
    ({"num_key_value_heads": 3}, "is not one a drafter can have (num_attention_heads must be a multiple"),
])
def test_a_checkpoint_whose_arch_does_not_fit_its_weights_is_one_line(tmp_path, change, says):
    ckpt = _save_ckpt(tmp_path / "x.ckpt", **change)
    with pytest.raises(ArchError) as e:
        load_checkpoint_drafter(str(ckpt))
    msg = str(e.value)
    assert says in msg and msg.startswith(f"{ckpt}: its stored architecture") and "\n" not in msg
    assert "use another checkpoint, or export the run again" in msg


def test_an_export_whose_config_does_not_fit_its_weights_is_one_line(tmp_path):
    out = _export(tmp_path, intermediate_size=64)
    with pytest.raises(ArchError, match=r"gate_proj.weight is \[32, 16\], the architecture needs \[64, 16\]"):
        load_exported(out)
    assert load_exported(_export(tmp_path / "good"))[1].intermediate_size == 32  # an unedited one loads


def test_export_of_a_huge_arch_checkpoint_is_refused_in_one_line(tmp_path):
    ckpt = _save_ckpt(tmp_path / "huge.ckpt", hidden_size=10**7, intermediate_size=10**7)
    r = _limited(["-m", "stages.cli", "export", str(ckpt), str(tmp_path / "out")])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "huge.ckpt: its stored architecture (hidden_size 10000000, intermediate_size 10000000" in line
    assert "does not fit its weights: layers.0.input_layernorm.weight is [16], the architecture needs [10000000]" in line
    assert not (tmp_path / "out").exists()


_EVAL_LOADS = """
import sys
from stages.eval import load_drafter
for path in sys.argv[1:]:
    try:
        load_drafter(path)
    except Exception as e:
        print(type(e).__name__, e)
"""


def test_eval_of_a_huge_arch_checkpoint_or_export_is_refused(tmp_path):
    ckpt = _save_ckpt(tmp_path / "huge.ckpt", hidden_size=10**7)
    out = _export(tmp_path, hidden_size=10**7)
    r = _limited(["-c", _EVAL_LOADS, str(ckpt), str(out)])  # what `dflash eval X` does first
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(x.startswith("ArchError ") for x in lines), r.stdout
    assert "huge.ckpt: its stored architecture (hidden_size 10000000" in lines[0]
    assert f"{out}: its stored architecture (hidden_size 10000000" in lines[1] and "is [16], the architecture needs [10000000]" in lines[1]
