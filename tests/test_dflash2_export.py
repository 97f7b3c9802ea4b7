"""DFlash 2's serving contract (key names and shapes, config keys, the transformers modeling file), lossless
speculative decoding with the selector's drafts, and the whole pipeline on the tiny target (slow)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.drafter import DFlashDrafter, DrafterArch, draft_blocks
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter
from pipeline.export import export_drafter, load_exported
from pipeline.export2 import contract_keys2

from helpers_cli import dflash  # noqa: E402
from helpers_drafters import TINY_ARCH  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
H, V, BS = 16, 50, 4
BASE = dict(TINY_ARCH, target_layer_ids=[1, 3, 5], sliding_window=6, block_size=BS, mask_token_id=3,
            max_position_embeddings=512)
EXTRA = dict(vocab_size=V, conv_kernel_size=2, conv_group_size=4, selector_rank=8, selector_top_k=6)


def pair(seed=0, **extra):
    """A DFlash drafter and the DFlash 2 drafter built from the same seed (the same backbone), both randomised
    beyond their initial values so that every parameter matters."""
    torch.manual_seed(seed)
    d1 = DFlashDrafter(DrafterArch(**BASE))
    torch.manual_seed(seed)
    d2 = DFlash2Drafter(DFlash2Arch(**BASE, **{**EXTRA, **extra}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in d1.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
            d2.state_dict()[n].copy_(p)
    return d1, d2


def randomise_new(d2, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in d2.named_parameters():
            if "_conv." in n or "candidate_selector" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return d2


def test_contract_names_shapes_and_config(tmp_path):
    _, d2 = pair(output_multiplier=0.25, final_logit_softcapping=20.0)
    out = export_drafter(d2, None, tmp_path / "x", vocab_size=V, num_target_layers=8, extra_metadata={"store": "s"})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3" and cfg["vocab_size"] == V
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3, 5], "block_size": BS,
                                    "conv_kernel_size": 2, "conv_group_size": 4, "selector_rank": 8, "selector_top_k": 6,
                                    "output_multiplier": 0.25, "final_logit_softcapping": 20.0}
    assert "is_causal" not in cfg and "partial_rotary_factor" not in cfg
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}
    G = H // 4
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    assert keys == contract_keys2(2)
    for i in range(2):
        for side in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{side}.base_kernel"] == (2, 2, H)
            assert shapes[f"layers.{i}.{side}.kernel_projection.weight"] == (2 * 2 * G, H)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, H)
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == (V, 8)
    assert shapes["fc.weight"] == (H, 3 * H) and not any("embed" in k or "lm_head" in k for k in keys)
    # defaults are left out (the engines default them); SGLang mode has no auto_map
    _, plain = pair()
    cfg = json.loads((export_drafter(plain, None, tmp_path / "p", vocab_size=V, num_target_layers=8,
                                     for_sglang=True) / "config.json").read_text())
    assert "output_multiplier" not in cfg["dflash_config"] and "final_logit_softcapping" not in cfg["dflash_config"]
    assert "auto_map" not in cfg
    _, _, meta = load_exported(out)
    assert meta["dflash_meta"] == {"store": "s"}


def test_the_modeling_file_is_a_module_of_pipeline_copied_whole(tmp_path):
    """modeling_dflash2.py is pipeline/modeling_dflash2.py (a real module, imported here as one), copied byte for byte
    with what it imports, as DFlash's modeling_dflash.py is."""
    import pipeline.modeling_dflash as m1
    import pipeline.modeling_dflash2 as m2

    assert issubclass(m2.DFlash2DraftModel, m1.DFlashDraftModel) and m2.DFlash2DraftModel.select is DFlash2Drafter.select
    _, d2 = pair()
    out = export_drafter(d2, None, tmp_path / "m", vocab_size=V, num_target_layers=8)
    for name in ("modeling_dflash2.py", "drafter2.py", "modeling_dflash.py", "drafter.py", "masks.py", "target_cache.py"):
        assert (out / name).read_bytes() == (ROOT / "pipeline" / name).read_bytes(), name


