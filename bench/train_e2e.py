"""`dflash train` end to end at the 27B shape: the user's wait before the first step, cold and warm cache.

Builds a store of random 27B-shaped features (5 layers x 5120, int5 as the 27B configs default, 3,072-token
samples) and a random 248,320 x 5120 frozen embedding/head, then runs the real command with
configs/qwen3.6-27b.yaml once per `--gpus` entry: the first with an empty compile cache, each later one as a new
run with another learning rate (what a user does next), which reuses the shared cache. `--gpus 0 0,1` compares
one GPU with two DDP ranks (NCCL): samples/s count every rank's samples, and each rank reports its own first
batch (its compile). Every stderr line is timestamped on arrival, so the table gives the time from launch to
the first finished batch, the steady optimizer-step rate after it, and the end of the run (from the last
step to the final checkpoint in place, then to the process's exit).

End-to-end MFU (issue 22 item 3): the steady rate (optimizer, loader, logging included; from the 3rd logged step
to the last) x the useful FLOPs of one sample (bench/train_bench.py's count for this config's drafter, 3,072-token
samples with 200 unlabelled tokens first, train.num_anchors anchors) / --peak-tflops per GPU. DDP scaling (item 2):
a multi-GPU run's samples/s / (GPUs x the last 1-GPU run's samples/s). An entry `0,1@train.ddp_static_graph=true`
adds `--set` options to that run (`@` between them): how the DDP options are compared.

    python bench/train_e2e.py --root /tmp/e2e --steps 12 --gpus 0 0 0,1 --out $OUT/train_e2e.json
    python bench/train_e2e.py --root /tmp/e2e --cold-steps 3 --steps 55 --gpus 0 0 0,1 --out $OUT/e2e_mfu.json

Length mixes and packing (issue 28 item 4): `--mix chat` (the tiny-chat length histogram, TINY_CHAT_HIST,
scaled to a mean of ~1K tokens) or `--mix long` (the same shape scaled to a mean of ~4.5K, cut at 8K, as
SpecForge's 27B recipe) builds samples of mixed lengths, and `--gpus 0 "0@train.packing=true"` runs them
without and with packing. Every run logs the samples of each batch (DFLASH_SAMPLE_LOG), so the steady window's
samples/s, tokens/s and MFU count exactly the samples trained in it: useful FLOPs only (each sample's own
tokens, anchors and visible keys; padding is waste), whatever the rows looked like.

    python bench/train_e2e.py --root /tmp/pm --mix chat --samples 96 --steps 55 --cold-steps 55 \
        --gpus 0 "0@train.packing=true" --out $OUT/packmfu_chat.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.store_bench import provenance  # noqa: E402
from pipeline.encoding import encode  # noqa: E402
from pipeline.provenance import create_or_open_store  # noqa: E402
from pipeline.store_writer import ShardWriter  # noqa: E402
from stages.train_startup import read_phase_text  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LRS = ("6e-4", "3e-4")  # consecutive runs differ in lr, as a user's next run would


# token lengths of the shipped tiny-chat conversations (the session test store's 240, buckets of 8: centre -> count)
TINY_CHAT_HIST = {28: 3, 36: 62, 44: 31, 52: 55, 60: 26, 68: 5, 76: 7, 84: 8, 92: 16, 100: 18, 108: 5, 116: 3, 124: 1}
MIXES = {"chat": (1024, 3072), "long": (4500, 8192)}  # target mean, cap


def mix_lengths(mix: str, samples: int, seq: int, seed: int = 0) -> list[int]:
    """Sample lengths: `fixed` = seq each; `chat` / `long` = TINY_CHAT_HIST's shape drawn with a seed and scaled
    so that the mean after the cap is the mix's (the 128-token floor keeps a prompt and an answer)."""
    if mix == "fixed":
        return [seq] * samples
    import random

    mean, cap = MIXES[mix]
    rng = random.Random(seed)
    base = rng.choices(list(TINY_CHAT_HIST), weights=list(TINY_CHAT_HIST.values()), k=samples)
    base = [b + rng.uniform(-4, 4) for b in base]
    lo, hi = 1.0, 1000.0
    for _ in range(60):  # the scale whose capped mean is the target
        f = (lo + hi) / 2
        lo, hi = (f, hi) if sum(min(cap, b * f) for b in base) / samples < mean else (lo, f)
    return [max(128, min(cap, int(b * f))) for b in base]


