"""The README and the guides hold to what they promise a newcomer (issue 43 item 1): the README within 250 lines
and free of dated figures, CI's own test command, every relative link resolving, every `dflash COMMAND` a command
of the CLI, and docs/benchmarks.md's figures each with a command, a machine and a date."""

from __future__ import annotations

import re
from pathlib import Path

from stages.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
PENDING: set[str] = set()  # commands the docs may name before they land (none now)


def test_readme_is_short_and_has_no_dated_figures():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated figures belong in docs/benchmarks.md"
    assert "τ** (tau, the acceptance length)" in text  # defined before its first use in a section


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/setup.sh" in ci and "python -m pytest -q -n 3\n" in ci and "bash scripts/compat.sh" in ci
    readme = (ROOT / "README.md").read_text()
    assert "./scripts/setup.sh && .venv/bin/python -m pytest -q -n 3 && bash scripts/compat.sh" in readme


def test_every_relative_link_resolves():
    missing = []
    for doc in DOCS + [ROOT / "docs" / "benchmarks.md"]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_every_dflash_command_in_the_docs_exists():
    known = set(main.commands)
    used = set()
    for doc in DOCS:
        text = doc.read_text()
        code = re.findall(r"```.*?```", text, re.S) + re.findall(r"`[^`\n]+`", re.sub(r"```.*?```", "", text, flags=re.S))
        code = [re.sub(r"(^|\s)#.*$", "", span, flags=re.M) for span in code]  # shell comments are prose
        used |= {m for span in code for m in re.findall(r"(?:^|[\s/])dflash ([a-z][a-z-]+)", span, re.M)}
    assert "prepare-data" in used and "run" in used
    assert used - known - PENDING == set(), sorted(used - known - PENDING)


def test_current_figures_each_name_command_machine_and_date():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| what") and "---" not in r]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        what, figure, command, machine, date, section = cells
        assert "`" in command or "arithmetic" in command, row
        assert machine and re.search(r"20\d\d-\d\d-\d\d", date), row
        assert section.startswith('"'), row
        if "projection" in what:
            assert what.startswith("**projection**"), row
    headings = [h.lstrip("#").strip() for h in (ROOT / "docs" / "benchmarks-log.md").read_text().splitlines()
                if h.startswith("## ") or h.startswith("### ")]
    for row in rows:
        for name in [c.strip() for c in row.strip("|").split("|")][5].split("; "):
            name = name.strip().removeprefix('"').removesuffix('"')
            assert any(h.startswith(name) for h in headings), f"no section of docs/benchmarks-log.md starts {name!r}"


def test_architecture_guide_names_every_module():
    """docs/architecture.md keeps to 'how the parts fit': every module of pipeline/, stages/ and data/ has its
    row (or mention), so a new module cannot land unexplained."""
    guide = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for d in ("pipeline", "stages", "data") for p in sorted((ROOT / d).rglob("*.py"))
               if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in guide]
    assert missing == [], f"add these modules to docs/architecture.md's module table: {missing}"
