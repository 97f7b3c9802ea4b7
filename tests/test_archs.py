"""The drafter arch registry (pipeline/archs.py): it covers every arch the config accepts, each entry is whole and
consistent, the drafters' own `pick` is the serving decision (DFlash's argmax, DFlash 2's selector walk), and no
module outside the registry and the archs' own files tells the archs apart by other means (a test over the
source, so that a new dispatch point fails here, not in review)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from helpers_cli import TINY
from helpers_drafters import TINY_ARCH
from pipeline import config as config_module
from pipeline.archs import (ARCHS, DEFAULT, architectures, drafter_from_arch_dict, spec_for, spec_for_arch_dict,
                            spec_for_export, spec_of)
from pipeline.config import DrafterConfig, load_config
from pipeline.drafter import DFlashDrafter, DrafterArch
from pipeline.drafter2 import DFlash2Arch, DFlash2Drafter

ROOT = Path(__file__).resolve().parent.parent
BASE = dict(TINY_ARCH, target_layer_ids=[1, 3, 5], sliding_window=6, block_size=4, mask_token_id=3)
EXTRA = dict(vocab_size=50, conv_kernel_size=2, conv_group_size=4, selector_rank=8, selector_top_k=6)


def _drafters():
    torch.manual_seed(0)
    return {"dflash": DFlashDrafter(DrafterArch(**BASE)), "dflash2": DFlash2Drafter(DFlash2Arch(**BASE, **EXTRA))}


def test_the_registry_covers_exactly_the_archs_the_config_accepts():
    assert tuple(config_module.DRAFTER_ARCHS) == tuple(ARCHS)
    assert config_module._CHOICES[("drafter", "arch")] == tuple(ARCHS)
    for name, section in config_module._arch_sections().items():  # an arch's keys: its own section, its own check
        keys = [f.name for f in dataclasses.fields(section)]
        assert keys == [*ARCHS[name].config_keys, *ARCHS[name].optional_keys] and callable(section.check), name
    assert DEFAULT in ARCHS and DrafterConfig().arch == DEFAULT
    for name in ARCHS:
        assert load_config(TINY, [f"drafter.arch={name}"]).drafter.arch == name


def test_each_entry_is_whole_and_consistent():
    made = _drafters()
    assert set(made) == set(ARCHS), "a new arch: add a tiny drafter of it to _drafters"
    assert len(set(architectures())) == len(ARCHS)
    config_fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    for name, spec in ARCHS.items():
        assert spec.name == name and spec_for(name) is spec and spec.title
        assert issubclass(spec.drafter_class, DFlashDrafter) and dataclasses.is_dataclass(spec.arch_class)
        arch_fields = {f.name for f in dataclasses.fields(spec.arch_class)}
        own = config_module._arch_sections().get(name)  # its keys' section, drafter.NAME
        own_fields = {f.name for f in dataclasses.fields(own)} if own else set()
        assert not (own_fields & config_fields), name  # no key both flat and in the section
        for key in spec.config_keys + spec.optional_keys:
            assert key in own_fields and key in arch_fields, (name, key)
        assert all(w in ARCHS and w != name for w in spec.warm_start_from)
        d = made[name]
        assert spec_of(d) is spec and isinstance(d.arch, spec.arch_class)
        assert spec_for_export({"architectures": [spec.architecture]}) is spec
        # a checkpoint records arch.to_dict(); the registry builds the same arch back
        assert spec_for_arch_dict(d.arch.to_dict()) is spec
        again = drafter_from_arch_dict(d.arch.to_dict())
        assert type(again) is spec.drafter_class and again.arch == d.arch
        assert callable(spec.build) and callable(spec.loss) and callable(spec.export) and callable(spec.load_export)
    # what names none of ours is read as DFlash (a foreign checkpoint), as pipeline.export.load_exported always did
    assert spec_for_export({}) is spec_for_export({"architectures": ["Other"]}) is ARCHS[DEFAULT]
    with pytest.raises(ValueError, match="not one of dflash, dflash2"):
        spec_for("dflash3")
    with pytest.raises(TypeError, match="registered arch"):
        spec_of(torch.nn.Linear(2, 2))


def test_subclass_of_a_drafter_is_its_arch():
    class Mine(DFlash2Drafter):
        pass

    assert spec_of(Mine(DFlash2Arch(**BASE, **EXTRA))) is ARCHS["dflash2"]


@pytest.mark.parametrize("name", list(ARCHS))
def test_build_drafter_builds_each_arch_of_the_config(name):
    from pipeline.train_step import build_drafter

    cfg = load_config(TINY, [f"drafter.arch={name}", "drafter.dflash2.selector_rank=8"])
    torch.manual_seed(0)
    d = build_drafter(cfg, [1, 3, 5], 576)
    assert type(d) is ARCHS[name].drafter_class and spec_of(d).name == name


def test_pick_is_the_argmax_for_dflash_and_the_selector_walk_for_dflash2():
    made = _drafters()
    g = torch.Generator().manual_seed(1)
    hidden, anchors = torch.randn(3, 3, 16, generator=g), torch.tensor([7, 8, 9])
    logits = torch.randn(3, 3, 50, generator=g)
    assert torch.equal(made["dflash"].pick(hidden, logits, anchors), logits.argmax(-1))
    assert made["dflash"].draws_from_logits is True
    d2 = made["dflash2"]
    with torch.no_grad():  # a selector strong enough to overrule the unary order
        for p in d2.candidate_selector.parameters():
            p.copy_(2.0 * torch.randn(p.shape, generator=g))
    walk = d2.select(hidden, logits, anchors)
    assert torch.equal(d2.pick(hidden, logits, anchors), walk)
    assert not torch.equal(walk, logits.argmax(-1))  # the override matters here
    assert d2.draws_from_logits is False


# ----------------------------------------------------------------------------------------------------------
# the source: arch dispatch only in the registry and the archs' own files
# ----------------------------------------------------------------------------------------------------------

# the registry and each arch's own files (its drafter, export and modeling file)
OWN_FILES = {"pipeline/archs.py", "pipeline/drafter.py", "pipeline/drafter2.py", "pipeline/export1.py",
             "pipeline/export2.py", "pipeline/modeling_dflash.py", "pipeline/modeling_dflash2.py"}
# attributes whose presence told the archs apart (hasattr(drafter, "select"), hasattr(drafter, "candidate_selector"))
ARCH_ATTRS = {"select", "pick", "candidate_selector", "selector_rank", "selector_top_k", "conv_kernel_size",
              "draws_from_logits"}
CLASSES = {"DFlashDrafter", "DFlash2Drafter", "DrafterArch", "DFlash2Arch"}


def arch_dispatch(tree: ast.AST) -> list[str]:
    """(line: what) for each way of telling the archs apart outside the registry: hasattr/getattr of an arch's
    attribute, isinstance/issubclass/type() against a drafter or arch class, a comparison with an arch's name or
    its export's architecture name or an arch's attribute ("selector_rank" in arch_dict), and the DFlash 2 selector
    reached from outside."""
    names = set(ARCHS) | set(architectures())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id in ("hasattr", "getattr") and len(args) >= 2 and isinstance(args[1], ast.Constant) \
                    and args[1].value in ARCH_ATTRS:
                found.append(f"{node.lineno}: {node.func.id}(..., {args[1].value!r})")
            if node.func.id in ("isinstance", "issubclass") and len(args) == 2 and any(
                    isinstance(n, ast.Name) and n.id in CLASSES for n in ast.walk(args[1])):
                found.append(f"{node.lineno}: {node.func.id}(..., {ast.unparse(args[1])})")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = [n.value for s in sides for n in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", []))
                      if isinstance(n, ast.Constant)]  # a name compared, or one of a literal tuple/list/set
            if any(isinstance(c, str) and (c in names or c in ARCH_ATTRS) for c in consts):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
            if any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides) \
                    and any(isinstance(n, ast.Name) and n.id in CLASSES for s in sides for n in ast.walk(s)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Attribute) and node.attr == "candidate_selector":
            found.append(f"{node.lineno}: .candidate_selector")
    return found


def test_no_arch_dispatch_outside_the_registry():
    bad = []
    for pkg in ("pipeline", "data", "stages"):
        for f in sorted(f for f in (ROOT / pkg).rglob("*.py") if "__pycache__" not in f.parts):  # subpackages too
            rel = f.relative_to(ROOT).as_posix()
            if rel not in OWN_FILES:
                bad += [f"{rel}:{hit}" for hit in arch_dispatch(ast.parse(f.read_text(), filename=rel))]
    assert not bad, ("tell the archs apart through pipeline/archs.py (spec_of / spec_for / spec_for_export) or the "
                     "drafter's own methods (pick, draws_from_logits), not here: " + "; ".join(bad))


@pytest.mark.parametrize("src", [
    'if hasattr(drafter, "select"):\n    pass\n',
    'x = drafter.select(h) if hasattr(drafter, "candidate_selector") else h\n',
    'if d.arch == "dflash2":\n    pass\n',
    'if "DFlash2DraftModel" in archs:\n    pass\n',
    'ok = cfg.drafter.arch in ("dflash2",)\n',
    'if "selector_rank" in d:\n    pass\n',
    'ok = isinstance(drafter, DFlash2Drafter)\n',
    'ok = type(d) is DFlashDrafter\n',
    'p = drafter.candidate_selector.parameters()\n',
])
def test_the_source_check_finds_what_it_looks_for(src):
    assert arch_dispatch(ast.parse(src))
    assert not arch_dispatch(ast.parse("spec = spec_of(drafter)\nids = drafter.pick(h, logits, a)\n"))
