"""Target families (pipeline/targets/): the family's names stay in the family's files, the one reader of a
target's config.json reads each family's layout, and each record's cache rollback is the one RollbackCache picks.

Cheap: JSON files written here and the session's tiny hybrid; no model is built except the two tiny targets the
rollback check asks about.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.targets import (FAMILIES, OTHER, SKIP_PREFIXES, TEXT_PREFIXES, family_for, linear_layer_count,
                              read_target_config)

ROOT = Path(__file__).resolve().parent.parent
# identifiers that name one family's layout: a VLM's text part, the hybrid's layer kind, module and class names,
# the weights a text model skips
NAMES = re.compile(r"\bqwen3_5\w*|\bQwen3_5\w*|\blanguage_model\b|\btext_config\b|\blinear_attention\b|GatedDeltaNet"
                   r"|[\"']mtp\.|model\.visual\.")


def _family_files() -> set[Path]:
    own = {f.resolve() for f in (ROOT / "pipeline" / "targets").glob("*.py")}
    return own | {(ROOT / f).resolve() for fam in FAMILIES.values() for f in fam.files}


def test_family_names_appear_only_in_the_family_files():
    allowed = _family_files()
    found = []
    for pkg in ("pipeline", "stages", "data"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if f.resolve() in allowed or "__pycache__" in f.parts:
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                m = NAMES.search(line)
                if m:
                    found.append(f"{f.relative_to(ROOT)}:{i}: {m.group(0)}")
    assert not found, ("a target family's names outside its files (ask pipeline/targets instead, or list the file "
                       "in the family's `files`):\n" + "\n".join(found))


def test_every_file_a_family_lists_exists_and_names_it():
    for fam in FAMILIES.values():
        assert (ROOT / "pipeline" / "targets" / f"{fam.name}.py").is_file(), fam.name
        for f in fam.files:
            assert (ROOT / f).is_file(), f"{fam.name}: {f}"


def _write(tmp_path: Path, name: str, raw: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_the_reader_takes_a_vlm_text_part_and_its_top_level_fields(tmp_path):
    """The hybrid's layout: shapes in text_config, the tied head and the quantization at the top, rope theta in
    rope_parameters; a dense file is read flat."""
    vlm = {"model_type": "qwen3_5", "tie_word_embeddings": True,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
           "text_config": {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 512,
                           "rope_parameters": {"rope_theta": 1e7},
                           "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}
    tc = read_target_config(_write(tmp_path, "vlm", vlm))
    assert tc.family is FAMILIES["qwen3_5"]
    assert (tc.num_hidden_layers, tc.hidden_size, tc.vocab_size) == (4, 64, 512)
    assert tc.tie_word_embeddings is True and tc.rope_theta == 1e7 and tc.linear_layers == 3
    assert tc.quantization == {"quant_method": "fp8", "weight_block_size": [128, 128]}
    dense = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 100, "rope_theta": 1e4,
             "tie_word_embeddings": False}
    tc = read_target_config(_write(tmp_path, "dense", dense))
    assert tc.family is FAMILIES["qwen3"] and tc.text is tc.raw
    assert (tc.num_hidden_layers, tc.rope_theta, tc.tie_word_embeddings, tc.quantization) == (2, 1e4, False, None)
    assert family_for({"model_type": "llama"}) is OTHER and linear_layer_count(vlm["text_config"]["layer_types"]) == 3


def test_the_reader_refuses_what_is_not_a_config_object(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_target_config(d)


def test_checkpoint_keys_map_by_the_families_prefixes():
    from pipeline.checkpoint import text_key

    for old, new in TEXT_PREFIXES:
        assert text_key(old + "layers.0.mlp.up_proj.weight") == new + "layers.0.mlp.up_proj.weight"
    for skip in SKIP_PREFIXES:
        assert text_key(skip + "x.weight") is None
    assert text_key("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


def test_each_family_rolls_back_as_its_record_says(hybrid):
    """The record's `rollback` is what RollbackCache.support finds on a model of the family (the shipped tiny
    dense target, the session's tiny hybrid)."""
    import torch

    from pipeline.target import load_target
    from pipeline.target_cache import RollbackCache

    kinds = {"crop": "dense", "snapshot-replay": "hybrid"}
    for path in (ROOT / "data" / "assets" / "tiny-target", hybrid):
        fam = read_target_config(path).family
        model = load_target(str(path), torch.float32, torch.device("cpu"))
        assert RollbackCache.support(model)[0] == kinds[fam.rollback], (fam.name, RollbackCache.support(model))
