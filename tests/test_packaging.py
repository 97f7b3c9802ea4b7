"""An installed dflash (non-editable, `pip install .`) works outside a checkout: the console script runs and the
default run config (configs/tiny.yaml, shipped as data-files) is found from another directory; and every package of
the source tree (subpackages too) is one pyproject.toml installs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_installs_every_package_of_the_tree():
    """A subpackage missing from [tool.setuptools] packages works in a checkout and is absent from an install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(f.parent.relative_to(ROOT).parts) for top in ("pipeline", "stages", "data")
            for f in (ROOT / top).rglob("__init__.py") if "__pycache__" not in f.parts}
    assert "pipeline.targets" in tree and tree == listed, sorted(tree ^ listed)


@pytest.mark.slow
def test_non_editable_install_finds_its_default_config_outside_a_checkout(tmp_path):
    src = tmp_path / "src"  # a copy, so that the build's build/ and *.egg-info never touch the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("pipeline", "stages", "data", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    prefix = tmp_path / "prefix"
    # no dependencies and no build isolation: the test venv already has them and setuptools (no network here).
    # --ignore-installed: without it pip first uninstalls the venv's own (editable) dflash, and every later test
    # that runs a script outside the checkout's root could no longer import the project
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--ignore-installed", "--prefix", str(prefix), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))
    assert sorted(p.name for p in (prefix / "share" / "dflash" / "configs").glob("*.yaml")) == sorted(
        p.name for p in (ROOT / "configs").glob("*.yaml"))

    elsewhere = tmp_path / "elsewhere"  # not a checkout: nothing named configs/ or pipeline/ around
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": ""}
    code = ("import pipeline, pipeline.targets, pipeline.config as c; from stages.cli import DEFAULT_CONFIG; cfg = c.load_config(); "
            "print(pipeline.__file__); print(c.CONFIGS_DIR); print(DEFAULT_CONFIG); print(cfg.target.name)")
    r = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    module, configs, default, target = r.stdout.split()
    assert Path(module).is_relative_to(site)  # the installed copy, not the checkout
    assert Path(configs) == (prefix / "share" / "dflash" / "configs").resolve()
    assert Path(default) == Path(configs) / "tiny.yaml"
    assert target == "dflash-tiny-target"

    r = subprocess.run([str(prefix / "bin" / "dflash"), "--help"], cwd=elsewhere, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "extract" in r.stdout and "train" in r.stdout, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "pip", "show", "dflash"], capture_output=True, text=True)
    assert r.returncode == 0 and "Editable project location" in r.stdout  # the test venv's install is untouched

