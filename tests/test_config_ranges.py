"""Every numeric config key has an allowed range (pipeline/config_ranges.py), checked at load before anything is
created: one line naming the file, the key, the range and the value (issue 27: `train.warmup_ratio=7` and
`train.grad_clip=-1` were accepted; a negative `train.lr` or `train.num_workers` died with a traceback later)."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import TINY  # noqa: E402
from pipeline.config import Config, ConfigError, gamma_for_block, load_config  # noqa: E402
from pipeline.config_ranges import RANGES, Range  # noqa: E402


def _field_types() -> dict[tuple[str, str], tuple[type, bool, bool]]:
    """(section, key) -> (int or float, nullable, list) for every numeric field of the config's sections."""
    out = {}
    sections = [(s, c) for s, c in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(c)]
    for section, cls in sections:  # an arch's section inside drafter ("drafter.dflash2") is walked too
        sections += [(f"{section}.{k}", t) for k, t in typing.get_type_hints(cls).items() if dataclasses.is_dataclass(t)]
    for section, cls in sections:
        for key, tp in typing.get_type_hints(cls).items():
            nullable = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
            if nullable:
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            is_list = typing.get_origin(tp) is list
            if is_list:
                (tp,) = typing.get_args(tp)
            if tp in (int, float):
                out[(section, key)] = (tp, nullable, is_list)
    return out


FIELDS = _field_types()


def test_every_numeric_key_has_a_range():
    assert len(FIELDS) > 60
    assert sorted(set(FIELDS) - set(RANGES)) == [], "numeric config keys without a range in config_ranges.RANGES"
    assert sorted(set(RANGES) - set(FIELDS)) == [], "ranges of keys the config does not have"


def _bad_values(rng: Range, tp: type) -> list:
    bad = []
    if rng.lo is not None:
        bad.append(tp(rng.lo) if rng.lo_open else tp(rng.lo - 1))
    if rng.hi is not None:
        bad.append(tp(rng.hi) if rng.hi_open else tp(rng.hi + 1))
    if tp is float:
        bad += [math.nan, math.inf]
    return [b for b in bad if b not in rng.also]


def _good_values(rng: Range, tp: type, nullable: bool) -> list:
    good = list(rng.also) + ([None] if nullable else [])
    if rng.lo is not None and not rng.lo_open:
        good.append(tp(rng.lo))
    if rng.hi is not None and not rng.hi_open:
        good.append(tp(rng.hi))
    return good


def _yaml(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, float) and math.isnan(v):
        return ".nan"
    if isinstance(v, float) and math.isinf(v):
        return ".inf"
    return repr(v)


PAIR_OTHER = {"betas": "0.9", "profile_steps": "5"}
PAIR_GOOD = {"betas": lambda v: v, "profile_steps": lambda v: v + 1}  # the second entry beside a good first one

CASES = [(s, k, bad) for (s, k), rng in RANGES.items() for bad in _bad_values(rng, FIELDS[(s, k)][0])]


@pytest.mark.parametrize("section,key,bad", CASES, ids=[f"{s}.{k}={b}" for s, k, b in CASES])
def test_a_value_out_of_range_is_one_line_naming_file_key_range_and_value(section, key, bad, tmp_path):
    is_list = FIELDS[(section, key)][2]
    # a pair's other entry a valid one (betas: both in [0, 1); profile_steps: [first, last) with first < last)
    value = f"[{_yaml(bad)}, {PAIR_OTHER[key]}]" if key in PAIR_OTHER else f"[{_yaml(bad)}]" if is_list else _yaml(bad)
    path = tmp_path / "bad.yaml"
    outer, _, inner = section.partition(".")  # drafter.dflash2: the arch's section nested in drafter
    path.write_text(f"{outer}:\n  {inner}:\n    {key}: {value}\n" if inner else f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    where = f"{section}.{key}[0]" if is_list else f"{section}.{key}"
    assert msg == f"{path}: {where} must be {RANGES[(section, key)].describe()}, got {bad!r}"


@pytest.mark.parametrize("section,key", list(RANGES), ids=[f"{s}.{k}" for s, k in RANGES])
def test_the_bounds_themselves_and_null_are_accepted_where_allowed(section, key):
    tp, nullable, is_list = FIELDS[(section, key)]
    extra = {("drafter", "block_size"): ["drafter.dflash2.conv_kernel_size=1"],  # keep the cross checks satisfied
             ("drafter", "max_position_embeddings"): ["data.max_length=1"],
             ("drafter", "num_key_value_heads"): ["drafter.num_attention_heads=1"],
             ("drafter", "num_attention_heads"): ["drafter.num_key_value_heads=1"],
             ("drafter", "num_hidden_layers"): ["drafter.layer_types=null"],
             ("drafter", "sliding_window"): ["drafter.layer_types=null"],
             ("train", "anchors_per_token"): ["train.anchor_rule=proportional"],
             ("train", "pack_tokens"): ["train.packing=true"]}.get((section, key), [])
    for good in _good_values(RANGES[(section, key)], tp, nullable):
        value = _yaml(good)
        value = (f"[{value}, {PAIR_GOOD[key](good)}]" if key in PAIR_GOOD and good is not None
                 else f"[{value}]" if is_list and good is not None else value)
        fit = []  # pack_tokens: a data.max_length that [max_length, 64 x max_length] holds it in (config._validate)
        if key == "pack_tokens" and good is not None:
            fit = [f"data.max_length={-(-good // 64)}", "drafter.max_position_embeddings=262144"]
        cfg = load_config(TINY, [*extra, *fit, f"{section}.{key}={value}"])
        owner = cfg
        for part in section.split("."):
            owner = getattr(owner, part)
        got = getattr(owner, key)
        if key == "gamma" and good is None:  # null: the paper's value for the block size
            assert got == gamma_for_block(cfg.drafter.block_size)
        elif good is not None and is_list:
            assert got[0] == good
        else:
            assert got == good


@pytest.mark.parametrize("setting,text", [
    ("train.warmup_ratio=7", "train.warmup_ratio must be in [0, 1], got 7.0"),
    ("train.grad_clip=-1", "train.grad_clip must be 0 or more, or null (0 and null: no clipping), got -1.0"),
    ("train.lr=-3e-4", "train.lr must be 0 or more, got -0.0003"),
    ("train.num_workers=-1", "train.num_workers must be 0 or more, got -1"),
])
def test_the_cli_refuses_the_issues_values_before_creating_anything(setting, text, tmp_path):
    from stages.cli import main

    run_dir = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--config", TINY, "--set", setting, "--set", f"train.run_dir={run_dir}",
                                  "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 2 and r.output.strip() == f"error: --set {setting!r}: {text}"
    assert list(tmp_path.iterdir()) == []

