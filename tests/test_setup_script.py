"""scripts/setup.sh's torch choice, through its --dry-run mode (which changes nothing): an installed torch is kept
and named, otherwise the CPU build comes from DFLASH_TORCH_INDEX (or pip's configured index when it is empty)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _dry_run(tmp_path: Path, python: str, **env: str) -> str:
    """The script copied into an empty tree (no .venv), run with --dry-run; its output."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    full = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_TORCH")}
    r = subprocess.run(["bash", "scripts/setup.sh", "--dry-run"], cwd=tmp_path, capture_output=True, text=True,
                       env={**full, "PYTHON": python, **env}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["py", "scripts"]  # no .venv made, nothing installed
    return r.stdout


def _python(tmp_path: Path) -> Path:
    """This interpreter without its site-packages (-S): no torch, and no pip to find a local wheel with."""
    py = tmp_path / "py"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    py.chmod(0o755)
    return py


def _fake_torch(where: Path, version: str, cuda: str | None) -> str:
    (where / "torch").mkdir(parents=True)
    (where / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n")
    return str(where)


def test_an_installed_torch_is_kept_and_named(tmp_path):
    py = _python(tmp_path)
    cuda = _dry_run(tmp_path, str(py), PYTHONPATH=_fake_torch(tmp_path.parent / f"{tmp_path.name}-cu", "2.11.0+cu128", "12.8"))
    assert "setup: torch 2.11.0+cu128 (CUDA 12.8) is installed: kept, it is the build this GPU machine needs" in cuda
    cpu = _dry_run(tmp_path, str(py), PYTHONPATH=_fake_torch(tmp_path.parent / f"{tmp_path.name}-cpu", "2.13.0+cpu", None))
    assert "setup: torch 2.13.0+cpu (CPU build) is installed: kept" in cpu
    for out in (cuda, cpu):
        assert "install -q torch" not in out and "--index-url" not in out
        assert f"would run: {py} -m pip install -q -e .[dev]" in out
        assert out.rstrip().endswith("setup: dry run, nothing was changed")


def test_without_torch_the_cpu_build_comes_from_the_named_index(tmp_path):
    no_torch = _python(tmp_path)
    out = _dry_run(tmp_path, str(no_torch), DFLASH_TORCH_INDEX="https://mirror.example/whl/cpu")
    assert "installing the CPU build torch==2.13.0+cpu from https://mirror.example/whl/cpu (DFLASH_TORCH_INDEX" in out
    assert f"would run: {no_torch} -m pip install -q --index-url https://mirror.example/whl/cpu torch==2.13.0+cpu" in out
    out = _dry_run(tmp_path, str(no_torch), DFLASH_TORCH_INDEX="", DFLASH_TORCH="2.12.1")
    assert "installing torch==2.12.1 from pip's configured index (DFLASH_TORCH_INDEX is empty)" in out
    assert "--index-url" not in out
    default = _dry_run(tmp_path, str(no_torch))
    assert "from https://download.pytorch.org/whl/cpu" in default