def test_refusals(tmp_path):
    _, d2 = pair()
    with pytest.raises(ValueError, match="vocab_size"):
        export_drafter(d2, None, tmp_path / "v", vocab_size=V + 1, num_target_layers=8)
    out = export_drafter(d2, None, tmp_path / "c", vocab_size=V, num_target_layers=8)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"]["selector_rank"]
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "checksums.sha256").unlink()  # a hand-edited export: its checksums would refuse it first
    with pytest.raises(ValueError, match="selector_rank"):
        load_exported(out)


def _hidden(model, feats, emb):
    S, Q = feats.shape[1], emb.shape[1]
    return model(noise_embedding=emb, target_hidden=feats, position_ids=torch.arange(S + Q)[None])


def test_round_trips_through_our_loader_and_transformers(tmp_path):
    _, d2 = pair()
    randomise_new(d2)
    out = export_drafter(d2, None, tmp_path / "r", vocab_size=V, num_target_layers=8, dtype="float32")
    g = torch.Generator().manual_seed(2)
    feats, head, emb = torch.randn(12, 3 * H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    anchors, ids = torch.tensor([4, 9, 12]), torch.tensor([7, 8, 9])
    want, want_logits = draft_blocks(d2, feats, anchors, ids, emb, head, return_logits=True)
    ours, arch, _ = load_exported(out)
    assert arch == d2.arch and isinstance(ours, DFlash2Drafter)
    assert torch.equal(draft_blocks(ours, feats, anchors, ids, emb, head), want)

    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    assert type(hf).__name__ == "DFlash2DraftModel" and sorted(hf.state_dict()) == contract_keys2(2)
    for k, v in d2.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v), k  # loaded, not re-initialised
    block = torch.full((1, BS), 3)
    block[0, 0] = 9
    h = _hidden(hf, feats[None], emb[block])[:, 1:]  # the serving case: one block right after the context
    torch.testing.assert_close(h @ head.t(), want_logits[2:3])
    assert torch.equal(hf.select(h, h @ head.t(), torch.tensor([9])), want[2:3])


def test_zero_corrections_and_selector_equal_the_dflash_backbone(tmp_path):
    """A DFlash 2 export whose convolutions are identity and whose selector is zero drafts exactly what its DFlash
    backbone's export drafts, in transformers as in our loader; switching either module on changes the drafts."""
    from transformers import AutoModel

    d1, d2 = pair(seed=3)
    with torch.no_grad():
        for p in d2.candidate_selector.parameters():
            p.zero_()
    e1 = export_drafter(d1, None, tmp_path / "d1", vocab_size=V, num_target_layers=8, dtype="float32")
    e2 = export_drafter(d2, None, tmp_path / "d2", vocab_size=V, num_target_layers=8, dtype="float32")
    g = torch.Generator().manual_seed(4)
    feats, head, emb = torch.randn(14, 3 * H, generator=g), torch.randn(V, H, generator=g) * 3, torch.randn(V, H, generator=g)
    anchors, ids = torch.arange(0, 15), torch.randint(0, V, (15,), generator=g)
    a = draft_blocks(load_exported(e1)[0], feats, anchors, ids, emb, head)
    assert torch.equal(draft_blocks(load_exported(e2)[0], feats, anchors, ids, emb, head), a)
    h1m = AutoModel.from_pretrained(str(e1), trust_remote_code=True, dtype=torch.float32)
    h2m = AutoModel.from_pretrained(str(e2), trust_remote_code=True, dtype=torch.float32)
    block = torch.full((1, BS), 3)
    block[0, 0] = int(ids[-1])
    x1, x2 = _hidden(h1m, feats[None], emb[block])[:, 1:], _hidden(h2m, feats[None], emb[block])[:, 1:]
    torch.testing.assert_close(x1, x2, rtol=0, atol=0)
    assert torch.equal(h2m.select(x2, x2 @ head.t(), ids[-1:]), (x1 @ head.t()).argmax(-1))
    assert torch.equal((x1 @ head.t()).argmax(-1), a[-1:])
    randomise_new(d2, seed=9)
    with torch.no_grad():
        d2.candidate_selector.predecessor_codebook.mul_(30)
    assert not torch.equal(draft_blocks(d2, feats, anchors, ids, emb, head), a)


