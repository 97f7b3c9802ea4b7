"""Issue 17's two-GPU measurement: extraction at the 27B shape and the 27B-shape drafter's training, each alone
and both at once from the same growing store (training following extraction), in one call.

GPU 0: a random-initialised target of the real Qwen3.5/3.6-27B hybrid layout (`build_target`: Qwen3_5ForCausalLM
from Qwen3_5TextConfig, layers 0..61 of 64: 16 x [3 Gated DeltaNet, 1 gated attention], hidden 5120, FFN 17408,
24/4 heads x 256, linear 16/48 heads x 128, conv 4, vocab 248,320) extracts 3,072-token samples through dflash's
pipeline (`pipelined_extract`, GPU encode, pinned copies, writer thread, int5 as configs/qwen3.6-27b.yaml) into
a store that plans far more samples than the call extracts, so it stays unfinished.
GPU 1: the real `dflash train` with configs/qwen3.6-27b.yaml's drafter (batch 1 x 4 accumulation, bf16, compiled
flex attention); `--follow` on the growing store in the concurrent phase.

Phases (`--train-s`, `--extract-s`, `--both-s` bound them):
 1. train alone: `dflash train` on GPU 1 on a small finished store of random features (cold compile cache), its
    steady optimizer-step rate; meanwhile GPU 0 builds the target.
 2. extract alone: tokens/s over the phase after its first batches (which also builds the backlog phase 3 reads).
 3. both: extraction goes on while `dflash train --follow` (warm compile cache) follows the same store; each
    stage's rate over the time training is stepping, as a fraction of its solo rate.
Then, from the measured rates (not a run to the end): the wall time to a drafter trained for `--epochs` epochs
on the data this call extracted, sequential (extract, then train) against concurrent (training follows: the
first epoch runs at the slower stage's concurrent rate, the others at training's solo rate), and the same
projected to the paper's scale (~1.2B tokens, 6 epochs, 5 extraction GPUs + 3 training GPUs at --ddp-scaling).

    python bench/concurrent_bench.py --out $OUT/concurrent.json          # 2 GPUs, ~6 min
    python bench/concurrent_bench.py --tiny --root /tmp/cb               # CPU smoke run (tiny shapes), ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import store as st  # noqa: E402
from pipeline.encoding import encode  # noqa: E402
from pipeline.provenance import create_or_open_store  # noqa: E402
from pipeline.provenance import write_frozen_head  # noqa: E402
from pipeline.store_writer import ShardWriter  # noqa: E402


def build_target(a, device: torch.device):
    """The target: the real Qwen3.5 hybrid layout with random weights, only the layers extraction runs (0..max
    id). The one place to swap in another builder (e.g. bench/extract_bench.py's `--arch qwen3_5`)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    keep = max(a.layer_ids) + 1
    types = (["linear_attention"] * 3 + ["full_attention"]) * (a.layers // 4)
    cfg = Qwen3_5TextConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=keep,
        layer_types=types[:keep], num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        linear_num_key_heads=a.lin_k_heads, linear_num_value_heads=a.lin_v_heads, linear_key_head_dim=a.lin_head_dim,
        linear_value_head_dim=a.lin_head_dim, linear_conv_kernel_dim=4, max_position_embeddings=8192,
        tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    with device:
        model = Qwen3_5ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def provenance(a, planned_samples: int) -> dict:
    return {"schema_version": st.SCHEMA_VERSION, "dflash_version": "bench",
            "target": {"name": "bench", "path": "bench", "hidden_size": a.hidden, "vocab_size": a.vocab,
                       "num_hidden_layers": a.layers, "tie_word_embeddings": False},
            "layer_ids": a.layer_ids, "hidden_size": a.hidden, "encoding": a.encoding, "chunk_tokens": 256, "clevel": 1,
            "num_shards": 1, "max_length": a.seq,
            "dataset": {"fingerprint": "bench", "samples": planned_samples, "validation_samples": 0,
                        "tokens": planned_samples * a.seq}}


def write_head(path: Path, a, device: torch.device) -> None:
    from safetensors.torch import save_file

    g = torch.Generator(device=device).manual_seed(0)
    head = {n: (torch.randn(a.vocab, a.hidden, device=device, generator=g) * 0.02).to(torch.bfloat16).cpu()
            for n in ("embed_tokens.weight", "lm_head.weight")}
    save_file(head, str(path), metadata={"tie_word_embeddings": "false"})


def _sample(a, i: int, g: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    toks = g.integers(0, a.vocab, a.seq).astype(np.int32)
    mask = np.ones(a.seq, np.uint8)
    mask[: a.seq // 16] = 0  # a prompt
    return toks, mask


def random_store(path: Path, a, n: int, head: Path, device: torch.device) -> None:
    """A finished store of n random-feature samples (phase 1's training reads it)."""
    shutil.rmtree(path, ignore_errors=True)
    prov = provenance(a, n)
    create_or_open_store(str(path), prov)
    w = ShardWriter(str(path), 0, prov)
    w.start("random", n, n * a.seq, validation_batches=0)
    g = np.random.default_rng(1)
    for i in range(n):
        x = torch.randn(a.seq, len(a.layer_ids), a.hidden, device=device).to(torch.bfloat16)
        parts = {k: v.cpu().numpy() for k, v in encode(x, a.encoding).items()}
        toks, mask = _sample(a, i, g)
        w.write_batch(np.array([i + 1], np.uint64), np.zeros(1, np.uint8), np.array([a.seq], np.int32), toks, mask, parts)
    w.finish()
    write_frozen_head(str(path), head.read_bytes())  # with its checksum, as extraction writes it


class Train:
    """`dflash train` in its own process group; its stderr lines timestamped on arrival."""

    def __init__(self, a, store: Path, run: Path, follow: bool):
        shutil.rmtree(run, ignore_errors=True)
        sets = ["target.name=bench", "target.path=bench", f"target.layer_ids={a.layer_ids}", f"train.run_dir={run}", "train.epochs=1000",
                "train.log_every=1", "train.checkpoint_every=1000000", "train.val_every=1000000",
                "train.follow_buffer=16"] + a.train_set  # a small shuffle buffer: training starts on the backlog
        cmd = [sys.executable, "-m", "stages.cli", "train", "--config", a.config, "--store", str(store), "--no-export",
               *(["--gpus", "0"] if a.device == "cuda" else ["--devices", "1"]), *(["--follow"] if follow else [])]
        env = {**os.environ, "DFLASH_COMPILE_CACHE": str(a.root / "compile-cache")}
        if a.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(a.train_gpu)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.t0, self.lines = time.time(), []
        self.p = subprocess.Popen(cmd + [x for s in sets for x in ("--set", s)], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append((time.time(), line.rstrip()))
            if a_verbose:
                print(f"  [train {time.time() - self.t0:6.1f}s] {line.rstrip()}", flush=True)

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, x in list(self.lines) if (m := re.match(r"train: step (\d+)/", x))]

    def stop(self) -> None:  # measured: no final checkpoint (21 GB at this shape), nothing to keep
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()


a_verbose = False


def steady(steps: list[tuple[float, int]], skip: int = 2) -> tuple[float, float, float]:
    """(steps/s, from, to) over the progress lines after the first `skip` (compile, warm-up)."""
    if len(steps) < skip + 2:
        return float("nan"), float("nan"), float("nan")
    (ta, sa), (tb, sb) = steps[skip], steps[-1]
    return (sb - sa) / (tb - ta), ta, tb


def main() -> None:
    global a_verbose
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/dflash-concurrent")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, configs/tiny.yaml's drafter")
    ap.add_argument("--train-s", type=float, default=40.0, help="phase 1: steady training measured this long")
    ap.add_argument("--extract-s", type=float, default=75.0, help="phase 2: extraction alone this long")
    ap.add_argument("--both-s", type=float, default=60.0, help="phase 3: both measured this long once training steps")
    ap.add_argument("--train-gpu", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--paper-tokens", type=float, default=1.2e9)
    ap.add_argument("--extract-gpus", type=int, default=5)
    ap.add_argument("--train-gpus", type=int, default=3)
    ap.add_argument("--ddp-scaling", type=float, default=0.91, help="3-GPU DDP efficiency for the projection "
                    "(91%% measured on 2 H200s, docs/benchmarks.md)")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    a_verbose = a.verbose
    a.device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    shape = dict(layers=64, hidden=5120, ffn=17408, heads=24, kv_heads=4, head_dim=256, lin_k_heads=16, lin_v_heads=48,
                 lin_head_dim=128, vocab=248320, layer_ids=[1, 16, 31, 46, 61], seq=3072, token_budget=16384,
                 encoding="int5", config=str(ROOT / "configs" / "qwen3.6-27b.yaml"), train_set=[], solo_samples=16)
    if a.tiny:
        shape.update(layers=8, hidden=128, ffn=256, heads=4, kv_heads=2, head_dim=32, lin_k_heads=2, lin_v_heads=4,
                     lin_head_dim=32, vocab=300, layer_ids=[1, 3, 5], seq=128, token_budget=512,
                     config=str(ROOT / "configs" / "tiny.yaml"), solo_samples=24,
                     train_set=["train.batch_size=2", "train.num_workers=1", "drafter.mask_token_id=3"])
        a.train_s, a.extract_s, a.both_s = min(a.train_s, 2), min(a.extract_s, 5), min(a.both_s, 2)  # a rate each, not a figure
    for k, v in shape.items():
        setattr(a, k, v)
    a.root = Path(a.root)
    shutil.rmtree(a.root, ignore_errors=True)
    a.root.mkdir(parents=True)
    dev0 = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    res: dict = {"shape": {k: shape[k] for k in ("layers", "hidden", "layer_ids", "seq", "encoding")}, "device": a.device}
    t_start = time.time()

    # phase 1: training alone on GPU 1 (cold compile) while GPU 0 builds the target
    head = a.root / "head.safetensors"
    write_head(head, a, dev0)
    random_store(a.root / "solo.zarr", a, a.solo_samples, head, dev0)
    solo = Train(a, a.root / "solo.zarr", a.root / "run-solo", follow=False)
    model = build_target(a, dev0)
    res["target_params"] = sum(p.numel() for p in model.parameters())
    deadline = time.time() + 900
    while time.time() < deadline and solo.p.poll() is None and (not solo.steps() or
                                                                  solo.steps()[-1][0] - solo.steps()[0][0] < a.train_s):
        time.sleep(0.5)
    solo.stop()
    rate, t_a, t_b = steady(solo.steps())
    res["train_solo"] = {"steps_s": rate, "window_s": t_b - t_a, "first_step_after_launch_s": solo.steps()[0][0] - solo.t0
                         if solo.steps() else None, "log_tail": [x for _, x in solo.lines[-5:]]}
    print(f"phase 1: training alone {rate:.3f} steps/s ({len(solo.steps())} steps)", flush=True)

    # phases 2 and 3: one extraction into a growing store; training follows it from phase 3 on
    from pipeline.target import FeatureCapture
    from stages.extract_loop import pipelined_extract

    store = a.root / "grow.zarr"
    per_batch = max(1, a.token_budget // a.seq)
    planned = 1_000_000
    prov = provenance(a, planned)
    create_or_open_store(str(store), prov)
    writer = ShardWriter(str(store), 0, prov)
    writer.start("bench", planned, planned * a.seq, validation_batches=0)
    write_frozen_head(str(store), head.read_bytes())
    commits: list[tuple[float, int]] = []  # (time, tokens) per committed batch
    g = np.random.default_rng(0)
    state = {"train": None, "launch": None, "n": 0}

    def on_batch(members, parts, bad):
        members = [m for m, b in zip(members, bad) if not b]  # samples with non-finite features are left out
        n = len(members)
        if not n:
            return
        toks, masks = zip(*[_sample(a, i, g) for i in members])
        writer.write_batch(np.array([i + 1 for i in members], np.uint64), np.zeros(n, np.uint8),
                           np.full(n, a.seq, np.int32), np.concatenate(toks), np.concatenate(masks), parts)
        commits.append((time.time(), n * a.seq))

    def batches():
        t0 = time.time()
        while True:
            now = time.time()
            tr = state["train"]
            if tr is None and now - t0 >= a.extract_s:
                state["launch"] = now
                state["train"] = tr = Train(a, store, a.root / "run-follow", follow=True)
            if tr is not None:
                s = tr.steps()
                if (s and s[-1][0] - s[0][0] >= a.both_s) or tr.p.poll() is not None or now - state["launch"] > 300:
                    return
            ids = torch.randint(0, a.vocab, (per_batch, a.seq))
            members = list(range(state["n"], state["n"] + per_batch))
            state["n"] += per_batch
            yield members, ids, [a.seq] * per_batch

    capture = FeatureCapture(model, a.layer_ids)
    t_x0 = time.time()
    pipelined_extract(model, capture, a.encoding, dev0, batches(), on_batch, queue_depth=3)
    t_x1 = time.time()
    follow = state["train"]
    follow.stop()

    def tok_rate(t_from: float, t_to: float) -> float:
        inside = [(t, k) for t, k in commits if t_from < t <= t_to]
        return sum(k for _, k in inside) / max(1e-9, t_to - t_from) if inside else float("nan")

    solo_commits = [t for t, _ in commits if t <= state["launch"]]
    warm = solo_commits[2 if len(solo_commits) > 5 else 0] if solo_commits else t_x0  # after the first batches
    x_solo = tok_rate(warm, state["launch"])
    f_rate, f_a, f_b = steady(follow.steps())
    x_both = tok_rate(f_a, f_b)
    t_solo = res["train_solo"]["steps_s"]
    res["extract_solo"] = {"tokens_s": x_solo, "window_s": state["launch"] - warm}
    res["both"] = {"extract_tokens_s": x_both, "train_steps_s": f_rate, "window_s": f_b - f_a,
                   "extract_fraction": x_both / x_solo, "train_fraction": f_rate / t_solo,
                   "train_first_step_after_launch_s": follow.steps()[0][0] - follow.t0 if follow.steps() else None,
                   "train_waited": any("waiting for extraction" in x for _, x in follow.lines)}
    tokens_extracted = sum(k for _, k in commits)
    res["extracted_tokens"], res["extract_wall_s"] = tokens_extracted, t_x1 - t_x0
    from pipeline.config import load_config

    tc = load_config(a.config, a.train_set).train
    per_step = tc.batch_size * tc.accumulate_grad_batches * a.seq  # tokens per optimizer step on one GPU
    res["model"] = model_times(tokens_extracted, a.epochs, x_solo, t_solo * per_step, res["both"], 1, 1, 1.0)
    res["paper"] = model_times(a.paper_tokens, 6, x_solo, t_solo * per_step, res["both"], a.extract_gpus, a.train_gpus,
                               a.ddp_scaling)
    res["wall_s"] = time.time() - t_start
    report(res, a)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


def model_times(tokens: float, epochs: int, x1: float, t1: float, both: dict, nx: int, nt: int, ddp: float) -> dict:
    """Wall time to a drafter trained `epochs` times on `tokens`, from per-GPU rates (tokens/s): sequential =
    extract, then train; concurrent = the first epoch at the slower stage's concurrent rate (training cannot get
    ahead of extraction), then the other epochs at training's solo rate."""
    X, T = nx * x1, nt * t1 * (ddp if nt > 1 else 1.0)
    seq = tokens / X + epochs * tokens / T
    first = max(tokens / (X * both["extract_fraction"]), tokens / (T * both["train_fraction"]))
    conc = first + (epochs - 1) * tokens / T
    return {"tokens": tokens, "epochs": epochs, "extract_gpus": nx, "train_gpus": nt, "sequential_s": seq,
            "concurrent_s": conc, "saved_fraction": 1 - conc / seq}


def report(r: dict, a) -> None:
    b = r["both"]
    print(f"\ntarget: Qwen3.5 hybrid layout, layers 0..{max(a.layer_ids)}, {r['target_params'] / 1e9:.2f}B parameters, "
          f"random weights; {a.seq}-token samples, {a.encoding}; device {r['device']}")
    print(f"{'stage':<12}{'alone':>16}{'both at once':>16}{'fraction':>10}")
    print(f"{'extraction':<12}{r['extract_solo']['tokens_s']:>12,.0f} t/s{b['extract_tokens_s']:>12,.0f} t/s"
          f"{b['extract_fraction']:>10.3f}")
    print(f"{'training':<12}{r['train_solo']['steps_s']:>10.3f} steps/s{b['train_steps_s']:>10.3f} steps/s"
          f"{b['train_fraction']:>10.3f}")
    print(f"(training followed the growing store{'; it waited for extraction at times' if b['train_waited'] else ''};"
          f" windows: alone {r['train_solo']['window_s']:.0f} s / {r['extract_solo']['window_s']:.0f} s, "
          f"both {b['window_s']:.0f} s)")
    for name, m in (("this call's data", r["model"]), ("paper scale", r["paper"])):
        print(f"{name}: {m['tokens'] / 1e6:,.1f}M tokens x {m['epochs']} epochs on {m['extract_gpus']} + "
              f"{m['train_gpus']} GPUs: sequential {m['sequential_s'] / 3600:.2f} h, concurrent "
              f"{m['concurrent_s'] / 3600:.2f} h ({abs(100 * m['saved_fraction']):.0f}% "
              f"{'less' if m['saved_fraction'] >= 0 else 'more'}), from the measured rates")
    print(f"call wall time {r['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
