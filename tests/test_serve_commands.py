"""pipeline/serve_commands.py: the vLLM and SGLang lines that serve an export, and `dflash export` printing them."""

from __future__ import annotations

import json
import shlex

from pipeline.serve_commands import describe, serve_commands


def _export(d, *, block=16, types=("full_attention",) * 2, is_causal=None, auto_map=True, target="Qwen/Qwen3.6-27B"):
    d.mkdir()
    cfg = {"block_size": block, "layer_types": list(types), "dflash_config": {"block_size": block}}
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    if auto_map:
        cfg["auto_map"] = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    if target:
        (d / "dflash_meta.json").write_text(json.dumps({"target": target}))
    return d


def test_full_attention_drafter_serves_on_both_engines_with_their_token_counts(tmp_path):
    d = _export(tmp_path / "exp", auto_map=False)
    c = serve_commands(d)
    argv = shlex.split(c.vllm)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3.6-27B"] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {"method": "dflash", "model": str(d), "num_speculative_tokens": 15}
    assert shlex.split(c.sglang) == ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3.6-27B",
                                     "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(d),
                                     "--speculative-num-draft-tokens", "16"]
    assert c.notes == []


def test_mixed_bidirectional_drafter_gets_the_v2_runner_and_flashinfer_and_the_sglang_export_note(tmp_path):
    d = _export(tmp_path / "exp", block=8, types=("sliding_attention", "sliding_attention", "full_attention"),
                is_causal=False, target=None)
    c = serve_commands(d)
    assert c.vllm.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve TARGET_MODEL ")
    assert json.loads(shlex.split(c.vllm)[5])["num_speculative_tokens"] == 7
    assert c.sglang.endswith("--speculative-num-draft-tokens 8 --speculative-draft-attention-backend flashinfer")
    text = describe(c)
    assert "default model runner refuses it" in text and "flashinfer draft backend" in text
    assert "export again with `dflash export RUN DIR --sglang`" in text and "replace TARGET_MODEL" in text
    causal = serve_commands(_export(tmp_path / "causal", types=("sliding_attention",) * 2, is_causal=True))
    assert "attention-backend" not in causal.sglang and not causal.vllm.startswith("VLLM_USE_V2")


def test_dflash_export_prints_the_commands(tmp_path):
    import torch

    from helpers_cli import TINY
    from pipeline.config import load_config
    from pipeline.drafter import DFlashDrafter, DrafterArch
    from pipeline.export import export_drafter
    from stages.export import serve_commands_text

    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterArch.from_config(load_config(TINY).drafter, [1, 3, 5]))
    out = export_drafter(drafter, None, tmp_path / "export", vocab_size=576, num_target_layers=8, dtype="float32",
                         extra_metadata={"target": "tiny/target"})
    lines = serve_commands_text(out).splitlines()
    block = drafter.arch.block_size
    assert lines[0] == "serve with vLLM:" and f'"num_speculative_tokens": {block - 1}' in lines[1]
    assert lines[2] == "serve with SGLang:" and f"--speculative-num-draft-tokens {block}" in lines[3]
    assert "vllm serve tiny/target" in lines[1] and f"--speculative-draft-model-path {out}" in lines[3]
