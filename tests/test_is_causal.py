"""The drafter's `is_causal` key (config.json, as z-lab's reference model reads it) is read, stored
and honoured everywhere: the training step, offline and online eval, the checkpoint's arch, the export (ours and
the transformers modeling files of DFlash and DFlash 2), load_exported and the --init-from difference check; and
the published Qwen3.8-27B DFlash 2 layout (configs/qwen3.8-27b-dflash2.yaml) is exactly the published config.

The value checks use one fact of the rule: with a window longer than the whole row, a sliding layer sees what a
full layer sees on the context, so a [sliding, full] drafter with is_causal false must equal the same weights as
a [full, full] drafter (every layer bidirectional inside the block), and the default (sliding causal) must not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY
from pipeline.archs import drafter_from_arch_dict
from pipeline.config import load_config
from pipeline.drafter import DFlashDrafter, DrafterArch, draft_blocks
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter
from pipeline.export import export_drafter, hf_config_dict, load_exported
from stages.init_from import differences

pytestmark = pytest.mark.usefixtures("one_thread")  # toy-sized models (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
SF, FF = ["sliding_attention", "full_attention"], ["full_attention", "full_attention"]
H, V, BS = 16, 50, 4
ARCH = dict(hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, target_layer_ids=[1, 3], rope_theta=10000.0, max_position_embeddings=512,
            sliding_window=64, block_size=BS, mask_token_id=3)  # window 64 > every row below
D2 = dict(vocab_size=V, conv_kernel_size=2, conv_group_size=4, selector_rank=8, selector_top_k=6)

# z-lab/Qwen3.8-27B-DFlash2's config.json (DFlash2DraftModel), as the public loaders that validate against it
# mirror it (e.g. mlx-swift's and tensorfold's release-checkpoint tests): 5 sliding layers, is_causal false.
PUBLISHED = {
    "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0, "is_causal": False,
    "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 248070,
                      "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 19, 33, 47, 61]},
    "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17408, "layer_types": ["sliding_attention"] * 5, "max_position_embeddings": 262144,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5,
    "num_key_value_heads": 8, "num_target_layers": 64, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"}, "sliding_window": 2048,
    "tie_word_embeddings": False, "use_sliding_window": True, "vocab_size": 248320,
}


def _drafters(layer_types=SF, is_causal=None, two=False, seed=0):
    """A seeded drafter (DFlash or DFlash 2) with the given layer types and key; same weights for any of them."""
    torch.manual_seed(seed)
    arch = (DFlash2Arch(**ARCH, **D2, layer_types=layer_types, is_causal=is_causal) if two else
            DrafterArch(**ARCH, layer_types=layer_types, is_causal=is_causal))
    d = (DFlash2Drafter if two else DFlashDrafter)(arch)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return d.eval()


def _inputs(seed=2, S=12):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(S, 2 * H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, H, generator=g),
            torch.randint(4, V, (S + 1,), generator=g))


def test_the_key_is_read_from_config_and_export_and_bad_values_are_refused():
    assert DrafterArch.from_config(load_config(TINY).drafter, [1, 3, 5]).is_causal is None  # today's default
    cfg = load_config(TINY, ["drafter.is_causal=false"])
    assert DrafterArch.from_config(cfg.drafter, [1, 3, 5]).is_causal is False
    assert DFlash2Arch.from_config(cfg.drafter, [1, 3, 5], vocab_size=576).is_causal is False
    assert DrafterArch.from_exported({**PUBLISHED, "architectures": ["DFlashDraftModel"]}).is_causal is False
    assert DFlash2Arch.from_exported(PUBLISHED).is_causal is False
    assert DFlash2Arch.from_exported({k: v for k, v in PUBLISHED.items() if k != "is_causal"}).is_causal is None
    with pytest.raises(ValueError, match="is_causal must be true, false or absent, got 'false'"):
        DrafterArch.from_exported({**PUBLISHED, "is_causal": "false"})
    with pytest.raises(Exception, match=r"drafter\.is_causal: expected true or false"):
        load_config(TINY, ["drafter.is_causal=0"])
    # a training checkpoint records the arch as a dict and rebuilds it with the key (eval, export of a ckpt)
    for two in (False, True):
        d = _drafters(is_causal=False, two=two)
        assert drafter_from_arch_dict(d.arch.to_dict()).arch.is_causal is False


@pytest.mark.parametrize("two", [False, True], ids=["dflash", "dflash2"])
def test_offline_and_online_drafts_honour_is_causal(two):
    from stages.speculate import dflash_draft_fn

    feats, emb, head, tokens = _inputs()
    anchors = torch.tensor([3, 7, 12])
    _, bidir = draft_blocks(_drafters(SF, False, two), feats, anchors, tokens[anchors], emb, head, return_logits=True)
    _, full = draft_blocks(_drafters(FF, None, two), feats, anchors, tokens[anchors], emb, head, return_logits=True)
    _, dflt = draft_blocks(_drafters(SF, None, two), feats, anchors, tokens[anchors], emb, head, return_logits=True)
    torch.testing.assert_close(bidir, full)  # false: the sliding layer is bidirectional inside the block
    assert (dflt - full).abs().max() > 1e-3  # absent: the sliding layer stays causal (today's rule)
    _, causal = draft_blocks(_drafters(FF, True, two), feats, anchors, tokens[anchors], emb, head, return_logits=True)
    assert (causal - full).abs().max() > 1e-3  # true: full layers causal too, as z-lab's model reads it
    # online (stages/speculate.py): the serving draft equals the offline one under the same key
    d = _drafters(SF, False, two)
    fn = dflash_draft_fn(d, emb, head)
    for pos in (5, 9, 12):
        want = draft_blocks(d, feats[:pos], torch.tensor([pos]), tokens[pos : pos + 1], emb, head)[0].tolist()
        assert fn(feats[:pos], pos, int(tokens[pos])) == want, pos


def test_the_training_step_honours_is_causal():
    from pipeline.train_step import step_loss

    cfg = load_config(TINY)
    cfg.drafter.mask_token_id = 3
    feats, emb, head, tokens = _inputs(S=24)
    tokens, mask = tokens[:24][None], torch.ones(1, 24, dtype=torch.long)
    anchors, lens = torch.tensor([[2, 9, 15, -1]]), torch.tensor([24])

    def loss(layer_types, is_causal):
        d = _drafters(layer_types, is_causal).train()
        return step_loss(d, tokens, mask, anchors, lens, feats[None, :24], emb, head, cfg, "sdpa")[0]

    torch.testing.assert_close(loss(SF, False), loss(FF, None))
    assert abs(loss(SF, None).item() - loss(FF, None).item()) > 1e-4
    assert abs(loss(FF, True).item() - loss(FF, None).item()) > 1e-4


@pytest.mark.parametrize("two", [False, True], ids=["dflash", "dflash2"])
def test_export_writes_the_key_and_every_loader_honours_it(two, tmp_path):
    from transformers import AutoModel

    d = _drafters(SF, False, two)
    out = export_drafter(d, None, tmp_path / "x", vocab_size=V, num_target_layers=8, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["is_causal"] is False
    dflt = export_drafter(_drafters(SF, None, two), None, tmp_path / "d", vocab_size=V, num_target_layers=8)
    assert "is_causal" not in json.loads((dflt / "config.json").read_text())  # absent = the engines' default
    feats, emb, head, tokens = _inputs()
    anchors = torch.tensor([4, 9, 12])
    want, want_logits = draft_blocks(d, feats, anchors, tokens[anchors], emb, head, return_logits=True)
    ours, arch, _ = load_exported(out)
    assert arch.is_causal is False and arch == d.arch
    assert torch.equal(draft_blocks(ours, feats, anchors, tokens[anchors], emb, head), want)
    hf = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert hf.arch.is_causal is False
    block = torch.full((1, BS), 3)
    block[0, 0] = tokens[12]
    S = feats.shape[0]
    h = hf(noise_embedding=emb[block], target_hidden=feats[None], position_ids=torch.arange(S + BS)[None])[:, 1:]
    torch.testing.assert_close(h @ head.t(), want_logits[2:3])  # the serving case: the block after the context


def test_init_from_names_an_is_causal_difference_with_its_fix(tmp_path):
    cfg = load_config(TINY)
    torch.manual_seed(0)
    arch = dataclasses.replace(DrafterArch.from_config(cfg.drafter, [1, 3, 5]), is_causal=False)
    out = export_drafter(DFlashDrafter(arch), None, tmp_path / "e", vocab_size=576, num_target_layers=8)
    meta = json.loads((out / "config.json").read_text())
    attrs = {"hidden_size": 128, "target": {"vocab_size": 576}}
    assert differences(cfg, attrs, [1, 3, 5], meta) == [
        "drafter.is_causal: the export has false, the config null; set drafter.is_causal: false "
        "(--set drafter.is_causal=false)"]
    assert differences(load_config(TINY, ["drafter.is_causal=false"]), attrs, [1, 3, 5], meta) == []


def test_the_published_dflash2_preset_is_the_published_layout():
    cfg = load_config(ROOT / "configs" / "qwen3.8-27b-dflash2.yaml")
    d = cfg.drafter
    assert d.arch == "dflash2" and d.is_causal is False and d.layer_types == ["sliding_attention"] * 5
    assert cfg.target.layer_ids == [5, 19, 33, 47, 61] and d.block_size == 8 and cfg.train.gamma == 4.0
    arch = DFlash2Arch.from_config(d, cfg.target.layer_ids, vocab_size=248320)
    assert arch == DFlash2Arch.from_exported(PUBLISHED)  # every shape, window, rope, selector and mask key
    # what our export would write agrees with the published config.json on every key both carry
    ours = hf_config_dict(arch, vocab_size=248320, num_target_layers=64)
    for key in ("is_causal", "layer_types", "sliding_window", "use_sliding_window", "hidden_size", "head_dim",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                "max_position_embeddings", "rms_norm_eps", "num_target_layers", "vocab_size", "model_type"):
        assert ours[key] == PUBLISHED[key], key
    assert ours["rope_parameters"] == PUBLISHED["rope_parameters"]
    assert {k: ours["dflash_config"][k] for k in ("block_size", "mask_token_id", "target_layer_ids")} == {
        k: PUBLISHED["dflash_config"][k] for k in ("block_size", "mask_token_id", "target_layer_ids")}
    # so --init-from the published drafter, on a store of this preset's target, finds no difference at all
    assert differences(cfg, {"hidden_size": 5120, "target": {"vocab_size": 248320}}, cfg.target.layer_ids,
                       PUBLISHED) == []


# ----------------------------------------------------------------------------------------------------------
# CPU smoke tests of the GPU part (tests/test_gpu_is_causal.py, `bash bench/device_run.sh iscausal`): the same
# functions at tiny size, eager flex forward only
# ----------------------------------------------------------------------------------------------------------


def test_gpu_part_flex_check_runs_on_cpu():
    from helpers_is_causal import flex_vs_sdpa

    r = flex_vs_sdpa("cpu", S=40, compile=False, backward=False)
    assert r["out"] < 1e-5 and r["rule"] > 1e-3, r


@pytest.mark.slow
def test_gpu_part_pipeline_runs_on_cpu(tmp_path):
    from helpers_is_causal import run_pipeline

    rep = run_pipeline(tmp_path, gpu=False, samples=48, train_sets=["train.max_steps=3", "train.val_every=3",
                                                                    "train.precision=32-true"])
    assert rep["offline"]["tau"] >= 1.0
