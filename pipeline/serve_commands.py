"""The vLLM and SGLang command lines that serve an export (issue 42 item 4), printed by `dflash export` and
`dflash serve-check`.

Contract: `serve_commands(export_dir, target=None)` reads the export's config.json (block size, layer types,
is_causal, auto_map) and dflash_meta.json (the target's name) and returns a `ServeCommands`: `vllm` and `sglang`
(one shell line each) and `notes` (what the lines cannot say). `describe(cmds)` is the text the CLI prints.
The flags are the engines' own:
- vLLM (vllm/config/speculative.py, vllm/model_executor/models/qwen3_dflash.py): `vllm serve TARGET
  --speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens": block_size - 1}'` (the
  draft tokens, without the target's bonus token). A drafter that mixes sliding and full layers is refused on the
  default runner (qwen3_dflash.py `_resolve_layer_attention` raises NotImplementedError naming
  VLLM_USE_V2_MODEL_RUNNER=1), so the line sets that variable for such a drafter.
- SGLang (python/sglang/srt/server_args.py, python/sglang/srt/managers/tokenizer_manager.py):
  `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH
  --speculative-draft-model-path DIR --speculative-num-draft-tokens block_size` (the verify window, the target's
  token included: tokenizer_manager counts `speculative_num_draft_tokens - 1` guesses). SGLang rejects auto_map,
  so an export written without `--sglang` gets a note. A drafter with `is_causal: false` and sliding layers gets
  `--speculative-draft-attention-backend flashinfer`: the FA3-style backend's window (W-1, 0) makes a sliding
  layer causal, flashinfer's keeps it bidirectional.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class ServeCommands:
    vllm: str
    sglang: str
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def export_facts(export_dir) -> dict:
    """What the commands depend on: block_size, layer_types, is_causal, for_sglang, target (name or None)."""
    d = Path(export_dir)
    cfg = _read_json(d / "config.json")
    block = int(cfg.get("block_size") or (cfg.get("dflash_config") or {}).get("block_size") or 0)
    return {"block_size": block, "layer_types": list(cfg.get("layer_types") or []),
            "is_causal": cfg.get("is_causal"), "for_sglang": "auto_map" not in cfg,
            "target": _read_json(d / "dflash_meta.json").get("target")}


def serve_commands(export_dir, target: Optional[str] = None) -> ServeCommands:
    """The engines' command lines for this export (see the module contract)."""
    facts = export_facts(export_dir)
    path = str(export_dir)
    model = target or facts["target"] or "TARGET_MODEL"
    block, types = facts["block_size"], facts["layer_types"]
    sliding = sum(t == "sliding_attention" for t in types)
    mixed = 0 < sliding < len(types)
    notes = []
    spec = json.dumps({"method": "dflash", "model": path, "num_speculative_tokens": block - 1})
    vllm = ("VLLM_USE_V2_MODEL_RUNNER=1 " if mixed else "") + f"vllm serve {shlex.quote(model)} " \
        f"--speculative-config {shlex.quote(spec)}"
    if mixed:
        notes.append("vLLM: this drafter mixes sliding and full layers; the default model runner refuses it at start-up "
                     "(NotImplementedError), so the line sets VLLM_USE_V2_MODEL_RUNNER=1")
    sglang = (f"python -m sglang.launch_server --model-path {shlex.quote(model)} --speculative-algorithm DFLASH "
              f"--speculative-draft-model-path {shlex.quote(path)} --speculative-num-draft-tokens {block}")
    if facts["is_causal"] is False and sliding:
        sglang += " --speculative-draft-attention-backend flashinfer"
        notes.append("SGLang: is_causal false with sliding layers needs the flashinfer draft backend (the FA3-style "
                     "window (W-1, 0) would make the sliding layers causal and lower the acceptance)")
    if not facts["for_sglang"]:
        notes.append(f"SGLang: {path}/config.json has auto_map, which SGLang rejects: export again with "
                     "`dflash export RUN DIR --sglang` and serve that directory")
    if model == "TARGET_MODEL":
        notes.append("the export does not name its target: replace TARGET_MODEL with the target's path or hub name")
    return ServeCommands(vllm=vllm, sglang=sglang, notes=notes)


def describe(cmds: ServeCommands) -> str:
    """The lines the CLI prints."""
    lines = ["serve with vLLM:", f"  {cmds.vllm}", "serve with SGLang:", f"  {cmds.sglang}"]
    return "\n".join(lines + [f"note: {n}" for n in cmds.notes])