def test_selector_drafts_decode_losslessly_on_a_random_target():
    """speculative_decode with a DFlash 2 draft_fn (the selector's walk) equals greedy token for token, and the
    draft_fn's tokens are draft_blocks' (the offline eval's) for the same context."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stages.speculate import TargetRunner, dflash_draft_fn, greedy_decode, speculative_decode

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                          max_position_embeddings=256, tie_word_embeddings=False,
                                          initializer_range=0.2)).eval()
    torch.manual_seed(1)
    arch = DFlash2Arch(**{**BASE, "hidden_size": 48, "head_dim": 12, "target_layer_ids": [1, 3]},
                       **{**EXTRA, "vocab_size": 96})
    d2 = randomise_new(DFlash2Drafter(arch)).eval()
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    fn = dflash_draft_fn(d2, emb, head)
    runner = TargetRunner(target, "kv")
    g = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the online eval on a tiny target: thread hand-offs cost more than they save
    try:
        for trial in range(2):
            prompt = torch.randint(4, 96, (6 + 3 * trial,), generator=g).tolist()
            greedy = greedy_decode(runner, prompt, 20, set())
            spec = speculative_decode(runner, fn, prompt, [1, 3], BS, 20, set())
            assert spec.tokens == greedy.tokens, trial
            assert len(spec.steps) < len(greedy.tokens)  # some drafts were accepted: the walk was exercised
    finally:
        torch.set_num_threads(threads)
    feats = torch.randn(9, 2 * 48, generator=g)
    fn.reset()
    with torch.no_grad():
        assert fn(feats, 9, 17) == draft_blocks(d2, feats, torch.tensor([9]), torch.tensor([17]), emb, head)[0].tolist()


@pytest.mark.slow
def test_train_steps_resumes_exports_and_decodes_losslessly_on_the_tiny_target(tiny_store, tmp_path):
    """The whole pipeline with drafter.arch=dflash2: extract -> train (2 DDP ranks over gloo, a few steps) ->
    resume from the checkpoint -> export -> eval offline and online, lossless; the export is DFlash 2. The
    extraction is the session's tiny store (tests/conftest.py: a store does not depend on the drafter's arch;
    training and eval only read it)."""
    store, run = tiny_store, tmp_path / "run"
    sets = ["drafter.arch=dflash2", "drafter.dflash2.selector_rank=32", f"train.run_dir={run}", "train.batch_size=4",
            "train.num_workers=0", "train.val_every=6", "train.log_every=2", "train.checkpoint_every=3"]
    args = ["train", "--config", TINY, "--store", store, "--devices", "2", *[x for s in sets for x in ("--set", s)]]
    dflash(*args, "--set", "train.max_steps=6", "--no-export")
    first = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert first["global_step"] == 6 and first["dflash"]["arch"]["selector_rank"] == 32  # the DFlash 2 arch
    dflash(*args, "--set", "train.max_steps=10", "--resume")
    assert json.loads((run / "summary.json").read_text())["global_step"] == 10
    cfg = json.loads((run / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_rank"] == 32
    header = (run / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert "train/selector_loss" in header and "train/topk_coverage" in header
    out = tmp_path / "eval"
    dflash("eval", str(run / "export"), "--store", store, "--online", "--out", str(out), "--set", "eval.num_prompts=4",
           "--set", "eval.max_new_tokens=24", "--set", "eval.max_anchors_per_sample=16")
    rep = json.loads((out / "report.json").read_text())
    assert rep["online"]["lossless"] and rep["online"]["mismatches"] == 0
    assert rep["offline"]["tau"] >= 1.0 and rep["online"]["tau"] >= 1.0 and rep["offline"]["blocks"] > 0
