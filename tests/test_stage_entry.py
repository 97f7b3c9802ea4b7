"""Every stage entry point the CLI calls (`run_*`, handed to `stages.cli._run`) takes its first argument by
position and everything else by keyword (`def run_train(cfg, *, store=None, ...)`): a new parameter can never
silently shift a caller's arguments (stages/demo.py once called run_train positionally)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _entry_points() -> dict[str, str]:
    """name -> module of every `run_*` function stages/cli.py hands to `_run`, read from its imports."""
    tree = ast.parse((ROOT / "stages" / "cli.py").read_text())
    imported = {a.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for a in node.names}
    called = {node.args[0].id for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "id", None) == "_run" and node.args and isinstance(node.args[0], ast.Name)}
    return {name: imported[name] for name in sorted(called) if name.startswith("run_")}


def test_stage_entry_points_are_keyword_only_after_their_first_argument():
    entries = _entry_points()
    assert {"run_extract", "run_regenerate", "run_train", "run_node", "run_eval", "run_demo", "run_export",
            "run_recode", "run_plan"} <= set(entries), entries
    for name, module in entries.items():
        params = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters.values())
        late = [p.name for p in params[1:] if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
        assert not late, f"{module}.{name}: {late} can be passed by position; put a `*` after the first parameter"
