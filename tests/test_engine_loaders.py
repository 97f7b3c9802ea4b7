"""The serving engines' reading of our export (issue 42 item 5): the export's tensors and config keys, mapped the
way vLLM's and SGLang's DFlash and DFlash 2 loaders map them, at the tiny shape and at the 27B shapes (built on the
meta device: names and shapes only, no memory).

Sources, re-stated here as parameter tables and name mappings (a renamed key or a shape an engine would misread
fails the test):
- vLLM vllm/model_executor/models/qwen3_dflash.py: `DFlashQwen3ForCausalLM.load_weights` prefixes "model." to
  every name but lm_head and drops embed_tokens / mask_embedding / draft_id_to_target_id when the checkpoint
  has none; `DFlashQwen3Model.hf_to_vllm_mapper` stacks q/k/v_proj into qkv_proj (shards q, k, v) and gate/up_proj
  into gate_up_proj (shards 0, 1); AutoWeightsLoader refuses a name with no parameter. fc's input is
  target_hidden_size (default hidden_size) x len(dflash_config.target_layer_ids) (`_get_dflash_fc_input_size`,
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py); `_resolve_layer_attention` / `_dflash_layer_causal`:
  is_causal first, else sliding layers causal; mixed sliding/full layers need the V2 runner; a sliding layer
  needs sliding_window.
- vLLM vllm/model_executor/models/qwen3_dflash2.py: per layer attention_conv / mlp_conv (`DFlashGroupedConv`:
  base_kernel [2, conv_kernel_size, H], kernel_projection [2 * taps * H / conv_group_size, H]) and
  model.candidate_selector (predecessor/successor_codebook [vocab_size, selector_rank], hidden_projection
  [selector_rank, H]) from dflash_config; the conv block is 1 + num_speculative_tokens.
- SGLang python/sglang/srt/models/dflash.py: `DFlashDraftModel` parameters without a "model." prefix (its
  `resolve_param_name` strips or adds it), the same q/k/v and gate/up stacking, fc [H, K * H] with K the
  dflash_config target_layer_ids (a K mismatch raises), and a name it cannot resolve is skipped silently, so
  the test asserts that every parameter is filled. SGLang's DFlash 2 model file is not in the source snapshot
  read; its DFlash 2 tensors are checked with SGLang's name resolution over vLLM's DFlash 2 table (the names
  pipeline/drafter2.py cites from SGLang PR #35371 are the same).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers_cli import ROOT
from pipeline.archs import spec_for
from pipeline.config import load_config

STACKED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
           (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))


def exported(config: str, overrides=(), layer_ids=None, vocab=None) -> tuple[dict, dict]:
    """(name -> shape, config.json dict) that `dflash export` writes for the config's drafter, built on meta."""
    import pipeline.export1 as e1
    import pipeline.export2 as e2

    cfg = load_config(str(ROOT / "configs" / config), list(overrides))
    ids = layer_ids or [1, 3, 5]
    vocab = vocab or 576
    with torch.device("meta"):
        drafter = spec_for(cfg.drafter.arch).build(cfg, ids, vocab)
    got = {}

    def capture(out_dir, state, hf_cfg, files, extra=None):
        got.update(state=state, cfg=hf_cfg)
        return out_dir

    meta_state = lambda d, dtype: {k: v.detach() for k, v in d.state_dict().items()}  # noqa: E731
    mp = pytest.MonkeyPatch()
    for mod in (e1, e2):
        mp.setattr(mod, "write_files", capture)
        mp.setattr(mod, "export_state", meta_state)
    try:
        spec_for(cfg.drafter.arch).export(drafter, None, "unused", vocab_size=vocab, num_target_layers=max(ids) + 2,
                                          dtype="bfloat16")
    finally:
        mp.undo()
    return {k: tuple(v.shape) for k, v in got["state"].items()}, got["cfg"]


