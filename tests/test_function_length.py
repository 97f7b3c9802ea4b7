"""No function in stages/ is longer than 80 lines (issue 44 item 2: a conductor is phases of at most 80 lines each,
each a function with named parameters), except the ones in `LONG`, an allow-list that only shrinks: a function
split below the limit must leave it (the test says so), and a new long function fails. Read with `ast` from the
source files (no imports); a function's length is from its `def` line to its last line, its docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 80
# module -> the functions still longer than LIMIT lines (split them, then remove them here)
LONG: dict[str, set[str]] = {}  # empty since issue 44's last conductors were split (2026-12-03)


def long_functions(root: Path = ROOT, limit: int = LIMIT) -> dict[str, dict[str, int]]:
    """module path -> {function name: its lines} of every function (methods and nested ones too) over `limit`."""
    found: dict[str, dict[str, int]] = {}
    for f in sorted((root / "stages").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.setdefault(f.relative_to(root).as_posix(), {})[node.name] = n
    return found


def test_no_function_in_stages_is_longer_than_80_lines_but_the_listed_ones():
    found = long_functions()
    new = {f"{m}:{name} ({n} lines)" for m, fns in found.items() for name, n in fns.items()
           if name not in LONG.get(m, set())}
    assert not new, (f"longer than {LIMIT} lines: {sorted(new)}; split it into phases of at most {LIMIT} lines "
                     "(each a function with named parameters), as stages/train.py's _train is")
    gone = {f"{m}:{name}" for m, names in LONG.items() for name in names if name not in found.get(m, {})}
    assert not gone, f"no longer over {LIMIT} lines (or gone): {sorted(gone)}; remove them from LONG"


def test_the_guard_sees_a_long_function(tmp_path):
    (tmp_path / "stages").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "stages" / "m.py").write_text(f"class C:\n    def short(self):\n        pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == {"stages/m.py": {"long": LIMIT + 1}}
