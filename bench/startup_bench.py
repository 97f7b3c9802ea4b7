"""Where `dflash train`'s start-up goes before the first batch (issue 22 item 1), without a GPU step.

Each measurement runs in a fresh interpreter:
1. `imports`: the launch path's imports (stages.cli, stages.train, then train's Lightning phase: torch, Lightning
   with torchmetrics reduced (stages/lightning_import.py), torch._dynamo, ...), wall seconds, with and without
   cProfile, and without the reduction (`full torchmetrics`, as before issue 46). Inside both, the seconds spent in
   torch's custom-op registration source lookup (`torch._library.utils.get_source`: `inspect.getframeinfo`
   for every custom op registered at import, which reads and scans source files) and how many calls: cProfile
   charges its per-call overhead to each of the many small Python calls under it, so the same imports look
   several times slower there. The no-profiler figure is the real cost.
2. `importtime`: the same imports under `python -X importtime`: seconds of self time by top-level package (torch,
   lightning, torchmetrics, transformers, triton, ...) and the slowest modules by cumulative time, so a start-up
   goal that is missed comes with the profile that says which imports stand in its way.
3. `sha256`: hashlib's MB/s on this host (the frozen head's check: 5 GB at the 27B shape, once per rank; it
   runs in a background thread beside the set-up since issue 22).

    python bench/startup_bench.py --out /tmp/startup.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import sys, time, json
import torch._library.utils as u
orig, tot = u.get_source, [0.0, 0]
def timed(stacklevel):
    t = time.perf_counter(); r = orig(stacklevel + 1); tot[0] += time.perf_counter() - t; tot[1] += 1; return r
u.get_source = timed
t0 = time.perf_counter()
import stages.cli, stages.train, stages.train_phases  # the launch path's imports, then its Lightning phase
stages.train_phases.import_lightning()  # Lightning (torchmetrics reduced, unless DFLASH_FULL_TORCHMETRICS=1) + modules
print(json.dumps({"imports_s": time.perf_counter() - t0, "transformers": "transformers" in sys.modules, "get_source_s": tot[0], "get_source_calls": tot[1],
                  "modules": len(sys.modules)}))
"""


def probe(profiled: bool, full: bool = False) -> dict:
    """The launch path's imports in a fresh interpreter (after `import torch`, whose own time is not in it); `full`:
    torchmetrics imported in full (DFLASH_FULL_TORCHMETRICS=1, as before issue 46)."""
    code = ("import cProfile; cProfile.run(compile(%r, 'probe', 'exec'), '/dev/null')" % PROBE) if profiled else PROBE
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                              "DFLASH_FULL_TORCHMETRICS": "1" if full else "0"})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["process_s"] = time.perf_counter() - t0
    return r


def importtime(top: int = 15) -> dict:
    """`-X importtime` of the launch path (after `import torch`, timed apart): self seconds by top-level package,
    the `top` slowest modules by cumulative seconds."""
    code = ("import torch, time; t0 = time.perf_counter(); import stages.cli, stages.train, stages.train_phases; "
            "stages.train_phases.import_lightning()")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    rows = []  # (self us, cumulative us, module, depth)
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = line.split(":", 1)[1].split("|")
        rows.append((int(self_us), int(cum_us), name.strip(), (len(name) - len(name.lstrip())) // 2))
    by_pkg: dict = {}
    for self_us, _, name, _ in rows:
        by_pkg[name.split(".")[0]] = by_pkg.get(name.split(".")[0], 0) + self_us / 1e6
    pkgs = dict(sorted(by_pkg.items(), key=lambda kv: -kv[1])[:top])
    slow = [{"module": n, "cumulative_s": c / 1e6, "self_s": s_ / 1e6, "depth": d}
            for s_, c, n, d in sorted(rows, key=lambda r: -r[1])[:top]]
    return {"modules": len(rows), "self_s_by_package": pkgs, "slowest_cumulative": slow}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sha-mb", type=int, default=1024, help="MB hashed for the sha256 rate")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {"plain": probe(False), "full torchmetrics": probe(False, full=True), "cprofile": probe(True),
           "importtime": importtime()}
    buf = os.urandom(1 << 20) * a.sha_mb
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    res["sha256_MB_s"] = a.sha_mb * 1.048576 / (time.perf_counter() - t0)
    for k in ("plain", "full torchmetrics", "cprofile"):
        r = res[k]
        print(f"{k:<17} launch-path imports {r['imports_s']:5.2f} s (process {r['process_s']:5.2f} s, {r['modules']} "
              f"modules, transformers {'imported' if r['transformers'] else 'not imported'}); custom-op source "
              f"lookups {r['get_source_calls']} calls, {r['get_source_s']:.2f} s")
    it = res["importtime"]
    print(f"importtime ({it['modules']} modules after torch), self seconds by package: "
          + ", ".join(f"{k} {v:.2f}" for k, v in it["self_s_by_package"].items()))
    for r in it["slowest_cumulative"]:
        print(f"  {r['cumulative_s']:6.2f} s cumulative  {'  ' * r['depth']}{r['module']}")
    print(f"sha256 {res['sha256_MB_s']:.0f} MB/s: a 5 GB frozen head takes {5000 / res['sha256_MB_s']:.1f} s per rank "
          "(from the page cache), now overlapped with the set-up")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