def build_store(path: Path, samples: int, seq: int, enc: str, layers: list[int], H: int, vocab: int,
                lengths: list[int] | None = None) -> None:
    """A one-shard store of random 27B-shaped features; `lengths` per sample (default seq each). The first
    200 tokens of a sample (a fifth of a short one) are unlabelled, as a prompt."""
    shutil.rmtree(path, ignore_errors=True)
    lengths = lengths or [seq] * samples
    prov = provenance(enc, len(layers), H)
    prov["layer_ids"], prov["target"]["vocab_size"] = layers, vocab
    create_or_open_store(str(path), prov)
    w = ShardWriter(str(path), 0, prov)
    w.start("e2e", samples, sum(lengths))
    g = torch.Generator(device=DEV).manual_seed(0)
    scale = torch.exp(torch.randn(len(layers), H, device=DEV, generator=g) * 0.7)
    for i, seq in enumerate(lengths):
        x = (torch.randn(seq, len(layers), H, device=DEV, generator=g) * scale).to(torch.bfloat16)
        parts = {k: v.cpu().numpy() for k, v in encode(x, enc).items()}
        parts = {k: (v.view(np.uint16) if v.dtype == np.int16 else v) for k, v in parts.items()}
        toks = torch.randint(0, vocab, (seq,), device=DEV, generator=g).cpu().numpy().astype(np.int32)
        mask = np.ones(seq, np.uint8)
        mask[: min(200, seq // 5)] = 0
        w.write_batch(np.array([i + 1], np.uint64), np.zeros(1, np.uint8), np.array([seq], np.int32), toks, mask, parts)
    w.finish()
    from safetensors.torch import save

    head = {n: (torch.randn(vocab, H, device=DEV, generator=g) * 0.02).to(torch.bfloat16).cpu()
            for n in ("embed_tokens.weight", "lm_head.weight")}
    from pipeline.provenance import write_frozen_head

    write_frozen_head(str(path), save(head, metadata={"tie_word_embeddings": "false"}))  # with its checksum


def flops_per_sample(config: str, layers: list[int], vocab: int, seq: int) -> float:
    """Useful FLOPs of one training sample of this store (train_bench's count for the config's drafter)."""
    from bench.train_bench import useful_flops
    from pipeline.config import load_config
    from pipeline.masks import build_blocks, dense_mask, sample_anchors
    from pipeline.train_step import build_drafter

    cfg = load_config(config)
    d = cfg.drafter
    with torch.device("meta"):  # only the shape is needed
        arch = build_drafter(cfg, layers, vocab).arch
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(1, seq, dtype=torch.bool)
    mask[:, :200] = False  # as build_store writes
    anchors = sample_anchors(mask[0], cfg.train.num_anchors, g)[None]
    tokens = torch.randint(0, vocab, (1, seq), generator=g)
    blocks = build_blocks(tokens, mask, anchors, d.block_size, d.mask_token_id % vocab, 7.0)
    vis = {t: int(dense_mask(anchors, d.block_size, seq, window=d.sliding_window if t == "sliding_attention" else None).sum())
           for t in set(d.layer_types)}
    return useful_flops(arch, seq, anchors.shape[1] * d.block_size, int((blocks.labels >= 0).sum()), vocab, vis)


def doc_flops(arch, n: int, num_anchors: int, vocab: int, seed: int = 0) -> float:
    """Useful FLOPs of one sample of n tokens laid out as build_store writes it (the first min(200, n/5)
    unlabelled), with train.num_anchors anchors (rule fixed): train_bench's count, visible key pairs counted
    from the anchors by the mask's interval rule (pipeline/masks.py), so an 8K sample needs no dense grid. The
    same in a packed row: a document sees only itself."""
    from bench.train_bench import useful_flops
    from pipeline.masks import build_blocks, sample_anchors

    bs, W = arch.block_size, arch.sliding_window
    mask = torch.ones(n, dtype=torch.bool)
    mask[: min(200, n // 5)] = False
    a = sample_anchors(mask, num_anchors, torch.Generator().manual_seed(seed))  # [A]
    vis = visible_pairs(a, bs, arch.layer_types, W)
    labels = build_blocks(torch.zeros(1, n, dtype=torch.long), mask[None], a[None], bs, 0, 7.0).labels
    return useful_flops(arch, n, len(a) * bs, int((labels >= 0).sum()), vocab, vis)


def visible_pairs(a: torch.Tensor, bs: int, layer_types, window) -> dict:
    """Attended (query, key) pairs of one sample's anchors a [A] per layer type: each query row sees context keys
    [lo, anchor) (lo = 0, or anchor + k - W + 1 in a sliding window) and its own block (all bs keys, or k + 1
    causal in a sliding window); the count dense_mask(...).sum() gives (tests/test_pack_bench.py)."""
    k = torch.arange(bs)
    vis = {}
    for t in set(layer_types):
        if t == "sliding_attention":
            ctx = torch.minimum(a[:, None], (window - 1 - k).clamp(min=0)[None, :])
            vis[t] = int(ctx.sum() + len(a) * int((k + 1).sum()))
        else:
            vis[t] = int(a.sum() * bs + len(a) * bs * bs)
    return vis


def useful_window(run_dir: Path, lengths: dict, flops: dict, skip_steps: int = 3) -> dict | None:
    """Samples, tokens and useful FLOPs per second over the steady window of rank 0's sample log (batches of
    step >= skip_steps; the time from the first such batch to the last, the work of the batches after the
    first). lengths / flops: by sample id. With several ranks: per GPU."""
    path = run_dir / "logs" / "samples-rank0.jsonl"
    if not path.exists():
        return None
    rows = [x for x in map(json.loads, path.read_text().splitlines()) if x["step"] >= skip_steps]
    if len(rows) < 2:
        return None
    dt = rows[-1]["t"] - rows[0]["t"]
    ids = [i for x in rows[1:] for i in x["ids"] if i >= 0]
    return {"batches": len(rows) - 1, "seconds": dt, "samples_s": len(ids) / dt,
            "tokens_s": sum(lengths[i] for i in ids) / dt, "useful_flops_s": sum(flops[i] for i in ids) / dt}


def train_command(config: str, store: Path, gpus: str, sets: list[str], cuda: bool) -> list[str]:
    """The `dflash train` command of one run: on CUDA these GPUs, without it (a smoke run of this script) the same
    number of CPU ranks over gloo; every --set on both (issue 31: the CUDA branch once dropped them all)."""
    cmd = [sys.executable, "-m", "stages.cli", "train", "--config", config, "--store", str(store), "--no-export"]
    cmd += ["--gpus", gpus] if cuda else ["--devices", str(len(gpus.split(",")))]
    return cmd + [a for s in sets for a in ("--set", s)]


def step_bubbles(lines: list, skip: int = 3, slow: float = 1.2) -> dict:
    """Where the steady window loses time: each logged step's interval (single-step logging) after the `skip`th,
    the median, and the steps slower than `slow` x the median, named by what happened there (an epoch's first
    step: the loader's refill; a checkpoint's copy)."""
    steps = [(t, int(m.group(1)), int(m.group(2))) for t, x in lines
             if (m := re.match(r"train: step (\d+)/\d+ epoch (\d+)", x))]
    ckpts = [t for t, x in lines if re.match(r"train: checkpoint \S+ written", x)]
    gaps = [(b[1], b[0] - a[0], b[2] != a[2]) for a, b in zip(steps, steps[1:]) if b[1] == a[1] + 1 and b[1] > skip]
    if not gaps:
        return {"median_step_s": None, "slow_steps": []}
    med = sorted(g for _, g, _ in gaps)[len(gaps) // 2]
    slow_steps = [{"step": n, "s": round(g, 3), "epoch_start": new} for n, g, new in gaps if g > slow * med]
    return {"median_step_s": med, "slow_steps": slow_steps, "checkpoint_lines": len(ckpts)}


def phase_line(lines: list, name: str) -> dict | None:
    """{part: seconds} of the first `train: NAME( on rank R)? T s: part s, ...` line (start-up, fit set-up,
    frozen-head thread, end: stages/train_startup.read_phase_text, the format's owner), else None."""
    return next((d for _, x in lines if (d := read_phase_text(x, name)) is not None), None)


def recompiles(lines: list) -> dict:
    """dynamo's recompiles in a run's log (dflash's one-line form and dynamo's full dump), before and after the
    first optimizer step's line: issue 46 item 2's goal is none after it (one compile per run)."""
    first = next((i for i, (_, x) in enumerate(lines) if re.match(r"train: step \d+/", x)), len(lines))
    hit = [i for i, (_, x) in enumerate(lines) if re.match(r"(train: recompiling |.*Recompiling function )", x)]
    return {"recompiles_by_step_1": sum(i < first for i in hit), "recompiles_after_step_1": sum(i > first for i in hit)}


def run(store: Path, run_dir: Path, cache: Path, steps: int, lr: str, config: str, layers: list[int], gpus: str,
        extra: tuple = (), checkpoint_every: int = 100000, keep=None) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [*extra, "target.name=bench", f"target.layer_ids={layers}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", "train.epochs=1000",
            "train.log_every=1", f"train.lr={lr}", f"train.checkpoint_every={checkpoint_every}", "train.val_every=100000"]
    cmd = train_command(config, store, gpus, sets, torch.cuda.is_available())
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                         env={**os.environ, "DFLASH_COMPILE_CACHE": str(cache), "DFLASH_SAMPLE_LOG": "1",
                              "DFLASH_EXIT_STACKS": "3"})  # the exit's Python stacks every 3 s (stages/train_fit.say_end)
    lines, exited = [], []
    waiter = threading.Thread(target=lambda: (p.wait(), exited.append(time.time() - t0)), daemon=True)
    waiter.start()  # the process's own exit; stderr closes only when its children holding it are gone too
    for line in p.stderr:
        lines.append((time.time() - t0, line.rstrip()))
        print(f"[{lines[-1][0]:7.1f}s] {line.rstrip()}", flush=True)
    closed = time.time() - t0
    rc = p.wait()
    waiter.join()
    firsts = [float(m.group(1)) for _, x in lines if (m := re.search(r"first batch done ([0-9.]+) s", x))]
    first = max(firsts) if firsts else None  # with several ranks, the step waits for the slowest
    final_at, final = next(((t, float(m.group(1))) for t, x in lines
                            if (m := re.search(r"in place ([0-9.]+) s after training ended", x))), (None, None))
    stamps = [(t, int(m.group(1))) for t, x in lines if (m := re.match(r"train: step (\d+)/", x))]
    # start-up phases (stages/train_startup.py) and each checkpoint's training stall (stages/train_ckpt_io.py)
    startup, fit_parts, head, end = (phase_line(lines, name) for name in ("start-up", "fit set-up",
                                                                          "frozen-head thread", "end"))
    handlers = next((float(m.group(1)) for _, x in lines
                     if (m := re.match(r"train: exit handlers begin ([0-9.]+) s", x))), None)
    compiles = next(({p.rsplit(" ", 1)[0]: float(p.rsplit(" ", 1)[1]) for p in m.group(1).split(", ") if " " in p}
                     for _, x in lines if (m := re.match(r"train: compiles so far.*?: (.*)", x))), None)  # dynamo's timers
    stalls = [(m.group(1), float(m.group(2))) for _, x in lines
              if (m := re.match(r"train: checkpoint (\S+) written: training waited ([0-9.]+) s", x))]
    steady = None
    if len(stamps) >= 4:
        (ta, sa), (tb, sb) = stamps[2], stamps[-1]
        steady = (sb - sa) / (tb - ta)
    bubbles = step_bubbles(lines)
    kept = keep(run_dir) if keep else None  # what the caller reads of the run before it goes
    profile = None  # train.profile_steps' window (stages/train_profile.py), printed and kept
    if (run_dir / "logs" / "profile-rank0.json").exists():
        print((run_dir / "logs" / "profile-rank0.txt").read_text(), flush=True)
        profile = json.loads((run_dir / "logs" / "profile-rank0.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)  # a 27B-shape checkpoint is ~21 GB (fp32 weights + AdamW)
    return {"rc": rc, "gpus": gpus, "wall_s": time.time() - t0, "first_batch_s": first, "first_batch_per_rank_s": firsts,
            "steady_steps_s": steady, "steps": stamps[-1][1] if stamps else 0, "final_checkpoint_s": final,
            "startup_phases_s": startup, "fit_setup_parts_s": fit_parts, "first_batch_compiles_s": compiles,
            "head_thread_s": head, "end_phases_s": end, "exit_handlers_begin_s": handlers,
            "checkpoint_stalls_s": stalls, **bubbles, **recompiles(lines),
            "exit_after_final_checkpoint_s": None if final_at is None else exited[0] - final_at,
            "stderr_closed_after_final_checkpoint_s": None if final_at is None else closed - final_at,
            "useful": kept, "profile": profile, "log": [f"{t:7.1f}s {x}" for t, x in lines]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/dflash-e2e")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--encoding", default="int5")
    ap.add_argument("--config", default=str(ROOT / "configs/qwen3.6-27b.yaml"))
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--layer-ids", default="1,16,31,46,61")
    ap.add_argument("--gpus", nargs="+", default=["0", "0"],
                    help="one run per entry (first with a cold compile cache, then warm, each a new lr): 0 0 0,1")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a --set for every run (KEY=VALUE)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep ROOT's store and compile cache from an earlier call (the first run is then warm)")
    ap.add_argument("--reference", default=None,
                    help="an earlier call's --out JSON whose 1-GPU run is the scaling reference (when this call has none)")
    ap.add_argument("--cold-steps", type=int, default=None, help="optimizer steps of the first (cold) run; default --steps")
    ap.add_argument("--checkpoint-every", type=int, default=100000,
                    help="train.checkpoint_every of the warm runs (their periodic checkpoints' stall is in the table)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak of the GPU (train_bench)")
    ap.add_argument("--mix", default="fixed", choices=["fixed", *MIXES],
                    help="sample lengths: --seq each, or a length mix (chat: mean ~1K; long: mean ~4.5K, max 8K)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    root = Path(a.root)
    t = time.perf_counter()
    layers = [int(x) for x in a.layer_ids.split(",")]
    cache = root / "compile-cache"
    lengths = mix_lengths(a.mix, a.samples, a.seq)
    if not (a.reuse and (root / "store.zarr").is_dir()):
        build_store(root / "store.zarr", a.samples, a.seq, a.encoding, layers, a.hidden, a.vocab, lengths)
        print(f"store: {a.samples} samples, {a.mix} mix ({sum(lengths) / len(lengths):.0f} tokens mean, max "
              f"{max(lengths)}), {a.encoding}, built in {time.perf_counter() - t:.0f} s", flush=True)
    keep = None
    if a.mix != "fixed":  # useful work per sample id (build_store's ids are 1..N)
        from pipeline.config import load_config
        from pipeline.train_step import build_drafter

        c = load_config(a.config, [*a.sets, f"target.layer_ids={layers}"])
        with torch.device("meta"):
            arch = build_drafter(c, layers, a.vocab).arch
        per_len = {n: doc_flops(arch, n, c.train.num_anchors, a.vocab) for n in sorted(set(lengths))}
        by_id = {i + 1: n for i, n in enumerate(lengths)}
        flops_id = {i: per_len[n] for i, n in by_id.items()}
        keep = lambda run_dir: useful_window(run_dir, by_id, flops_id)  # noqa: E731
    if not a.reuse:
        shutil.rmtree(cache, ignore_errors=True)
    res = {}
    for i, entry in enumerate(a.gpus):
        gpus, *extra = entry.split("@")
        n = len(gpus.split(","))
        name = f"{'cold' if i == 0 and not a.reuse else 'warm'} {n} GPU{'s' if n > 1 else ''} (run {i + 1}, lr {LRS[i % 2]})"
        name += "".join(f" {x.removeprefix('train.')}" for x in extra)
        steps = a.cold_steps if i == 0 and a.cold_steps else a.steps
        res[name] = run(root / "store.zarr", root / f"run-{i}", cache, steps, LRS[i % 2], a.config, layers, gpus, (*a.sets, *extra),
                        checkpoint_every=a.checkpoint_every if i or a.reuse else 100000, keep=keep)
        if a.out:  # after each run: a time limit that stops the second one keeps the first
            Path(a.out).write_text(json.dumps(res, indent=1))
    from pipeline.config import load_config

    t = load_config(a.config, [x for x in a.sets if x.startswith("train.")]).train  # with the runs' --set options
    accum = t.accumulate_grad_batches * t.batch_size  # samples (packed: rows) per optimizer step and GPU
    what = f"{a.seq}-token samples" if a.mix == "fixed" else f"the {a.mix} mix"
    print(f"\n`dflash train` at the 27B shape, {a.encoding} store, {what}, {accum} rows per optimizer step "
          "and GPU; first batch: the slowest rank; end: from the last step to the final checkpoint in place; exit: from there to the process's exit")
    flops = flops_per_sample(a.config, layers, a.vocab, a.seq)
    w = max(34, *(len(k) + 1 for k in res))
    print(f"{'run':<{w}}{'rc':>3}{'first batch s':>15}{'steps/s':>9}{'samples/s':>11}{'MFU':>7}{'scaling':>9}{'end s':>7}"
          f"{'exit s':>8}{'wall s':>8}{'ckpt stall s':>14}")
    nan, one_gpu = float("nan"), None
    if a.reference:  # the 1-GPU samples/s of an earlier call (its last 1-GPU run)
        ref = json.loads(Path(a.reference).read_text())
        one_gpu = next((r["samples_s"] for r in reversed([v for v in ref.values() if isinstance(v, dict)])
                        if len(r.get("gpus", "0,1").split(",")) == 1 and r.get("samples_s") == r.get("samples_s")), None)
    for k, r in res.items():
        sps, world = r["steady_steps_s"] or nan, len(r["gpus"].split(","))
        first, end, ex = (nan if r[x] is None else r[x] for x in ("first_batch_s", "final_checkpoint_s", "exit_after_final_checkpoint_s"))
        per_gpu = sps * accum  # samples/s of one GPU
        if world == 1:
            one_gpu = per_gpu
        mfu = per_gpu * flops / (a.peak_tflops * 1e12) if keep is None else nan  # a mix: the table below
        r.update(samples_s=per_gpu * world, mfu=mfu, measured_steps=max(0, r["steps"] - 3),
                 scaling=per_gpu / one_gpu if world > 1 and one_gpu else None)
        scaling = f"{100 * r['scaling']:.1f}%" if r["scaling"] else "-"
        print(f"{k:<{w}}{r['rc']:>3}{first:>15.1f}{sps:>9.3f}{per_gpu * world:>11.2f}{100 * r['mfu']:>6.1f}%{scaling:>9}"
              f"{end:>7.1f}{ex:>8.1f}{r['wall_s']:>8.0f}{max([s for _, s in r['checkpoint_stalls_s']], default=nan):>14.2f}")
        if r["startup_phases_s"]:
            print("    start-up: " + ", ".join(f"{k} {v:.1f}" for k, v in r["startup_phases_s"].items()))
        for label, key in (("fit set-up", "fit_setup_parts_s"), ("compiles by the first batch", "first_batch_compiles_s"),
                           ("frozen-head thread", "head_thread_s"), ("end", "end_phases_s")):
            if r.get(key):
                print(f"    {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in r[key].items()))
        if r.get("exit_handlers_begin_s") is not None:
            print(f"    exit: its handlers began {r['exit_handlers_begin_s']:.1f} s after the end line; the process was "
                  f"gone {ex:.1f} s after the final checkpoint, its stderr closed (children holding it gone) "
                  f"{r['stderr_closed_after_final_checkpoint_s']:.1f} s after it (the stacks in the log: "
                  "DFLASH_EXIT_STACKS)")
        print(f"    recompiles: {r['recompiles_by_step_1']} by the first step's line, {r['recompiles_after_step_1']} after it")
        if r.get("median_step_s") and keep is None:
            med_mfu = accum / r["median_step_s"] * flops / (a.peak_tflops * 1e12)
            r["mfu_at_median_step"] = med_mfu
            slow = ", ".join(f"{x['step']}{' (epoch start)' if x['epoch_start'] else ''} {x['s']:.2f} s"
                             for x in r["slow_steps"][:8]) or "none"
            print(f"    steps: median {r['median_step_s']:.3f} s (MFU at the median {100 * med_mfu:.1f}%); "
                  f"slower than 1.2x the median: {slow}")
    print(f"MFU: {flops / 1e12:.2f} useful TFLOP per sample, peak {a.peak_tflops:.0f} TFLOP/s per GPU, steady rate over the "
          "steps after the 3rd logged one (goal >= 68% over >= 50 steps); scaling: per-GPU samples/s vs the last 1-GPU "
          "run (goal >= 95%); ckpt stall: the longest training wait for a checkpoint (goal < 2 s)")
    if keep is not None:  # the length mix: what the steady window really trained, useful FLOPs only
        print(f"\n{a.mix} mix, {len(lengths)} samples, mean {sum(lengths) / len(lengths):.0f} tokens, max {max(lengths)}; "
              "steady window (batches of step >= 3), rank 0, per GPU; MFU = useful FLOP/s / peak (padding is waste)")
        print(f"{'run':<{w}}{'rc':>3}{'batches':>9}{'samples/s':>11}{'tokens/s':>11}{'MFU':>8}")
        for k, r in res.items():
            u = r["useful"] or {}
            if u:
                u["mfu"] = u["useful_flops_s"] / (a.peak_tflops * 1e12)
            print(f"{k:<{w}}{r['rc']:>3}{u.get('batches', 0):>9}{u.get('samples_s', nan):>11.2f}"
                  f"{u.get('tokens_s', nan):>11.0f}{100 * u.get('mfu', nan):>7.1f}%")
    if a.out:
        Path(a.out).write_text(json.dumps({**res, "useful_tflop_per_sample": flops / 1e12, "mix": a.mix,
                                           "lengths": lengths}, indent=1))
    return 1 if any(r["rc"] for r in res.values()) else 0  # a failed run fails the bench (and its smoke test)


if __name__ == "__main__":
    sys.exit(main())
