"""Issues 19.6 and 28.1: long samples. Step time, MFU and peak GPU memory of one `dflash train` step, 2K-16K tokens.

The 27B-class drafter of bench/train_bench.py (its `build_case` / `train_step`: 5 layers, hidden 5120, vocab
248,320, block 16, sliding window 2048, compiled flex attention as `dflash train` runs it, bf16 autocast,
chunked loss, AdamW), one sequence per step, at each point S:A (S tokens per sample, A anchors). Each point
gets a fresh drafter and optimizer and its own peak-memory window; the first step (compile) is reported apart.
MFU counts useful FLOPs only (train_bench.useful_flops: visible attention pairs, labelled rows) against
--peak-tflops. Prints one row per point and writes JSON with --out (after every point). A point that runs
out of memory is reported as OOM and the next one still runs; so does one that fails otherwise (its error and
the project frames it passed through are recorded).

    python bench/long_bench.py --out $OUT/long.json                      # 2048:512, 8192:512, 16384:512, 16384:2048
    python bench/long_bench.py --points 16384:512 --steps 3
    python bench/long_bench.py --tiny --device cpu --points 256:16,1024:16 --steps 1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import traceback

import torch
from timing import device_sync, timed
from train_bench import TINY, build_case, train_step, useful_flops

from pipeline.archs import ARCHS
from pipeline.compile_setup import inductor_workarounds
from pipeline.masks import dense_mask

POINTS = "2048:512,8192:512,16384:512,16384:2048"


def run_point(S: int, A: int, a: argparse.Namespace, shape: dict) -> dict:
    dev = torch.device(a.device)
    gc.collect()  # the previous point's drafter, optimizer and compiled layers must not count in this peak
    torch._dynamo.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    c = build_case(a.arch, a.layers, a.vocab, S, A, a.chunk, dev, shape)
    vis = {t: int(dense_mask(c.anchors, c.bs, S, window=(2048 if t == "sliding_attention" else None)).sum())
           for t in set(c.types)}  # visible (query, key) pairs per layer type, for the useful FLOPs
    flops = useful_flops(c.arch, S, c.Q, int((c.blocks.labels >= 0).sum()), a.vocab, vis)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the dense mask above is a FLOP count only, not part of a step
    mode = "flex" if dev.type == "cuda" else "sdpa"
    if mode == "flex":
        inductor_workarounds()  # as `dflash train` (pipeline/compile_setup.py)
        opts = getattr(a, "compile_options", None)  # bench/compile_diag.py: other Inductor options, to compare
        c.drafter.compile_layers(**({} if opts is None else {"options": opts}))  # what `dflash train` does
    losses = []

    def step():
        losses.append(train_step(c, mode))

    first = timed(step, device_sync(dev))
    dt = timed(step, device_sync(dev), n=a.steps) / a.steps
    loss = float(losses[-1])
    if loss != loss:  # NaN: a broken mask (a fully masked row) or overflow at this length
        raise RuntimeError(f"S={S}: the loss is NaN")
    return {"S": S, "anchors": int(c.anchors.shape[1]), "Q": c.Q, "step_ms": dt * 1e3, "first_step_s": first,
            "tokens_s": S / dt, "loss": loss,
            "useful_tflop": flops / 1e12, "mfu": flops / dt / (a.peak_tflops * 1e12),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
            "left_from_before_gib": base / 2**30}  # ~0: nothing of the previous point counts in the peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=POINTS, help="comma list of S:anchors (tokens per sample : anchors)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per point (after one compile step)")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=4096, help="train.loss_chunk_rows")
    ap.add_argument("--arch", choices=list(ARCHS), default="dflash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak of the GPU")
    ap.add_argument("--tiny", action="store_true", help=f"a tiny drafter instead of the 27B one: {TINY}")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = {}
    if a.tiny:
        shape = {k: v for k, v in TINY.items() if k not in ("seq", "anchors", "vocab", "layers")}
        a.vocab, a.layers = TINY["vocab"], TINY["layers"]
    points = [tuple(int(x) for x in p.split(":")) for p in a.points.split(",")]
    rows = []
    print(f"{a.arch}, {'tiny' if a.tiny else '27B-class'} drafter on {a.device}; one sample per step, block 16")
    print(f"{'S':>7}{'anchors':>9}{'step ms':>10}{'tokens/s':>10}{'MFU':>7}{'first step s':>14}{'peak GiB':>10}")
    for S, A in points:
        try:
            r = run_point(S, A, a, shape)
        except torch.OutOfMemoryError as e:
            r = {"S": S, "anchors": A, "oom": str(e).splitlines()[0]}
            print(f"{S:>7}{A:>9}  OOM: {r['oom']}", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. a compile failure at one length: recorded, the next point runs
            tb = traceback.format_exc().splitlines()
            r = {"S": S, "anchors": A, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}",
                 "where": [ln.strip() for ln in tb if "/pipeline/" in ln or "/bench/" in ln][-6:]}
            print(f"{S:>7}{A:>9}  failed: {r['error']}", flush=True)
        else:
            peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
            print(f"{S:>7}{r['anchors']:>9}{r['step_ms']:>10.1f}{r['tokens_s']:>10.0f}{100 * r['mfu']:>6.1f}%"
                  f"{r['first_step_s']:>14.1f}{peak:>10}", flush=True)
        rows.append(r)
        if a.out:  # after every point: a later point that kills the process leaves the earlier ones
            with open(a.out, "w") as f:
                json.dump({"arch": a.arch, "tiny": a.tiny, "device": a.device, "points": rows}, f, indent=1)


if __name__ == "__main__":
    main()
