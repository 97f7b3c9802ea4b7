"""Issue 28.1: name the Inductor kernel that fails to compile in the 27B-shape step at long samples.

Runs bench/long_bench.py's points (one step each, fresh dynamo state) with a hook on Inductor's Triton
`get_block_shape`: when it raises, the hook records the kernel being generated (its class, range trees with
their tensor dims, persistent / no-x-dim flags, the index expression) and the FX nodes it was fused from (op
names and the user source line of each), then lets the error go on. Each point's outcome (ok, or the error and
what the hook saw) is one JSON line. `--layer-options` / `--loss-options` pass Inductor options to the compiled
layers / loss chunk only, to try a scoped fix. `--sources` dumps the torch functions the failure runs through.

    python bench/compile_diag.py --points 8192:512,16384:2048 --out $OUT/diag.jsonl --sources $OUT/src.txt
    python bench/compile_diag.py --points 8192:512 --layer-options '{"triton.mix_order_reduction": false}'
    python bench/compile_diag.py --points 8192:2048,16384:2048 --tables-before   # the block tables alone, pre-fix code
    python bench/compile_diag.py --tiny --device cpu --points 256:16 --steps 1            # CPU smoke test

--tables-before compiles only the BlockMask table builder (pipeline/masks.py `_all_tables`) at each point, with
`_ordered` as it was before issue 28's fix (two cumsums inside the compiled graph), and checks its tables against
the eager builder's: it shows at which lengths that code fails to compile on this torch.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from long_bench import run_point  # noqa: E402
from train_bench import TINY  # noqa: E402

SEEN: list = []


def _ordered_before_fix(tiles):
    """pipeline/masks.py `_ordered` as of 896817d: both cumsums inside the compiled graph."""
    t = tiles.to(torch.int32)
    count = t.sum(dim=-1, dtype=torch.int32)
    pos = torch.where(tiles, t.cumsum(-1) - 1, count[..., None] + (1 - t).cumsum(-1) - 1)
    cols = torch.arange(tiles.shape[-1], device=tiles.device, dtype=torch.int32).expand_as(t)
    return count, torch.empty_like(t).scatter_(-1, pos.long(), cols)


def tables_point(S: int, A: int, dev: torch.device, before: bool) -> dict:
    """Compile the table builder alone at S tokens, A anchors (block 16, window 2048 and full); -> ok and
    whether the compiled tables equal the eager ones exactly."""
    from pipeline import masks

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    lm = torch.ones(S, dtype=torch.bool)
    lm[:200] = False
    anchors = masks.sample_anchors(lm, A, g)[None].to(dev)
    lens = torch.tensor([S], device=dev)
    orig = masks._ordered
    if before:
        masks._ordered = _ordered_before_fix
    try:
        comp = torch.compile(masks._all_tables)
        same = True
        for window in (2048, None):
            got = comp(anchors, lens, 16, S, window)
            ref = masks._all_tables(anchors, lens, 16, S, window)
            same &= all(torch.equal(x, y) for x, y in zip(got, ref))
    finally:
        masks._ordered = orig
    return {"S": S, "anchors": A, "tables_only": True, "before_fix": before, "equal_eager": bool(same)}


def _describe_kernel(expr) -> dict:
    from torch._inductor.virtualized import V

    k = V.kernel
    d = {"kernel_class": type(k).__name__, "expr": str(expr)}
    for name in ("no_x_dim", "persistent_reduction", "inside_reduction", "cooperative_reduction",
                 "mix_order_reduction", "fixed_config"):
        if hasattr(k, name):
            d[name] = repr(getattr(k, name))[:200]
    d["numels"] = {str(p): str(n) for p, n in getattr(k, "numels", {}).items()}
    d["range_trees"] = [{"prefix": t.prefix, "numel": str(t.numel), "tensor_dim": getattr(t, "tensor_dim", "?"),
                         "is_loop": getattr(t, "is_loop", "?")} for t in getattr(k, "range_trees", [])]
    d["expr_vars"] = sorted(str(v) for v in getattr(expr, "free_symbols", ()))
    origins = []
    try:
        for node in getattr(k.features, "node_schedule", []) or []:
            inner = getattr(node, "node", None)
            for o in sorted(getattr(inner, "origins", ()) or (), key=lambda o: o.name):
                st = (o.meta.get("stack_trace") or "").strip().splitlines()
                origins.append(f"{o.name} {o.target} | {st[-2].strip() if len(st) > 1 else ''} "
                               f"{st[-1].strip() if st else ''}")
    except Exception as e:  # noqa: BLE001 - diagnostics only
        origins.append(f"origins unavailable: {e!r}")
    d["origins"] = origins[:60]
    try:
        d["graph"] = str(getattr(V.graph, "name", "?"))
    except Exception:  # noqa: BLE001
        pass
    return d


def install_hook() -> list[str]:
    """Wrap every `get_block_shape` classmethod of Inductor's Triton codegen; -> the classes wrapped."""
    import torch._inductor.codegen.triton as tri

    wrapped = []
    for name, cls in list(vars(tri).items()):
        if inspect.isclass(cls) and "get_block_shape" in cls.__dict__:
            orig = cls.__dict__["get_block_shape"].__func__

            def hooked(c, expr, _orig=orig):
                try:
                    return _orig(c, expr)
                except Exception as e:
                    SEEN.append({"error": repr(e), **_describe_kernel(expr)})
                    raise

            setattr(cls, "get_block_shape", classmethod(hooked))
            wrapped.append(name)
    return wrapped


