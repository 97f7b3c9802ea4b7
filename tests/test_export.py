"""Export: the serving contract (config fields, contract keys) and round trips through transformers and our loader."""

import json

import pytest
import torch
from safetensors import safe_open

from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.export import contract_keys, export_drafter, load_exported
from pipeline.masks import make_attend

from helpers_drafters import tiny_drafter  # noqa: E402

H, BS = 16, 4
REQUIRED = [
    "architectures", "model_type", "block_size", "num_target_layers", "dflash_config", "hidden_size",
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
    "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "layer_types", "torch_dtype",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)

@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(0, target_layer_ids=[1, 3, 5], sliding_window=6, block_size=BS, mask_token_id=3,
                        max_position_embeddings=512)


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


def _our_output(d, feats, emb):
    S, Q = feats.shape[1], emb.shape[1]
    attend = make_attend("sdpa", anchors=torch.tensor([[S]]), block_size=Q, ctx_len=S,
                         layer_types=d.arch.layer_types, sliding_window=d.arch.sliding_window)
    return d(emb, d.project_context(feats), torch.arange(S, S + Q)[None], torch.arange(S)[None], attend)


def test_round_trips(drafter, tmp_path):
    out = export_drafter(drafter, drafter.arch, tmp_path / "r", vocab_size=50, num_target_layers=8, dtype="float32")
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


# ---------------------------------------------------------------------------------------------------------------
# z-lab's calling convention: forward(position_ids, noise_embedding=, target_hidden=, past_key_values=) and
# spec_generate, driven the way z-lab-based code drives its drafters
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=50, hidden_size=H, intermediate_size=32, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, initializer_range=0.3)
    return Qwen3ForCausalLM(cfg).eval()


def _hf(drafter, tmp_path, name, **kw):
    from transformers import AutoModel

    out = export_drafter(drafter, drafter.arch, tmp_path / name, dtype="float32", **kw)
    return AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_dense(drafter, tmp_path_factory):
    """The module's drafter exported and loaded back through transformers' trust_remote_code (once)."""
    return _hf(drafter, tmp_path_factory.mktemp("zlab"), "z", vocab_size=50, num_target_layers=8)


def _feats(hidden_states, ids):
    return torch.cat([hidden_states[k + 1] for k in ids], dim=-1)


def test_zlab_forward_with_a_draft_cache_in_a_zlab_style_loop(hf_dense, dense_target):
    """A loop written like z-lab's dflash_generate (draft DynamicCache with past recording, positions from its
    length, crop back to the context after each draft, only the accepted tokens' features passed next time) runs
    on our export, is lossless against greedy, and each cached forward equals a forward over the whole context."""
    from transformers import DynamicCache

    hf = hf_dense
    target, layer_ids, mask = dense_target, hf.target_layer_ids, hf.mask_token_id
    prompt = torch.tensor([[5, 9, 11, 7, 20, 31, 4, 8, 13]])
    greedy = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    with torch.no_grad():
        cache_t, cache_d = DynamicCache(config=target.config), DynamicCache(config=hf.config)
        cache_d.activate_past_recording()
        out = target(prompt, past_key_values=cache_t, use_cache=True, output_hidden_states=True)
        ids = prompt[0].tolist() + [int(out.logits[0, -1].argmax())]
        hidden, everything = _feats(out.hidden_states, layer_ids), _feats(out.hidden_states, layer_ids)
        start, steps = prompt.shape[1], 0
        while len(ids) - prompt.shape[1] < 24:
            block = torch.tensor([[ids[start]] + [mask] * (BS - 1)])
            noise = target.get_input_embeddings()(block)
            pos = torch.arange(cache_d.get_seq_length(), start + BS)[None]
            h = hf(position_ids=pos, noise_embedding=noise, target_hidden=hidden, past_key_values=cache_d, use_cache=True)
            whole = hf(position_ids=torch.arange(start + BS)[None], noise_embedding=noise, target_hidden=everything)
            torch.testing.assert_close(h, whole, rtol=1e-5, atol=1e-5)
            cache_d.crop(-(cache_d.get_seq_length() - start))
            draft = target.lm_head(h[:, 1:]).argmax(-1)[0].tolist()
            draft[steps % 2] = (draft[steps % 2] + 1) % 50 if steps % 3 == 0 else draft[steps % 2]  # some rejections
            out = target(torch.tensor([[ids[start]] + draft]), position_ids=torch.arange(start, start + BS)[None],
                         past_key_values=cache_t, use_cache=True, output_hidden_states=True)
            post = out.logits[0].argmax(-1).tolist()
            acc = 0
            while acc < len(draft) and draft[acc] == post[acc]:
                acc += 1
            ids = ids[: start + 1] + draft[:acc] + [post[acc]]
            start += acc + 1
            cache_t.crop(-(cache_t.get_seq_length() - start))
            hidden = _feats(out.hidden_states, layer_ids)[:, : acc + 1]
            everything = torch.cat([everything, hidden], dim=1)
            steps += 1
    assert ids[prompt.shape[1]:][:24] == greedy and steps < 24


def test_spec_generate_equals_greedy_and_old_positional_call_still_works(hf_dense, dense_target):
    hf = hf_dense
    prompt = torch.tensor([[5, 9, 11, 7, 20, 31, 4, 8, 13]])
    greedy = dense_target.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)[0].tolist()
    got = hf.spec_generate(target=dense_target, input_ids=prompt, max_new_tokens=30, stop_token_ids=None,
                           temperature=0.0)
    assert got[0].tolist() == greedy
    stop = greedy[prompt.shape[1] + 6]
    stats = hf.spec_generate(target=dense_target, input_ids=prompt, mask_token_id=3, max_new_tokens=30,
                             stop_token_ids=[stop], return_stats=True)
    assert stats.output_ids[0].tolist() == greedy[: greedy.index(stop, prompt.shape[1]) + 1]
    assert sum(stats.acceptance_lengths) + 1 == stats.num_output_tokens
    sampled = hf.spec_generate(target=dense_target, input_ids=prompt, max_new_tokens=12, temperature=0.8, top_k=20)
    assert sampled.shape == (1, prompt.shape[1] + 12)
    with pytest.raises(ValueError, match="mask_token_id 7 differs"):
        hf.spec_generate(target=dense_target, input_ids=prompt, mask_token_id=7, max_new_tokens=4)
    g = torch.Generator().manual_seed(1)
    feats, emb = torch.randn(1, 11, 3 * H, generator=g), torch.randn(1, BS, H, generator=g)
    pos = torch.arange(11 + BS)[None]
    with torch.no_grad():
        assert torch.equal(hf(emb, feats, pos), hf(noise_embedding=emb, target_hidden=feats, position_ids=pos))


def test_spec_generate_is_lossless_on_the_hybrid_target(hybrid, tmp_path):
    """On the Qwen3.5-layout replica, spec_generate rolls back the linear-attention states (target_cache.py)."""
    from pipeline.target import load_target

    target = load_target(str(hybrid), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    arch = DrafterArch(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, target_layer_ids=[1, 3, 5], block_size=4, mask_token_id=3,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    hf = _hf(DFlashDrafter(arch), tmp_path, "h", vocab_size=576, num_target_layers=8)
    prompt = torch.tensor([[1, 6, 20, 30, 40, 2, 7, 9]])
    greedy = target.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0].tolist()
    assert hf.spec_generate(target=target, input_ids=prompt, max_new_tokens=20)[0].tolist() == greedy
