"""The import graph of the three top-level packages: no import circle, and no import from a lower floor to a higher
one (`pipeline` < `data` < `stages`: the library, the data layer, the commands); and zarr imported by the store
layer only (`STORE_LAYER`: every other module reads and writes the store through pipeline/store.py, its reader
and its writer).

Every import counts, a lazy one inside a function too: a lazy import only hides a circle from the interpreter, not
from the reader. Read with `ast` from the source files, so the test needs no import of the modules themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("pipeline", "data", "stages")  # lowest first
STORE_LAYER = {"pipeline.store", "pipeline.store_reader", "pipeline.store_writer", "pipeline.store_lock"}  # zarr: these only


def _module_name(path: Path, root: Path = ROOT) -> str:
    """Dotted name from the tree root, subpackages included: pipeline/sub/a.py -> pipeline.sub.a."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path, pkg: str) -> list[Path]:
    """Every module of a package, its subpackages' too (a guard that reads only the top folder misses them)."""
    return sorted(f for f in (root / pkg).rglob("*.py") if "__pycache__" not in f.parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from pkg import mod` counts as importing `pkg.mod`)."""
    files = {_module_name(f, root): f for pkg in FLOORS for f in source_files(root, pkg)}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level == 1 else (node.module or "")
                if node.level == 1 and node.module:
                    base = f"{package}.{node.module}"
                elif node.level > 1:
                    raise AssertionError(f"{path}: relative import beyond the package; import it absolutely")
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _names_zarr(name: str) -> bool:
    return name == "zarr" or name.startswith("zarr.")


def zarr_importers(root: Path = ROOT) -> set[str]:
    """Modules of the three packages that import zarr anywhere in the file: `import zarr[.x]`, `from zarr[.x] import
    ...`, at the top or inside a function, or by name (`importlib.import_module("zarr")`, `__import__("zarr")`)."""
    found = set()
    for pkg in FLOORS:
        for f in source_files(root, pkg):
            for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
                if isinstance(node, ast.Import):
                    hit = any(_names_zarr(a.name) for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    hit = node.level == 0 and _names_zarr(node.module or "")
                elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                    fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    hit = (fn in ("import_module", "__import__") and isinstance(node.args[0].value, str)
                           and _names_zarr(node.args[0].value))
                else:
                    hit = False
                if hit:
                    found.add(_module_name(f, root))
    return found


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    level = {p: i for i, p in enumerate(FLOORS)}
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                  if level[t.split(".")[0]] > level[m.split(".")[0]])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (break each: move the shared part down a module): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_no_import_from_a_lower_floor_to_a_higher_one():
    bad = floor_violations(import_graph())
    assert not bad, "imports that run back up (pipeline < data < stages): " + ", ".join(bad)


@pytest.mark.parametrize("files, expect_circle, expect_up", [
    ({"pipeline/a.py": "from pipeline import b\n", "pipeline/b.py": "def f():\n    from pipeline.a import x\n"},
     [["pipeline.a", "pipeline.b"]], []),
    ({"pipeline/a.py": "from .b import y\n", "pipeline/b.py": "import os\n", "stages/s.py": "import pipeline.a\n"},
     [], []),
    ({"pipeline/a.py": "def f():\n    from stages import s\n", "stages/s.py": "x = 1\n"}, [], ["pipeline.a -> stages.s"]),
    ({"data/d.py": "from stages.s import z\n", "stages/s.py": "from data import d\n"},
     [["data.d", "stages.s"]], ["data.d -> stages.s"]),
    ({"pipeline/sub/__init__.py": "", "pipeline/sub/a.py": "from stages.s import z\n", "stages/s.py": "x = 1\n"},
     [], ["pipeline.sub.a -> stages.s"]),  # a subpackage is walked too
])
def test_the_checks_find_what_they_look_for(tmp_path, files, expect_circle, expect_up):
    """The two checks on made-up trees: a lazy-import circle, relative imports, an upward import."""
    for pkg in FLOORS:
        (tmp_path / pkg).mkdir()
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert circles(graph) == expect_circle
    assert floor_violations(graph) == expect_up


def test_only_the_store_layer_imports_zarr():
    bad = sorted(zarr_importers() - STORE_LAYER)
    assert not bad, ("modules that import zarr outside the store layer (read and write the store through "
                     "pipeline/store.py's functions instead): " + ", ".join(bad))


def test_the_zarr_check_finds_every_form_of_import(tmp_path):
    """On a made-up tree: a top-level import, one inside a function, `from zarr.x import`, an import by name; the
    store module's own import, a module named like zarr (`zarrlike`) and a relative `from .zarr` are not hits."""
    files = {"pipeline/store.py": "import zarr\n", "pipeline/a.py": "def f():\n    import zarr\n",
             "pipeline/b.py": "import zarrlike\nfrom .zarr import x\n",
             "data/d.py": "from zarr.codecs import BloscCodec\n",
             "stages/s.py": "import importlib\nz = importlib.import_module('zarr')\n",
             "stages/t.py": "import os, zarr.storage as zs\n", "stages/u.py": "x = __import__('zarr')\n"}
    for pkg in FLOORS:
        (tmp_path / pkg).mkdir()
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert zarr_importers(tmp_path) - STORE_LAYER == {"pipeline.a", "data.d", "stages.s", "stages.t", "stages.u"}