def engine_params(cfg: dict, engine: str) -> dict[str, dict]:
    """The engine's parameters: name -> {"shards": {shard id: rows or None}, "shape": full shape}."""
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv, hd, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    dflash = cfg["dflash_config"]
    k = len(dflash["target_layer_ids"])
    pre = "model." if engine == "vllm" else ""
    p = {}
    for i in range(L):
        b = f"{pre}layers.{i}."
        p[b + "self_attn.qkv_proj.weight"] = {"shards": {"q": nh * hd, "k": nkv * hd, "v": nkv * hd},
                                              "shape": ((nh + 2 * nkv) * hd, H)}
        p[b + "mlp.gate_up_proj.weight"] = {"shards": {0: inter, 1: inter}, "shape": (2 * inter, H)}
        for name, shape in (("self_attn.o_proj.weight", (H, nh * hd)), ("self_attn.q_norm.weight", (hd,)),
                            ("self_attn.k_norm.weight", (hd,)), ("mlp.down_proj.weight", (H, inter)),
                            ("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,))):
            p[b + name] = {"shards": None, "shape": shape}
        if cfg["architectures"] == ["DFlash2DraftModel"]:
            taps, groups = dflash["conv_kernel_size"], H // dflash["conv_group_size"]
            for side in ("attention_conv", "mlp_conv"):
                p[f"{b}{side}.base_kernel"] = {"shards": None, "shape": (2, taps, H)}
                p[f"{b}{side}.kernel_projection.weight"] = {"shards": None, "shape": (2 * taps * groups, H)}
    target_hidden = cfg.get("target_hidden_size") or H
    p[pre + "fc.weight"] = {"shards": None, "shape": (H, target_hidden * k)}
    p[pre + "hidden_norm.weight"] = {"shards": None, "shape": (H,)}
    p[pre + "norm.weight"] = {"shards": None, "shape": (H,)}
    if cfg["architectures"] == ["DFlash2DraftModel"]:
        r, V = dflash["selector_rank"], cfg["vocab_size"]
        p[pre + "candidate_selector.predecessor_codebook"] = {"shards": None, "shape": (V, r)}
        p[pre + "candidate_selector.successor_codebook"] = {"shards": None, "shape": (V, r)}
        p[pre + "candidate_selector.hidden_projection.weight"] = {"shards": None, "shape": (r, H)}
    return p


def load(weights: dict, cfg: dict, engine: str) -> None:
    """Map the checkpoint's names as the engine does; assert every weight lands in a parameter (shard) of its
    shape and every parameter (shard) is filled exactly once."""
    params = engine_params(cfg, engine)
    filled: dict[str, list] = {n: [] for n in params}
    for name, shape in weights.items():
        if engine == "vllm":
            assert "mask_hidden" not in name and "lm_head" not in name and "embed_tokens" not in name, name
            name = "model." + name.replace("midlayer.", "layers.0.")
        shard = None
        for old, new, sid in STACKED:
            if old in name:
                name, shard = name.replace(old, new), sid
                break
        if engine == "sglang" and name not in params:
            name = name.removeprefix("model.") if name.removeprefix("model.") in params else f"model.{name}"
        assert name in params, f"{engine} has no parameter for the export's tensor {name}"
        want = params[name]
        expect = want["shape"] if shard is None else (want["shards"][shard], *want["shape"][1:])
        assert shape == expect, f"{engine} reads {name}{'' if shard is None else f' shard {shard}'} as {expect}, " \
                                f"the export has {shape}"
        filled[name].append(shard)
    for name, want in params.items():
        expect = [None] if want["shards"] is None else sorted(want["shards"], key=str)
        assert sorted(filled[name], key=str) == expect, f"{engine}: {name} filled by {filled[name]}, needs {expect}"


def engine_config_reads(cfg: dict) -> None:
    """The config keys both engines read exist with the types they take, and resolve as our drafter does."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings"):
        assert isinstance(cfg[key], int) and cfg[key] > 0, key
    assert cfg["hidden_act"] == "silu" and cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"]
    d = cfg["dflash_config"]
    assert isinstance(d["mask_token_id"], int) and d["block_size"] == cfg["block_size"] > 1
    assert all(isinstance(i, int) and 0 <= i < cfg["num_target_layers"] for i in d["target_layer_ids"])
    types = cfg["layer_types"]
    assert len(types) == cfg["num_hidden_layers"] and set(types) <= {"sliding_attention", "full_attention"}
    if "sliding_attention" in types:
        assert isinstance(cfg["sliding_window"], int) and cfg["sliding_window"] > 0
    if cfg["architectures"] == ["DFlash2DraftModel"]:
        assert cfg["hidden_size"] % d["conv_group_size"] == 0
        assert 0 < d["selector_top_k"] <= cfg["vocab_size"] and d["selector_rank"] > 0


def vllm_causal(cfg: dict) -> list[bool]:
    """qwen3_dflash.py `_dflash_layer_causal`, per layer."""
    if cfg.get("is_causal") is not None:
        return [bool(cfg["is_causal"])] * cfg["num_hidden_layers"]
    return [t == "sliding_attention" for t in cfg["layer_types"]]


CASES = {
    "tiny dflash": ("tiny.yaml", [], None, None),
    "tiny dflash2": ("tiny.yaml", ["drafter.arch=dflash2", "drafter.dflash2.conv_group_size=16", "drafter.dflash2.selector_rank=8",
                                   "drafter.dflash2.selector_top_k=6"], None, None),
    "27b dflash": ("qwen3.6-27b.yaml", [], [1, 16, 31, 46, 61], 248320),
    "27b dflash2": ("qwen3.8-27b-dflash2.yaml", [], [1, 16, 31, 46, 61], 248320),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engines_read_every_tensor_and_key_of_the_export(case, engine, tmp_path):
    weights, cfg = exported(*CASES[case])
    engine_config_reads(cfg)
    load(weights, cfg, engine)
    from pipeline.drafter import DrafterArch
    from pipeline.masks import block_causal
    from pipeline.serve_commands import serve_commands

    ours = DrafterArch.from_exported(cfg)  # our loader reads the same config back
    assert vllm_causal(cfg) == [block_causal(ours.is_causal, t) for t in ours.layer_types]
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # the commands `dflash export` prints for it
    cmds = serve_commands(tmp_path)
    mixed = 0 < cfg["layer_types"].count("sliding_attention") < len(cfg["layer_types"])
    assert cmds.vllm.startswith("VLLM_USE_V2_MODEL_RUNNER=1 ") == mixed  # the V1 runner refuses mixed layers
    assert f'"num_speculative_tokens": {cfg["block_size"] - 1}' in cmds.vllm  # conv block = 1 + this
    assert f"--speculative-num-draft-tokens {cfg['block_size']}" in cmds.sglang


def test_a_renamed_key_or_misread_shape_fails():
    weights, cfg = exported(*CASES["tiny dflash2"])
    renamed = {k.replace("hidden_norm", "context_norm"): v for k, v in weights.items()}
    with pytest.raises(AssertionError, match="no parameter for the export's tensor model.context_norm.weight"):
        load(renamed, cfg, "vllm")
    with pytest.raises(AssertionError, match="sglang has no parameter for the export's tensor"):
        load(renamed, cfg, "sglang")
    with pytest.raises(AssertionError, match="model.layers.0.self_attn.qkv_proj.weight shard k"):
        load({**weights, "layers.0.self_attn.k_proj.weight": (7, cfg["hidden_size"])}, cfg, "vllm")
    fewer = {**cfg, "dflash_config": {**cfg["dflash_config"], "target_layer_ids": [1, 3]}}
    with pytest.raises(AssertionError, match="reads fc.weight as"):
        load(weights, fewer, "sglang")
    missing = {k: v for k, v in weights.items() if "mlp_conv.base_kernel" not in k}
    with pytest.raises(AssertionError, match="mlp_conv.base_kernel filled by"):
        load(missing, cfg, "vllm")
