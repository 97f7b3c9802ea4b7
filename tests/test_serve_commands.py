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


def test_dflash_export_prints_the_commands(tmp_path, capsys):
    import torch

    from helpers_drafters import tiny_drafter
    from stages.export import run_export

    d = tiny_drafter(0, target_layer_ids=[1, 3, 5], sliding_window=6)
    ckpt = tmp_path / "step3.ckpt"
    torch.save({"global_step": 3, "state_dict": {f"drafter.{k}": v for k, v in d.state_dict().items()},
                "dflash": {"arch": d.arch.to_dict(), "step": 3, "vocab_size": 50,
                           "target": {"num_hidden_layers": 8, "name": "tiny/target"}}}, ckpt)
    out = tmp_path / "export"
    assert run_export(str(ckpt), out=str(out), dtype="float32") == 0
    lines = capsys.readouterr().out.splitlines()
    block = d.arch.block_size
    assert lines[0].startswith("exported ") and lines[1] == "serve with vLLM:" and lines[3] == "serve with SGLang:"
    # the tiny drafter mixes sliding and full layers: the V2 runner, and the note saying why
    assert lines[2].strip().startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve tiny/target --speculative-config ")
    assert any(x.startswith("note: vLLM: this drafter mixes sliding and full layers") for x in lines[5:])
    assert json.loads(shlex.split(lines[2])[5]) == {"method": "dflash", "model": str(out),
                                                    "num_speculative_tokens": block - 1}
    assert lines[4].strip().endswith(f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {block}")
    from stages.export import serve_commands_text
    from stages.train_fit import serve_lines

    # dflash train's own export prints the same commands, as train's lines (a heading `train: `, commands indented)
    trained = serve_lines(str(out)).splitlines()
    assert trained == [x if x.startswith("  ") else f"train: {x}" for x in serve_commands_text(str(out)).splitlines()]
    assert trained[0] == "train: serve with vLLM:" and trained[1] == lines[2] and trained[3] == lines[4]
