"""Lightning's import without torchmetrics' optional backends (issue 46 item 1): `dflash train`'s start-up.

Why: Lightning imports torchmetrics (its version check in `lightning.fabric.utilities.imports`, and
`LightningModule` needs `torchmetrics.Metric`), and torchmetrics' package `__init__` imports every metric family,
each of which imports the optional library it finds installed: transformers through `functional.text.bert`,
scipy, torchvision, pandas. On the H200 host that was 6.8 s of the launch path's 9.9 s of imports
(docs/benchmarks-log.md, issue 31); dflash's training uses none of them.

What it does: before the first Lightning import, the `torchmetrics` package is registered without running its
`__init__` (the module object from its own import spec, carrying what `__init__` would define first: the
version, `_logger`, `_PACKAGE_ROOT`, `_PROJECT_ROOT`), and only the two classes Lightning imports by name are
loaded into it (`Metric`, `MetricCollection`, the real classes from torchmetrics' own modules), with matplotlib
marked absent in torchmetrics' table of optional libraries (`Metric.plot` is unused here). Any other
torchmetrics submodule still imports on demand (`import torchmetrics.aggregation` works), so nothing Lightning
does lazily breaks; only `from torchmetrics import Accuracy`-style names of the top package are absent.

Contract:
- `import_lightning()` imports `lightning` (and `lightning.pytorch`) and returns "light" when torchmetrics was
  registered this way, "full" when it imported normally: Lightning or torchmetrics already imported, the
  package missing, `DFLASH_FULL_TORCHMETRICS=1`, or any error on the light path (its partial modules are then
  removed from `sys.modules` first, so the normal import starts clean). Never raises for the light path's sake.
- Tested (tests/test_lightning_import.py) against the installed Lightning and torchmetrics, in a fresh
  interpreter: the light path is taken, transformers, matplotlib and torchmetrics' metric families are not
  imported, and a Lightning fit with a `LightningModule` runs. pyproject.toml's ranges bound the versions it meets.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys


def _register_bare_torchmetrics() -> None:
    """torchmetrics as a package whose `__init__` did not run, holding Metric and MetricCollection."""
    spec = importlib.util.find_spec("torchmetrics")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        raise ImportError("torchmetrics is not installed as a package")
    mod = importlib.util.module_from_spec(spec)
    mod.__version__ = importlib.metadata.version("torchmetrics")
    log = logging.getLogger("torchmetrics")  # what torchmetrics/__init__.py sets up before its imports
    if not log.handlers:
        log.addHandler(logging.StreamHandler())
    log.setLevel(logging.INFO)
    mod._logger = log
    mod._PACKAGE_ROOT = os.path.dirname(spec.origin)
    mod._PROJECT_ROOT = os.path.dirname(mod._PACKAGE_ROOT)
    sys.modules["torchmetrics"] = mod
    flags = _imports_without_plots(mod._PACKAGE_ROOT)
    utilities = importlib.import_module("torchmetrics.utilities")  # first: its __init__ imports metric.py (their circle)
    utilities.imports = flags
    mod.Metric = importlib.import_module("torchmetrics.metric").Metric
    mod.MetricCollection = importlib.import_module("torchmetrics.collections").MetricCollection


def _imports_without_plots(package_root: str):
    """torchmetrics' table of installed optional libraries (`torchmetrics.utilities.imports`), loaded ahead and
    registered with matplotlib (and its style and LaTeX add-ons) marked absent: `utilities/plot.py`, which
    `metric.py` imports, otherwise imports matplotlib.pyplot whenever it is installed (0.5 s of a tiny training's
    3.8 s start-up, with the `plots` extra). `Metric.plot` is the one thing that needs it; dflash never calls it."""
    name = "torchmetrics.utilities.imports"
    spec = importlib.util.spec_from_file_location(name, os.path.join(package_root, "utilities", "imports.py"))
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    flags._MATPLOTLIB_AVAILABLE = flags._SCIENCEPLOT_AVAILABLE = flags._LATEX_AVAILABLE = False
    sys.modules[name] = flags
    return flags


def _forget(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def import_lightning() -> str:
    """Import Lightning, with torchmetrics reduced to what Lightning needs where possible -> "light" or "full"."""
    untouched = "lightning" in sys.modules or "torchmetrics" in sys.modules
    if untouched or os.environ.get("DFLASH_FULL_TORCHMETRICS") == "1":
        import lightning.pytorch  # noqa: F401

        return "full"
    try:
        _register_bare_torchmetrics()
        import lightning.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any surprise from another version: the normal import, from a clean slate
        _forget("lightning")
        _forget("torchmetrics")
        import lightning.pytorch  # noqa: F401

        return "full"
    return "light"