def dump_sources(path: str) -> None:
    import torch._inductor.choices as ch
    import torch._inductor.codegen.simd as simd
    import torch._inductor.codegen.triton as tri
    import torch._inductor.scheduler as sch

    parts = [f"torch {torch.__version__}\n"]
    for obj, names in ((tri, ["get_block_shape", "want_no_x_dim", "construct_range_trees", "codegen_kernel"]),
                       (simd, ["construct_range_trees", "want_no_x_dim"]),
                       (ch, ["want_no_x_dim"]), (sch, ["can_fuse"])):
        src = inspect.getsource(obj)
        for n in names:
            i = 0
            while (i := src.find(f"def {n}(", i)) >= 0:
                parts.append(f"\n##### {obj.__name__}.{n} (line {src[:i].count(chr(10)) + 1})\n{src[i:i + 3500]}")
                i += 1
    with open(path, "w") as f:
        f.write("".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="8192:512,16384:2048")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--arch", default="dflash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layer-options", default=None, help="JSON Inductor options for the compiled layers only")
    ap.add_argument("--loss-options", default=None, help="JSON Inductor options for the compiled loss chunk only")
    ap.add_argument("--tables-before", action="store_true", help="the table builder alone, pre-fix `_ordered`")
    ap.add_argument("--sources", default=None, help="write the relevant torch sources here")
    ap.add_argument("--out", default=None, help="JSON lines, one per point")
    a = ap.parse_args()
    shape = {}
    if a.tiny:
        shape = {k: v for k, v in TINY.items() if k not in ("seq", "anchors", "vocab", "layers")}
        a.vocab, a.layers = TINY["vocab"], TINY["layers"]
    a.compile_options = json.loads(a.layer_options) if a.layer_options else None
    if a.loss_options:
        from pipeline import loss

        loss.CHUNK_COMPILE_OPTIONS.clear()
        loss.CHUNK_COMPILE_OPTIONS.update(json.loads(a.loss_options))
    if a.sources:
        dump_sources(a.sources)
    print("hooked:", install_hook() if a.device == "cuda" else "(cpu: no Triton)", flush=True)
    for p in a.points.split(","):
        S, A = (int(x) for x in p.split(":"))
        SEEN.clear()
        t0 = time.perf_counter()
        try:
            if a.tables_before:
                r = {"ok": True, **tables_point(S, A, torch.device(a.device), before=True)}
            else:
                r = {"ok": True, **run_point(S, A, a, shape)}
        except Exception as e:  # noqa: BLE001 - the point of this script is to record it
            tb = traceback.format_exc()
            r = {"S": S, "anchors": A, "ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}",
                 "user_frames": [ln for ln in tb.splitlines() if "/pipeline/" in ln or "/bench/" in ln][-12:],
                 "tail": tb.splitlines()[-6:]}
        r.update(layer_options=a.layer_options, loss_options=a.loss_options, wall_s=time.perf_counter() - t0,
                 failing_kernels=list(SEEN))
        line = json.dumps(r, default=str)
        print(line if not r["ok"] else json.dumps({k: r[k] for k in ("S", "anchors", "ok", "step_ms", "equal_eager",
                                                                   "wall_s")
                                                   if k in r}), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
