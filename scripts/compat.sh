#!/usr/bin/env bash
# The fast test subset again, against the transformers the GPU machine runs (5.17; CI and a fresh setup.sh get
# the newest 5.x). The two differ in how a hybrid model's modules take the cache (5.17: past_key_values and
# cache_params; 5.2x: cache) and in the cache's getters, and a test that passes on one only hid a bug on the
# other (issue 30's cached fast forward). Run after scripts/setup.sh; CI runs it after the whole suite.
# The older transformers goes into .compat/ and is put first on PYTHONPATH; everything else is .venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${DFLASH_COMPAT_TRANSFORMERS:-5.17.0}
DIR=.compat/transformers-$V
if [ ! -f "$DIR/.complete" ]; then
  rm -rf "$DIR"
  .venv/bin/python -m pip install -q --target "$DIR" "transformers==$V" "huggingface-hub>=1.5,<2"
  # keep only what .venv lacks (transformers, its hub and their new dependencies): a second numpy or tokenizers
  # first on the path would shadow the ones torch and the project were installed with
  .venv/bin/python - "$DIR" <<'PY'
import importlib.util, shutil, sys
from pathlib import Path
d = Path(sys.argv[1])
keep = {"transformers", "huggingface_hub"}
for p in d.iterdir():
    if p.name in ("bin", "__pycache__") or p.name.endswith(".dist-info"):
        continue
    name = p.name.removesuffix(".py").removesuffix(".libs")  # numpy.libs: numpy's bundled libraries
    if name not in keep and importlib.util.find_spec(name) is not None:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
for info in d.glob("*.dist-info"):  # and the metadata of what went, so version checks read .venv's
    tops = {line.split("/")[0].split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line}
    if not any((d / t).exists() for t in tops - {info.name, "bin", "__pycache__", "..", ""}):
        shutil.rmtree(info)
PY
  touch "$DIR/.complete"
fi
PYTHONPATH="$PWD/$DIR" .venv/bin/python -c "import transformers as t; assert t.__version__ == '$V', t.__version__; print('compat: transformers', t.__version__, 'from', t.__file__)"
PYTHONPATH="$PWD/$DIR" .venv/bin/python -m pytest -q -m "not slow" -p no:cacheprovider -n 2 "$@"
