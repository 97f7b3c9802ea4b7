"""Issue 30's benchmark: the hybrid target's bare forward with transformers' reference and dflash's fast forward
(pipeline/fast_forward.py), where the GPU time goes by kernel family before and after, and extraction through
dflash's pipeline against the fast bare forward.

The random-initialised Qwen3.5/3.6-27B layout of bench/extract_bench.py (`build_model`), layers 0..61, bf16, one
GPU; fixed batches of 8 x 2048 tokens (no padding). Steps, all in one process:
1. reference forward: one untimed pass (Triton autotuning on a cold kernel cache), --reps timed passes, one
   profiled pass (torch.profiler, device time by kernel family, top kernels);
2. the same with the fast forward installed;
3. `pipelined_extract` (capture, GPU encode, pinned side-stream copy, writer thread, Zarr store) over --batches
   batches per encoding (after a warm-up run over --warmup-batches: the pinned host buffers a shard allocates in its
   first batches), with the fast forward, against the fast bare forward over the same batches; then, over
   --profile-batches batches, the bare forward and each encoding's extraction under torch.profiler: per batch, the
   GPU's kernel time by family, its idle time between the first and the last kernel, the device-to-host copies,
   the kernels extraction adds, and the host's named ranges (`extract.*`: waiting for the writer, writing);
4. (issues 30 item 4 and 45; --no-fp8-gemm skips it) the fast forward with the decoder layers' linears as FP8
   GEMMs: `--fp8-scaling block` (the default) as extract.target_precision fp8-block-from-bf16 makes them
   (pipeline/fp8_block.py: 1 x 128 activation and 128 x 128 weight scales, the engines' numerics), `row` the
   row-scaled probe of issue 30 (bench/fp8_gemm.py): tokens/s, kernel families, and each tap layer's output
   against the bf16 fast forward's on 2 x --seq tokens (cosine, relative error); then extraction with the FP8
   GEMMs (--fp8-extract encodings) against the FP8 bare forward over the same batches.

    python bench/fastfwd_bench.py --out $OUT/fastfwd.json                       # the GPU part (device_run.sh fastfwd)
    python bench/fastfwd_bench.py --tiny --device cpu --ops torch --out x.json  # CPU smoke run (torch stand-ins)
Goals (one H200): bare forward >= 12,000 tokens/s; extraction >= 0.95 of it in int5, fp8 and bf16; with block-FP8
GEMMs (issue 45) the bare forward >= 16,000 tokens/s and extraction >= 0.95 of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.timing import device_sync, timed  # noqa: E402

# kernel name fragments -> family, first match wins (lower-case)
FAMILIES = (
    ("fla GDN", ("chunk_gated_delta", "chunk_fwd", "chunk_gated", "recompute_w_u", "solve_tril", "merge_16x16",
                 "chunk_scaled_dot", "chunk_local_cumsum", "gdn_gate", "l2norm", "chunk_dplr", "prepare_wy",
                 "kkt", "delta_h", "fwd_o")),
    ("SDPA", ("flash", "fmha", "attention", "sdpa")),  # before conv: cuDNN's SDPA kernels are "cudnn_generated_*"
    ("conv", ("causal_conv1d", "conv_depthwise", "conv1d", "depthwise", "convolution")),
    ("fla norm", ("layer_norm", "rms_norm")),
    ("fla swiglu", ("swiglu",)),
    ("fp8 quant", ("_quantize_kernel",)),  # the activation quantization (pipeline/fp8_act_kernel.py)
    ("GEMM", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
    ("reductions", ("reduce",)),
    ("copies", ("copy", "memcpy", "memset", "cat", "aten::to", "clone", "contiguous")),
    ("elementwise", ("elementwise", "vectorized", "aten::")),
)


def family(name: str) -> str:
    n = name.lower()
    return next((f for f, keys in FAMILIES if any(k in n for k in keys)), "other")


def profile_families(run, cuda: bool) -> dict:
    """One profiled call of run(): {"families": {family: share}, "top": [[name, share, family]], "total_ms"}."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if t and (cuda or e.key.startswith("aten::")):
            rows.append((e.key, float(t)))
    total = sum(t for _, t in rows) or 1.0
    fams: dict = {}
    for k, t in rows:
        fams[family(k)] = fams.get(family(k), 0.0) + t / total
    top = sorted(rows, key=lambda r: -r[1])[:15]
    return {"families": dict(sorted(fams.items(), key=lambda kv: -kv[1])), "total_ms": total / 1e3,
            "top": [[k[:90], t / total, family(k)] for k, t in top]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ops", default="fla", choices=["fla", "torch"], help="torch: the stand-ins (CPU smoke run)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, default=8, help="batches per extraction run")
    ap.add_argument("--encodings", default="int5,fp8,bf16", help="step 3's encodings (empty: no step 3)")
    ap.add_argument("--warmup-batches", type=int, default=4,
                    help="an untimed extraction over this many batches first, per encoding (queue depth + 1: the "
                         "pinned host buffers a shard makes once, ~1 GB each in bf16, are then in the allocator's cache)")
    ap.add_argument("--writers", default="thread",
                    help="comma list of store writers per encoding: thread (as shipped), null (no store write: the "
                         "ceiling of any writer change; the measured and not adopted variants are in "
                         "docs/benchmarks-log.md, 'Experiments that left bench/')")
    ap.add_argument("--no-reference", action="store_true", help="skip step 1 (transformers' forward; measured before)")
    ap.add_argument("--profile-batches", type=int, default=3, help="batches per profiled window (0: no profile)")
    ap.add_argument("--kernel-cache", default=None)
    ap.add_argument("--store-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-fp8-gemm", action="store_true", help="skip step 4 (FP8 GEMMs)")
    ap.add_argument("--fp8-extract", default="int5",
                    help="step 4: comma list of encodings to extract with the FP8 GEMMs, against the FP8 bare "
                         "forward (issue 45 item 3: >= 0.95 of it); empty: none")
    ap.add_argument("--fp8-scaling", default="block", choices=["block", "row"],
                    help="step 4: block = extract.target_precision fp8-block's linears (pipeline/fp8_block.py: "
                         "1 x 128 activation, 128 x 128 weight scales); row = the row-scaled probe (bench/fp8_gemm.py)")
    a = ap.parse_args(argv)

    import pipeline.fast_forward as ff
    from pipeline.config import build_target_layer_ids
    from bench.extract_bench import SHAPES, build_model, kernel_cache

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    kernel_cache(dev, a.kernel_cache)

    size = "tiny" if a.tiny else "real"
    n_layers = SHAPES[("qwen3_5", size)]["num_hidden_layers"]
    layer_ids = build_target_layer_ids(n_layers, 5)
    t0 = time.perf_counter()
    model, cfg = build_model("qwen3_5", size, keep_layers=max(layer_ids) + 1, device=a.device,
                             dtype=torch.bfloat16 if cuda else torch.float32)
    build_s = time.perf_counter() - t0
    base = model.get_decoder()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen) for _ in range(max(1, a.batches))]
    n_tok = a.batch * a.seq

    sync = device_sync(dev)

    def one(ids):  # unpadded batches: no mask (transformers drops an all-ones one after a sync); pinned upload
        base(input_ids=ids.pin_memory().to(dev, non_blocking=True) if cuda else ids.to(dev), use_cache=False)

    def measure(label: str) -> dict:
        with torch.inference_mode():
            first = timed(lambda: one(batches[0]), sync)  # cold kernel cache: autotuning and compiles
            times = [timed(lambda: one(batches[0]), sync) for _ in range(a.reps)]
            prof = profile_families(lambda: one(batches[0]), cuda)
        best = min(times)
        r = {"first_pass_s": first, "times_s": times, "tok_s": n_tok / best, "tok_s_median": n_tok / sorted(times)[len(times) // 2],
             "profile": prof}
        print(f"{label}: {n_tok / best:.0f} tokens/s (best of {a.reps}; first pass {first:.1f}s)", flush=True)
        return r

    results = {"shape": f"qwen3_5 {size}, layers 0..{max(layer_ids)}, {a.batch} x {a.seq}", "device": str(dev),
               "ops": a.ops, "build_s": build_s, "tokens_per_batch": n_tok}
    if cuda:
        results["gpu"] = torch.cuda.get_device_name()
    if not a.no_reference:
        results["reference"] = measure("reference forward")
    ops = ff.fla_ops() if a.ops == "fla" else ff.torch_ops()
    results["modules_rebound"] = ff.install(model, ops)
    try:
        results["fast"] = measure("fast forward")
    except Exception as e:  # noqa: BLE001 - the reference figures are still reported
        results["fast_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"fast forward FAILED: {results['fast_error']}", flush=True)
    if "fast" in results and "reference" in results:
        results["speedup"] = results["fast"]["tok_s"] / results["reference"]["tok_s"]
    if "fast" in results:
        if a.encodings:  # empty: no bf16 extraction (the FP8 one below still runs)
            results["extraction"] = extraction(a, model, layer_ids, cfg, batches, dev, sync, one)
        if not a.no_fp8_gemm:
            try:
                results["fp8_gemm"] = fp8_gemms(base, layer_ids, batches[0][:2], one, measure, a.fp8_scaling)
                results["fp8_gemm"]["speedup_vs_fast"] = results["fp8_gemm"]["tok_s"] / results["fast"]["tok_s"]
                if a.fp8_extract:  # extraction with the FP8 GEMMs against the FP8 bare forward
                    fa = argparse.Namespace(**{**vars(a), "encodings": a.fp8_extract})
                    results["fp8_gemm"]["extraction"] = extraction(fa, model, layer_ids, cfg, batches, dev, sync, one)
            except Exception as e:  # noqa: BLE001 - the figures before it are still reported
                results["fp8_gemm_error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"FP8 GEMMs FAILED: {results['fp8_gemm_error']}", flush=True)
    _print(results)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


def extraction(a, model, layer_ids, cfg, batches, dev, sync, one) -> dict:
    """Extraction tokens/s per encoding with the installed forward, against its bare forward on the same batches."""
    from bench.extract_bench import bench_store, timed_extract

    n_tok = sum(b.numel() for b in batches)
    with torch.inference_mode():
        def bare():
            for ids in batches:
                one(ids)

        bare_s = timed(bare, sync)
    out = {"tokens": n_tok, "bare_tok_s": n_tok / bare_s, "encodings": {}}
    root = a.store_dir or tempfile.mkdtemp(prefix="dflash-ffbench-")

    def run(enc, which, variant="thread"):  # one pipelined_extract run into a fresh store
        path, prov = bench_store(root, enc, cfg, layer_ids, 1, a.seq, writer=False)
        from pipeline.store_writer import ShardWriter

        writer = ShardWriter(path, 0, prov)

        def write(n, parts):
            T = parts["features"].shape[0]
            writer.write_batch(np.arange(n, dtype=np.uint64), np.zeros(n, np.uint8), np.array([a.seq] * n, np.int32),
                               np.zeros(T, np.int32), np.ones(T, np.uint8), parts)

        def on_batch(members, parts, bad):
            if variant != "null":
                write(len(members), parts)

        feed = [(list(range(b.shape[0])), b, [b.shape[1]] * b.shape[0]) for b in which]
        try:  # before: the last forward and encode ended; the copy and write of the last batch (once a shard) follow
            wall, before, stats = timed_extract(model, layer_ids, enc, dev, feed, on_batch, sync)
        finally:
            writer.close()
            shutil.rmtree(path, ignore_errors=True)
        return wall, before, stats

    for enc in a.encodings.split(","):
        warm = batches[:a.warmup_batches]  # the first batches of a shard pin host buffers (below)
        cold_s = run(enc, warm)[0] if warm else None
        for variant in a.writers.split(","):
            key = enc if variant == "thread" else f"{enc}/{variant}"
            wall, before, stats = run(enc, batches, variant)
            out["encodings"][key] = {"tok_s": n_tok / wall, "ratio_vs_bare": bare_s / wall, "wall_s": wall,
                                     "ratio_before_drain": bare_s / before, "loop": stats, "writer": variant,
                                     "warmup": {"batches": len(warm), "tok_s": sum(b.numel() for b in warm) / cold_s}
                                     if warm else None}
            print(f"extract {key}: {n_tok / wall:.0f} tokens/s, {bare_s / wall:.3f} of the bare forward "
                  f"({bare_s / before:.3f} before the final drain); the writer busy {stats['writer_busy_s']:.2f} s "
                  f"(+ {stats['copy_wait_s']:.2f} s waiting for copies), the forward waited "
                  f"{stats['queue_wait_s']:.2f} s for it", flush=True)
    n = min(a.profile_batches, len(batches))
    if n:
        window = batches[-n:]

        def bare_window():
            with torch.inference_mode():
                for ids in window:
                    one(ids)

        out["profile"] = {"batches": n, "bare": profile_window(bare_window, sync, n, cuda=dev.type == "cuda")}
        for enc in a.encodings.split(","):
            out["profile"][enc] = profile_window(lambda: run(enc, window), sync, n, cuda=dev.type == "cuda")
        out["profile"]["added"] = added_kernels(out["profile"], a.encodings.split(","))
    return out


def profile_window(run, sync, n: int, cuda: bool, top: int = 40) -> dict:
    """run() under torch.profiler; per batch: the span from the GPU's first kernel to its last, the kernels' busy
    time (their union) and the idle rest, kernel time by family and by kernel, the copy engines' time, and the
    host's `extract.*` ranges (stages/extract_loop.py) with the ops of most self time."""
    from torch.profiler import ProfilerActivity, profile

    from pipeline.gpu_trace import device_work, is_copy, union_us

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # the writer thread's ranges too, and the host's waits on the GPU as events (torch >= 2.7)
        from torch._C._profiler import _ExperimentalConfig

        extra = {"experimental_config": _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)}
    except (ImportError, TypeError):
        extra = {}
    t0 = time.perf_counter()
    with profile(activities=acts, **extra) as prof:
        run()
        sync()
    out: dict = {"wall_ms": 1e3 * (time.perf_counter() - t0) / n}
    work = device_work(prof.events()) if cuda else []
    kernels = [e for e in work if not is_copy(e.name)]
    if kernels:
        span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
        busy = union_us([(e.time_range.start, e.time_range.end) for e in kernels])
        fams: dict = {}
        names: dict = {}
        for e in kernels:
            us = e.time_range.end - e.time_range.start
            fams[family(e.name)] = fams.get(family(e.name), 0.0) + us / 1e3 / n
            names[e.name] = names.get(e.name, 0.0) + us / 1e3 / n
        copies: dict = {}
        for e in work:
            if is_copy(e.name):
                kind = e.name.split("(")[0].strip()  # "Memcpy DtoH", "Memcpy HtoD", "Memset"
                copies[kind] = copies.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / 1e3 / n
        out.update(span_ms=span / 1e3 / n, busy_ms=busy / 1e3 / n, idle_ms=(span - busy) / 1e3 / n,
                   families=dict(sorted(fams.items(), key=lambda kv: -kv[1])), copies_ms=copies,
                   kernels=dict(sorted(names.items(), key=lambda kv: -kv[1])[:top]), kernels_all=names)
    avgs = prof.key_averages()
    out["host_ranges_ms"] = {x.key: x.cpu_time_total / 1e3 / n for x in avgs if x.key.startswith("extract.")}
    syncs = [x for x in avgs if "Synchronize" in x.key]  # cudaStreamSynchronize, cudaEventSynchronize, ...
    out["host_syncs"] = {x.key: [x.count / n, x.cpu_time_total / 1e3 / n] for x in syncs}  # per batch: calls, ms
    out["host_ops"] = [[x.key[:80], x.self_cpu_time_total / 1e3 / n, x.count]
                       for x in sorted(avgs, key=lambda x: -x.self_cpu_time_total)[:12]]
    return out


def added_kernels(p: dict, encodings: list, top: int = 12) -> dict:
    """Per encoding: the kernels whose time per batch grew most over the bare window's (extraction's own work:
    the gather of the real tokens, isfinite, the encoder), in ms per batch."""
    base = p["bare"].get("kernels_all", {})
    out = {}
    for enc in encodings:
        grown = {k: v - base.get(k, 0.0) for k, v in p[enc].get("kernels_all", {}).items()}
        out[enc] = [[k[:90], d] for k, d in sorted(grown.items(), key=lambda kv: -kv[1])[:top] if d > 0.01]
    for x in p.values():
        if isinstance(x, dict):
            x.pop("kernels_all", None)  # the top ones stay in "kernels"
    return out


def fp8_gemms(base, layer_ids, probe, one, measure, scaling: str = "block") -> dict:
    """Step 4: the decoder layers' linears to FP8 GEMMs (block: fp8-block-from-bf16's BlockFP8Linear; row: the
    probe); speed, and the tap layers' outputs on `probe` against the bf16 fast forward's."""
    from bench import fp8_gemm
    from pipeline.fp8_block import quantize_linears

    with torch.inference_mode():
        ref = fp8_gemm.tap_outputs(base.layers, layer_ids, lambda: one(probe))
    n = quantize_linears(base.layers) if scaling == "block" else fp8_gemm.convert(base.layers)
    r = measure(f"fast forward, {scaling}-scaled FP8 GEMMs")
    with torch.inference_mode():
        new = fp8_gemm.tap_outputs(base.layers, layer_ids, lambda: one(probe))
    r.update(linears=n, scaling=scaling, features=fp8_gemm.feature_error(ref, new), probe_tokens=probe.numel())
    return r


def _print(r: dict) -> None:
    print(f"\n{r['shape']} on {r.get('gpu', r['device'])} (ops: {r['ops']})")
    rows = ([("reference", r["reference"])] if "reference" in r else []) + ([("fast", r["fast"])] if "fast" in r else []) \
        + ([("fast fp8", r["fp8_gemm"])] if "fp8_gemm" in r else [])
    if not rows:
        return
    for name, x in rows:
        print(f"{name:<10} bare forward {x['tok_s']:>9.0f} tokens/s   first pass {x['first_pass_s']:.1f}s")
    if "speedup" in r:
        print(f"speedup {r['speedup']:.3f}x; goal bare forward >= 12,000 tokens/s: "
              f"{'met' if r['fast']['tok_s'] >= 12000 else 'NOT met'}")
    fams = sorted({f for _, x in rows for f in x["profile"]["families"]})
    print(f"\n{'kernel family':<14}" + "".join(f"{n:>12}" for n, _ in rows))
    for f in sorted(fams, key=lambda f: -rows[0][1]["profile"]["families"].get(f, 0)):
        print(f"{f:<14}" + "".join(f"{100 * x['profile']['families'].get(f, 0):>11.1f}%" for _, x in rows))
    print(f"{'GPU ms/pass':<14}" + "".join(f"{x['profile']['total_ms']:>12.1f}" for _, x in rows))
    for name, x in rows:
        print(f"\ntop kernels, {name}:")
        for k, share, fam in x["profile"]["top"][:10]:
            print(f"  {100 * share:5.1f}%  {fam:<12} {k}")
    if "extraction" in r:
        e = r["extraction"]
        print(f"\nextraction ({e['tokens']} tokens) vs the fast bare forward {e['bare_tok_s']:.0f} tokens/s:")
        for enc, x in e["encodings"].items():
            print(f"  {enc:<6} {x['tok_s']:>9.0f} tokens/s  {x['ratio_vs_bare']:.3f}  before the final drain "
                  f"{x['ratio_before_drain']:.3f}  (goal >= 0.95: {'met' if x['ratio_vs_bare'] >= 0.95 else 'NOT met'})")
    if "profile" in r.get("extraction", {}):
        _print_profile(r["extraction"]["profile"])
    if "profile" in r.get("fp8_gemm", {}).get("extraction", {}):
        print("\nwith the FP8 GEMMs:")
        _print_profile(r["fp8_gemm"]["extraction"]["profile"])
    if "fp8_gemm" in r:
        f = r["fp8_gemm"]
        print(f"\nFP8 GEMMs ({f['linears']} linears): {f['tok_s']:.0f} tokens/s, {f['speedup_vs_fast']:.3f}x the bf16 "
              f"fast forward; tap layers vs bf16 on {f['probe_tokens']} tokens:")
        for i, e in f["features"].items():
            print(f"  layer {i:>3}: cosine {e['cosine']:.5f}  rel. error {e['rel_err']:.4f}")
        for enc, x in f.get("extraction", {}).get("encodings", {}).items():
            print(f"  extract {enc} with FP8 GEMMs: {x['tok_s']:.0f} tokens/s, {x['ratio_vs_bare']:.3f} of the FP8 bare "
                  f"forward, {x['ratio_before_drain']:.3f} before the final drain "
                  f"({f['extraction']['bare_tok_s']:.0f} tokens/s over the same batches; goal >= 0.95: "
                  f"{'met' if x['ratio_vs_bare'] >= 0.95 else 'NOT met'})")
    if "fp8_gemm_error" in r:
        print(f"FP8 GEMMs failed: {r['fp8_gemm_error']}")
    if "fast_error" in r:
        print(f"fast forward failed: {r['fast_error']}")


def _print_profile(p: dict) -> None:
    cols = [k for k in p if isinstance(p[k], dict) and k != "added"]
    print(f"\nprofiled window, {p['batches']} batches, ms per batch (torch.profiler; GPU idle = between its first and "
          "last kernel, no kernel running):")
    print(f"{'':<26}" + "".join(f"{c:>10}" for c in cols))
    rows = [("wall (profiled)", "wall_ms"), ("GPU span", "span_ms"), ("GPU kernels busy", "busy_ms"),
            ("GPU idle", "idle_ms")]
    for label, key in rows:
        print(f"{label:<26}" + "".join(f"{p[c].get(key, float('nan')):>10.1f}" for c in cols))
    fams = sorted({f for c in cols for f in p[c].get("families", {})}, key=lambda f: -p["bare"].get("families", {}).get(f, 0))
    for f in fams:
        print(f"{'  ' + f:<26}" + "".join(f"{p[c].get('families', {}).get(f, 0.0):>10.1f}" for c in cols))
    for kind in sorted({k for c in cols for k in p[c].get("copies_ms", {})}):
        print(f"{'  copy ' + kind:<26}" + "".join(f"{p[c].get('copies_ms', {}).get(kind, 0.0):>10.1f}" for c in cols))
    for rng in sorted({k for c in cols for k in p[c].get("host_ranges_ms", {})}):
        print(f"{'host ' + rng:<26}" + "".join(f"{p[c].get('host_ranges_ms', {}).get(rng, 0.0):>10.1f}" for c in cols))
    for key in sorted({k for c in cols for k in p[c].get("host_syncs", {})}):
        print(f"{'host ' + key[:21]:<26}" + "".join(
            f"{'%.0fx %.0f' % tuple(p[c]['host_syncs'][key]) if key in p[c].get('host_syncs', {}) else '-':>10}"
            for c in cols))
    for enc, rows in p.get("added", {}).items():
        print(f"kernels extraction adds, {enc} (ms per batch over the bare window's):")
        for k, d in rows[:8]:
            print(f"  {d:7.2f}  {k}")


if __name__ == "__main__":
    main()
