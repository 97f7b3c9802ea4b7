"""Export: the serving contract (config fields, contract keys) and round trips through transformers and our loader."""

import json

import pytest
import torch
from safetensors import safe_open

from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.export import contract_keys, export_drafter, load_exported
from pipeline.masks import make_attend

H, BS = 16, 4
REQUIRED = [
    "architectures", "model_type", "block_size", "num_target_layers", "dflash_config", "hidden_size",
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
    "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "layer_types", "torch_dtype",
]


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(0)
    arch = DrafterArch(hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, target_layer_ids=[1, 3, 5],
                       layer_types=["sliding_attention", "full_attention"], sliding_window=6, block_size=BS,
                       mask_token_id=3, rope_theta=10000.0, max_position_embeddings=512)
    d = DFlashDrafter(arch)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return d


def test_config_and_weights(drafter, tmp_path):
    out = export_drafter(drafter, drafter.arch, tmp_path / "x", vocab_size=50, num_target_layers=8,
                         extra_metadata={"store": "abc"})
    cfg = json.loads((out / "config.json").read_text())
    for key in REQUIRED:
        assert key in cfg, key
    assert "partial_rotary_factor" not in cfg
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["mask_token_id"] == 3 and cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert cfg["block_size"] == BS and cfg["num_target_layers"] == 8 and cfg["num_hidden_layers"] == 2
    assert cfg["sliding_window"] == 6 and cfg["use_sliding_window"] is True
    assert cfg["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16  # default export dtype
    assert keys == contract_keys(2)
    assert not any("embed" in k or "lm_head" in k for k in keys)
    _, _, meta = load_exported(out)
    assert meta["dflash_meta"] == {"store": "abc"}


def test_sglang_mode_has_no_auto_map(drafter, tmp_path):
    out = export_drafter(drafter, drafter.arch, tmp_path / "s", vocab_size=50, num_target_layers=8, for_sglang=True)
    assert "auto_map" not in json.loads((out / "config.json").read_text())


def test_mismatched_arguments_refused(drafter, tmp_path):
    with pytest.raises(ValueError, match="mask_token_id"):
        export_drafter(drafter, drafter.arch, tmp_path / "m", vocab_size=50, num_target_layers=8, mask_token_id=7)


def _our_output(d, feats, emb):
    S, Q = feats.shape[1], emb.shape[1]
    attend = make_attend("sdpa", anchors=torch.tensor([[S]]), block_size=Q, ctx_len=S,
                         layer_types=d.arch.layer_types, sliding_window=d.arch.sliding_window)
    return d(emb, d.project_context(feats), torch.arange(S, S + Q)[None], torch.arange(S)[None], attend)


def test_round_trips(drafter, tmp_path):
    out = export_drafter(drafter, drafter.arch, tmp_path / "r", vocab_size=50, num_target_layers=8, dtype="float32",
                         target_layer_ids=[1, 3, 5], mask_token_id=3, block_size=BS)
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 11, 3 * H, generator=g)  # S = 11 > sliding window 6: the window matters
    emb = torch.randn(1, BS, H, generator=g)
    with torch.no_grad():
        want = _our_output(drafter, feats, emb)
        ours, arch, _ = load_exported(out)
        assert arch == drafter.arch
        assert torch.equal(_our_output(ours, feats, emb), want)

        from transformers import AutoModel

        hf = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
        assert type(hf).__name__ == "DFlashDraftModel"
        assert sorted(hf.state_dict()) == contract_keys(2)
        assert hf.config.sliding_window == 6 and list(hf.config.layer_types) == drafter.arch.layer_types
        got = hf(noise_embedding=emb, target_hidden=feats, position_ids=torch.arange(11 + BS)[None])
        assert torch.allclose(got, want, atol=1e-6)
