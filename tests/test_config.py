"""Configs: every shipped YAML loads; unknown keys, wrong types and bad values are rejected naming key and file;
--set overrides are validated the same way; the layer-id rule."""

from pathlib import Path

import pytest

from pipeline.config import ConfigError, build_target_layer_ids, load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.drafter.block_size >= 2 and cfg.train.lr > 0


def test_27b_configs_hold_the_recipe():
    for name in ("qwen3.6-27b.yaml", "qwen3.5-27b.yaml"):
        c = load_config(Path(CONFIGS[0]).parent / name)
        assert c.target.layer_ids == [1, 16, 31, 46, 61] == build_target_layer_ids(64, 5)
        d, t = c.drafter, c.train
        assert (d.mask_token_id, d.block_size, d.num_hidden_layers, d.hidden_size) == (248070, 16, 5, 5120)
        assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.intermediate_size) == (32, 8, 128, 17408)
        assert d.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and d.sliding_window == 2048
        assert (t.lr, t.warmup_ratio, t.epochs, t.grad_clip, t.num_anchors, t.gamma) == (6e-4, 0.04, 6, 1.0, 512, 7.0)
        assert c.data.max_length == 3072


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_key_and_file(tmp_path):
    p = _write(tmp_path, "train:\n  lr: 1.0e-3\n  learning_rate: 3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*train\.learning_rate"):
        load_config(p)
    with pytest.raises(ConfigError, match="unknown section 'trian'"):
        load_config(_write(tmp_path, "trian: {}\n"))


def test_wrong_types_and_values(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.epochs: expected an integer"):
        load_config(_write(tmp_path, "train: {epochs: six}\n"))
    with pytest.raises(ConfigError, match=r"store\.encoding = 'int3'"):
        load_config(_write(tmp_path, "store: {encoding: int3}\n"))
    with pytest.raises(ConfigError, match="layer_types has 1 entries"):
        load_config(_write(tmp_path, "drafter: {num_hidden_layers: 2, layer_types: [full_attention]}\n"))


def test_overrides_are_validated(tmp_path):
    p = _write(tmp_path, "train: {lr: 1.0e-3}\n")
    assert load_config(p, ["train.lr=3e-4"]).train.lr == 3e-4
    assert load_config(p, ["target.layer_ids=[1,2,3]"]).target.layer_ids == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"train\.nope"):
        load_config(p, ["train.nope=1"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(p, ["lr=3"])
    with pytest.raises(ConfigError, match="expected a number"):
        load_config(p, ["train.lr=fast"])


def test_on_off_choices_survive_yaml_booleans(tmp_path):
    """YAML 1.1 reads `on`/`off` as true/false: `--set train.compile=on` (as the README writes it) and
    `compile: off` in a file mean the words, not a type error; other keys still refuse a boolean."""
    p = _write(tmp_path, "train: {compile: off}\n")
    assert load_config(p).train.compile == "off"
    assert load_config(p, ["train.compile=on"]).train.compile == "on"
    with pytest.raises(ConfigError, match="expected a string"):
        load_config(p, ["store.encoding=on"])


def test_layer_id_rule():
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(8, 3) == [1, 3, 5]
    assert build_target_layer_ids(36, 1) == [18]


def test_gamma_follows_the_block_size_unless_set():
    """The loss decay is the paper's value for the block size: changing drafter.block_size alone must not leave
    the 16-slot gamma behind."""
    assert load_config().train.gamma == 4.0  # tiny: block size 8
    assert load_config(None, ["drafter.block_size=16"]).train.gamma == 7.0
    assert load_config(None, ["drafter.block_size=10"]).train.gamma == 5.0
    assert load_config(None, ["drafter.block_size=16", "train.gamma=3.5"]).train.gamma == 3.5


def test_ddp_options_are_validated_and_reach_distributed_data_parallel(tmp_path):
    from stages.train import ddp_strategy

    p = _write(tmp_path, "train: {ddp_bucket_cap_mb: 200, ddp_gradient_as_bucket_view: true, ddp_static_graph: true}\n")
    s = ddp_strategy(load_config(p), use_gpu=False)
    assert s._ddp_kwargs == {"bucket_cap_mb": 200.0, "gradient_as_bucket_view": True, "static_graph": True}
    assert s.process_group_backend == "gloo"
    assert ddp_strategy(load_config(None), use_gpu=False)._ddp_kwargs == {  # torch's own defaults
        "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False, "static_graph": False}
    with pytest.raises(ConfigError, match="ddp_bucket_cap_mb must be positive"):
        load_config(p, ["train.ddp_bucket_cap_mb=0"])
    with pytest.raises(ConfigError, match="ddp_static_graph"):
        load_config(p, ["train.ddp_static_graph=sometimes"])


def test_a_drafters_config_resolves_from_the_flag_the_run_the_checkpoint_then_tiny(tmp_path):
    """`dflash eval`'s config (pipeline/config.resolve_config): --config; else RUN/config.yaml; else the config a
    checkpoint carries; else configs/tiny.yaml; --set applies to whichever it is, and the source is named."""
    from pipeline.config import dump_config, resolve_config

    tiny = load_config(None)
    run_config = tmp_path / "config.yaml"
    run_config.write_text(dump_config(load_config(None, ["train.lr=0.5"])))
    cfg, source = resolve_config(None, ["train.seed=7"], run_config=run_config, embedded=tiny.to_dict())
    assert source == str(run_config) and cfg.train.lr == 0.5 and cfg.train.seed == 7
    cfg, source = resolve_config(str(run_config), (), run_config=tmp_path / "nope.yaml")
    assert source == str(run_config) and cfg.train.lr == 0.5
    embedded = load_config(None, ["train.lr=0.25"]).to_dict()
    cfg, source = resolve_config(None, ["train.seed=9"], run_config=tmp_path / "nope.yaml", embedded=embedded,
                                 embedded_source="x.ckpt (embedded config)")
    assert source == "x.ckpt (embedded config)" and cfg.train.lr == 0.25 and cfg.train.seed == 9
    assert embedded["train"]["seed"] == tiny.train.seed  # the checkpoint's own dict is left as it was
    with pytest.raises(ConfigError, match="unknown section 'trian'"):
        resolve_config(None, ["trian.lr=1"], embedded=embedded)
    cfg, source = resolve_config(None, ())
    assert source == "configs/tiny.yaml (default)" and cfg.to_dict() == tiny.to_dict()
