"""The periphery stays tied to the core (issue 44 item 3): every `bench/` and `scripts/` module's imports of the
project resolve, lazy ones inside functions too, and the repository tracks no binary.

A bench that imports a function the core has since renamed runs fine in every CPU test and fails on the GPU
machine, where device minutes are scarce (bench/ckpt_bench.py once imported `stages.train._streaming_checkpoint_io`
for months after it moved). The check reads the sources with `ast`, then imports only the project modules named,
so it needs neither a GPU nor the benches' own dependencies.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("pipeline", "data", "stages", "bench", "scripts")
PERIPHERY = ("bench", "scripts")
# The one shipped binary: the small target that the project trains itself (scripts/make_tiny_target.py rebuilds it
# bit for bit; data/assets/README.md says how), which the learning-quality tests and the demo need offline.
SHIPPED_ASSETS = {"data/assets/tiny-target/model.safetensors"}
BINARY_SUFFIXES = (".whl", ".so", ".pt", ".ckpt", ".safetensors", ".bin", ".zip", ".tar", ".gz", ".pyc", ".npy")


def project_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of each import of a project module in `path`; name None for `import mod`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] in PROJECT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PROJECT:
                found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


def unresolved(path: Path) -> list[str]:
    """The imports of `path` that name a project module or attribute that does not exist."""
    bad = []
    for line, module, name in project_imports(path):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            bad.append(f"{path.name}:{line}: no module {e.name}")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:  # `from pkg import submodule`
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                bad.append(f"{path.name}:{line}: {module} has no {name}")
    return bad


@pytest.mark.parametrize("folder", PERIPHERY)
def test_every_bench_and_script_import_of_the_project_resolves(folder):
    files = sorted((ROOT / folder).glob("*.py"))
    assert files, f"{folder}/ has no Python files"
    bad = [b for f in files for b in unresolved(f)]
    assert not bad, "imports of functions the core no longer has:\n" + "\n".join(bad)


def test_the_check_sees_a_lazy_import_of_a_missing_function(tmp_path):
    planted = tmp_path / "old_bench.py"
    planted.write_text("def run():\n    from stages.train_ckpt_io import _gone_helper\n    return _gone_helper()\n")
    assert unresolved(planted) == ["old_bench.py:2: stages.train_ckpt_io has no _gone_helper"]


def test_the_repository_tracks_no_binary():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    binaries = [p for p in tracked.split() if p.endswith(BINARY_SUFFIXES) and p not in SHIPPED_ASSETS]
    assert not binaries, f"binaries committed (delete them, and .gitignore their kind): {binaries}"
