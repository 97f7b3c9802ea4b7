"""The import graph of the three top-level packages: no import circle, and no import from a lower floor to a higher
one (`pipeline` < `data` < `stages`: the library, the data layer, the commands).

Every import counts, a lazy one inside a function too: a lazy import only hides a circle from the interpreter, not
from the reader. Read with `ast` from the source files, so the test needs no import of the modules themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("pipeline", "data", "stages")  # lowest first


def _module_name(path: Path) -> str:
    pkg = path.parent.name
    return pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from pkg import mod` counts as importing `pkg.mod`)."""
    files = {_module_name(f): f for pkg in FLOORS for f in sorted((root / pkg).glob("*.py"))}
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
])
def test_the_checks_find_what_they_look_for(tmp_path, files, expect_circle, expect_up):
    """The two checks on made-up trees: a lazy-import circle, relative imports, an upward import."""
    for pkg in FLOORS:
        (tmp_path / pkg).mkdir()
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert circles(graph) == expect_circle
    assert floor_violations(graph) == expect_up
