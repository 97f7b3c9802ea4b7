"""The handover section of docs/guides/multi-node.md (issue 41 item 5): every `dflash` command it gives parses
with the CLI's own options, and every `--set` it names is a key the config accepts with that value."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from pipeline.config import load_config
from stages.cli import main

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "multi-node.md"
SHELL = {"C": "configs/qwen3.6-27b.yaml", "SHARDS": "0-4", "NODE": "0", "SLURM_NODEID": "0", "TRAIN": "1"}


def _section() -> str:
    text = GUIDE.read_text()
    return text.split("## Handing extraction's GPUs to training yourself", 1)[1].split("\n**Time on", 1)[0]


def _expand(words: str) -> str:
    words = re.sub(r"\$\(\(([^)]*)\)\)", lambda m: str(eval(re.sub(r"\b([A-Z_]+)\b", lambda v: SHELL[v.group(1)],
                                                                       m.group(1)))), words)
    return re.sub(r"\$([A-Z_]+)", lambda m: SHELL[m.group(1)], words)


def _commands() -> list[list[str]]:
    text = _section().replace("\\\n", " ")
    out = []
    for line in re.findall(r"dflash (?:train|extract|inspect|run)\b[^&|;#`\n]*", text):
        out.append(shlex.split(_expand(line))[1:])
    return out


def test_every_command_of_the_handover_section_parses():
    commands = _commands()
    names = [c[0] for c in commands]
    assert names.count("train") >= 5 and "extract" in names and "inspect" in names
    resumes = [c for c in commands if c[0] == "train" and "--resume" in c]
    assert any("0,1,2,3,4,5,6,7" in c for c in resumes)  # the resume on all 8 GPUs, in the form --gpus takes
    for words in commands:
        ctx = main.commands[words[0]].make_context(words[0], words[1:])  # an unknown option raises here
        gpus = ctx.params.get("gpus")
        assert gpus is None or re.fullmatch(r"\d+(,\d+)*", gpus), f"--gpus {gpus}: train and extract take 0,1,2"
        if "overrides" in ctx.params and ctx.params.get("config_path"):
            load_config(ROOT / ctx.params["config_path"], list(ctx.params["overrides"]))


def test_every_set_of_the_section_is_a_valid_config_key():
    sets = re.findall(r"--set (train\.[a-z_]+=\S+?)`?[\s)`]", _section())
    assert "train.keep_global_batch=false" in sets and "train.accumulate_grad_batches=8" in sets
    load_config(ROOT / SHELL["C"], sets)  # an unknown key or a wrong value raises ConfigError
