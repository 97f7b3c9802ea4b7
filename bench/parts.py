"""The benchmark parts of bench/device_run.sh: one registry of command lines for the GPU run and its CPU smoke run.

Each part is a function `(ctx) -> list of steps` registered under its name. `ctx.tiny` picks the CPU smoke size;
the same function builds both command lines, so what the smoke test runs is what the GPU machine runs, bar the
sizes and the device (issue 31 item 5: `bench/train_e2e.py` once dropped every `--set` on CUDA only, and the CPU
smoke path, built elsewhere, could not see it). A step is one command (argv, extra env, its log file under OUT,
a time limit, how much of its log to show), a group of commands run side by side, or a Python function.

    python3 -m bench.parts run PART [PART ...]     # what bench/device_run.sh calls for each part (OUT=$OUT)
    python3 -m bench.parts run --tiny PART         # the same part at its CPU smoke size
    python3 -m bench.parts list                    # the part names, one a line

`bash bench/device_run.sh smoke` runs every part at the tiny size on the CPU (tests/test_bench_parts.py runs
each one). Environment overrides (EXTRACT_TOKENS, E2E_STEPS, ...) apply to the GPU size only.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@dataclass
class Step:
    """One command of a part. `log` is under OUT (the whole output); `show` lines of it are printed after it ends
    (the last ones, matching `only` and not `hide`); `copy` (src, dst) pairs are copied every 15 s and at the end
    (rows reach OUT even when the call is cut short); `clean` paths are removed first."""
    argv: list[str]
    log: str
    env: dict = field(default_factory=dict)
    timeout: float | None = None
    show: int = 8
    only: str | None = None
    hide: str | None = None
    copy: list = field(default_factory=list)
    clean: list = field(default_factory=list)
    cwd: Path = ROOT
    detach: bool = False  # start in its own session and return (a later part collects it)


@dataclass
class Ctx:
    out: Path
    tiny: bool

    @property
    def tmp(self) -> Path:
        """Scratch space: /tmp on the GPU machine, inside OUT at the tiny size (a test's own directory)."""
        return self.out / "tmp" if self.tiny else Path("/tmp")

    def var(self, name: str, gpu: str, tiny: str) -> str:
        return tiny if self.tiny else os.environ.get(name, gpu)


PARTS: dict[str, Callable[[Ctx], list]] = {}


def part(name: str):
    def add(fn):
        PARTS[name] = fn
        return fn
    return add


def _pytest(c: Ctx, name: str, *args: str, show: int = 60, alone_after: bool = False) -> list:
    """A GPU test run; at the tiny size its collection (the tests skip without CUDA): the selection is valid. Each
    test is named as it ends (-v). GPU_TEST_JOBS > 1 runs that many pytest-xdist workers (from .whl on the GPU
    machine), one test file a worker; GPU_TEST_LIMIT (seconds) stops it with SIGINT, so pytest still prints its
    summary. `alone_after` (part gputests): with workers, the tests marked gpu_alone (they start dflash on the
    GPU, whose preflight wants 16 GiB free: beside four workers on an 80 GB H100 it refused, 2026-12-06) run
    after the others, one at a time, in a second step (GPU_TEST_ALONE=0 leaves it to part gpualone)."""
    jobs = c.var("GPU_TEST_JOBS", "1", "1")
    workers = ["-n", jobs, "--dist", "loadfile"] if jobs != "1" else []
    if not alone_after or (jobs == "1" and not c.tiny):  # (the smoke run collects both steps' selections)
        return [_pytest_step(c, name, "gpu", args, workers, show)]
    steps = [_pytest_step(c, name, "gpu and not gpu_alone", args, workers, show)]
    if c.var("GPU_TEST_ALONE", "1", "1") != "0":
        steps += _alone(c, f"{name}_alone", *args, show=show)
    # at the tiny size both steps only collect the suite: side by side (on the GPU the alone step follows)
    return [steps] if c.tiny and len(steps) > 1 else steps


def _pytest_step(c: Ctx, name: str, marks: str, args: tuple, workers: list, show: int) -> Step:
    """One pytest run of the tests marked `marks` (at the tiny size, their collection only)."""
    argv = [PY, "-m", "pytest", "-v", "-m", marks, *args, "-p", "no:cacheprovider", "--tb=short", *workers]
    return Step(argv + (["--collect-only"] if c.tiny else []), f"{name}.log", show=show,
                timeout=float(c.var("GPU_TEST_LIMIT", "3600", "600")), hide=r"^\s*$|warnings summary|Warning")


def _alone(c: Ctx, name: str, *args: str, show: int = 60) -> list:
    """The gpu_alone tests, one at a time (see _pytest)."""
    return [_pytest_step(c, name, "gpu and gpu_alone", args, [], show)]


def _bench(c: Ctx, script: str, args: list, tiny: list, log: str, **kw) -> Step:
    return Step([PY, f"bench/{script}", *args, *(tiny if c.tiny else [])], log, **kw)


def _train_bench(c: Ctx, args: list, log: str, modes: str = "flex", **kw) -> Step:
    """bench/train_bench.py; at the tiny size on the CPU with SDPA (flex attention is the CUDA path)."""
    size = ["--modes", "sdpa", "--device", "cpu", "--tiny", "--steps", "2"] if c.tiny else ["--modes", modes]
    return _bench(c, "train_bench.py", [*size, *args], [], log, **kw)


for _n, _a in {"gputests": ["tests/"], "attntests": ["tests/test_gpu_attention.py"],
               "gpufix": ["tests/test_gpu_attention.py", "-k", "bounded_recompiles or under_autocast"],
               "dflash2tests": ["tests/test_gpu_dflash2.py"], "hybridtests": ["tests/test_hybrid.py"],
               "iscausal": ["tests/test_gpu_is_causal.py", "-s"], "longtest": ["tests/test_gpu_long.py"],
               "packtests": ["tests/test_packing.py"],
               # what the wave-4 GPU run left (cut by its time limit, or failed on transformers 5.17's cache names)
               "gpuleft": ["tests/test_gpu_train.py", "tests/test_fast_forward.py", "-s"]}.items():
    PARTS[_n] = (lambda a, n: lambda c: _pytest(c, n, *a, alone_after=n == "gputests"))(_a, _n)
PARTS["gpualone"] = lambda c: _alone(c, "gpualone", "tests/")  # gputests' second step on its own


@part("trainbench")
def trainbench(c: Ctx) -> list:
    """Cold compile cache, then the same step from a second process with the cache warm."""
    cc = str(c.tmp / "cc")
    steps = [] if c.tiny else ["--steps", "8"]
    return [_train_bench(c, [*steps, "--cache-dir", cc, "--out", str(c.out / "train_cold.json")], "train_cold.log",
                         show=4, clean=[cc]),
            _train_bench(c, [*steps, "--cache-dir", cc, "--out", str(c.out / "train_warm.json")], "train_warm.log", show=4)]


@part("dflash2")
def dflash2(c: Ctx) -> list:
    """Issue 20: the 27B-shape step, plain DFlash then DFlash 2, same shape."""
    return [_train_bench(c, [*([] if c.tiny else ["--steps", "8"]), "--arch", arch, "--cache-dir", str(c.tmp / f"cc-{arch}"),
                             "--out", str(c.out / f"train_{arch}.json")], f"train_{arch}.log", show=3)
            for arch in ("dflash", "dflash2")]


@part("sdpa")
def sdpa(c: Ctx) -> list:
    return [_train_bench(c, [*([] if c.tiny else ["--steps", "5"]), "--out", str(c.out / "train_sdpa.json")],
                         "train_sdpa.log", modes="sdpa", show=3)]


@part("whole")
def whole(c: Ctx) -> list:
    return [_train_bench(c, ["--compile", "whole", *([] if c.tiny else ["--steps", "5"]), "--cache-dir", str(c.tmp / "ccw"),
                             "--out", str(c.out / "train_whole.json")], "train_whole.log", show=3)]


@part("attention")
def attention(c: Ctx) -> list:
    return [_train_bench(c, ["--attention-only", "--cache-dir", str(c.tmp / "cc"), "--out", str(c.out / "attention.json")],
                         "attention.log")]


@part("profile")
def profile(c: Ctx) -> list:
    return [_train_bench(c, [*([] if c.tiny else ["--steps", "3"]), "--cache-dir", str(c.tmp / "cc"), "--profile"],
                         "profile.log", show=45)]


# train_e2e.py at the tiny size: configs/tiny.yaml's drafter on a small random store, CPU ranks over gloo
E2E_TINY = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--hidden", "128", "--vocab", "512", "--seq", "320",
            "--layer-ids", "1,3,5", "--set", "target.path=bench/no-such-target", "--set", "train.num_workers=0"]


def _e2e(c: Ctx, samples: str, steps: str, args: list, log: str, limit: str | None = None, **kw) -> Step:
    a = ["--root", str(c.tmp / "e2e"), "--samples", c.var("E2E_SAMPLES", samples, "8"), *args]
    return _bench(c, "train_e2e.py", a, E2E_TINY, log, timeout=float(c.var("E2E_LIMIT", limit, "900")) if limit else None,
                  **kw)


@part("e2e")
def e2e(c: Ctx) -> list:
    return [_e2e(c, "8", "5", ["--steps", "2" if c.tiny else "5", "--out", str(c.out / "train_e2e.json")], "train_e2e.log",
                 show=6)]


@part("ddp")
def ddp(c: Ctx) -> list:
    """One GPU (cold cache) against two DDP ranks over NCCL (twice: is the cache warm for DDP?); 2 GPUs."""
    gpus = ["0", "0,1"] if c.tiny else os.environ.get("DDP_GPUS", "0 0,1 0,1").split()
    return [_e2e(c, os.environ.get("DDP_SAMPLES", "64"), "", ["--steps", c.var("DDP_STEPS", "20", "2"), "--gpus", *gpus,
                 "--out", str(c.out / "train_e2e_ddp.json")], "train_e2e_ddp.log")]


@part("e2emfu")
def e2emfu(c: Ctx) -> list:
    """Issue 22 items 1+3, issue 31 (1 GPU, ~5 min): `dflash train` at the 27B shape, accumulation 4: a 1-step run
    on a cold compile cache, then 53 steps warm with checkpoints at steps 20 and 40 (the first pins its host
    buffers, the second reuses them); the warm first batch (goal < 15 s) and its start-up phases, each
    checkpoint's training stall (goal < 2 s), the final checkpoint and the steady end-to-end MFU over the last
    50 steps (goal >= 68%; within 1% of the bench step)."""
    return [_e2e(c, "64", "", ["--cold-steps", "1", "--steps", c.var("E2E_STEPS", "53", "5"), "--gpus", "0", "0",
                 "--checkpoint-every", c.var("E2E_CKPT_EVERY", "20", "2"),
                 "--out", str(c.out / "e2e_mfu.json")], "e2e_mfu.log", limit="420", show=12,
                 only=r"first batch done|start-up|fit set-up|compiles|checkpoint|Error|error|^run |^warm|^cold|MFU|recompil"
                      r"|frozen-head|end|exit")]


@part("e2eprof")
def e2eprof(c: Ctx) -> list:
    """Issue 31's missing profile (1 GPU, ~2 min after e2emfu in the same call, which leaves its store and a warm
    compile cache; alone it builds them): `dflash train` at the 27B shape with train.profile_steps over 10 steps
    past the warm-up, an epoch's first step among them (its loader refill: 0.3 s more than a step on 2026-12-01): wall ms per step, GPU busy/idle, kernel families, host ops (the e2e-vs-bench gap)."""
    window = c.var("E2EPROF_WINDOW", "28,38", "2,4")  # holds step 33, an epoch's first (64 samples: 16 steps an epoch)
    return [_e2e(c, "64", "", ["--reuse", "--steps", c.var("E2EPROF_STEPS", "40", "5"),
                 "--gpus", f"0@train.profile_steps=[{window}]", "--out", str(c.out / "e2e_profile.json")],
                 "e2e_profile.log", limit="300", show=40,
                 only=r"first batch done|profiled|^\||^GPU|^optimizer steps|Error|error|MFU")]


@part("ddpopts")
def ddpopts(c: Ctx) -> list:
    """Issue 22 item 2 (2 GPUs, right after e2emfu in the same call: its store, cache and 1-GPU rate): torch's DDP
    defaults, then gradient_as_bucket_view + 100 MB buckets; steps/s and scaling vs e2emfu's samples/s."""
    return [_e2e(c, "64", "", ["--reuse", "--reference", str(c.out / "e2e_mfu.json"),
                 "--steps", c.var("DDPOPT_STEPS", "30", "2"), "--gpus", "0,1",
                 "0,1@train.ddp_gradient_as_bucket_view=true@train.ddp_bucket_cap_mb=100", "--out", str(c.out / "ddpopts.json")],
                 "ddpopts.log", limit="290", show=12, only=r"first batch done|Error|error|^run |^warm|^cold|MFU")]


@part("startup")
def startup(c: Ctx) -> list:
    """The launch path's imports with and without cProfile, custom-op registration, sha256 rate."""
    return [_bench(c, "startup_bench.py", ["--out", str(c.out / "startup.json")], ["--sha-mb", "8"], "startup.log")]


@part("ckptwrite")
def ckptwrite(c: Ctx) -> list:
    """Issue 46 item 3 (host only, ~2 min at 8 GiB): a checkpoint write's rate on this disk and the GIL share it
    leaves the main thread, as shipped, through torch's path writer, without CRC32, and as raw bytes (the ceiling);
    then raw bytes from a child process, with O_DIRECT, and from a thread kept off the main thread's core: which of
    the GIL, the page-cache copy or a shared core costs the main loop while a write runs."""
    return [_bench(c, "ckpt_write_bench.py", ["--gib", c.var("CW_GIB", "8", "0.05"), "--dir", str(c.tmp / "ckpt-write"),
                   "--out", str(c.out / "ckpt_write.json")], [], "ckpt_write.log")]


def _extract(c: Ctx, arch: str, encodings: str, store: str, out: str, *extra: str, env: dict | None = None) -> Step:
    args = ["--arch", arch, "--tokens", c.var("EXTRACT_TOKENS", "120000", "400"), "--clevel", "1", "--encodings", encodings,
            *extra, "--store-dir", store, "--out", str(c.out / f"{out}.json")]
    return _bench(c, "extract_bench.py", args, ["--tiny", "--device", "cpu"], f"{out}.log", env=env or {}, show=16)


@part("extract")
def extract(c: Ctx) -> list:
    return [_extract(c, "qwen3", "bf16,fp8,int5,int4", str(c.tmp / "xb"), "extract")]


@part("extract2")
def extract2(c: Ctx) -> list:
    """Extraction scaling: one process alone on GPU 0, then one per GPU at the same time (2 GPUs)."""
    solo = _extract(c, "qwen3", "int5", str(c.tmp / "xs"), "extract_solo")
    pair = [_extract(c, "qwen3", "int5", str(c.tmp / f"xp{g}"), f"extract_gpu{g}", env={"CUDA_VISIBLE_DEVICES": str(g)})
            for g in (0, 1)]
    return [solo, pair]


@part("extract35")
def extract35(c: Ctx) -> list:
    """The real hybrid layout: kernels bound, first pass on a cold kernel cache, int5/fp8/bf16 vs the bare forward."""
    s = _extract(c, "qwen3_5", "int5,fp8,bf16", str(c.tmp / "xb"), "extract35", "--kernel-cache", str(c.tmp / "kc"))
    s.clean = [str(c.tmp / "kc"), str(c.tmp / "xb")]
    return [s]


@part("extractgil")
def extractgil(c: Ctx) -> list:
    """Issue 22 item 4: the writer thread as shipped against a null writer (the GIL switch interval variant was
    measured and left bench/: docs/benchmarks-log.md, 'Experiments that left bench/')."""
    return [_extract(c, "qwen3_5", "bf16", str(c.tmp / "xg"), "extract_gil", "--writers", "thread,null",
                     "--kernel-cache", str(c.tmp / "kc")),
            _bench(c, "gil_bench.py", ["--tokens", "64" if c.tiny else "4096", "--seconds", "0.5" if c.tiny else "4",
                                       "--out", str(c.out / "gil.json")], ["--hidden", "256"], "gil.log", show=4)]


@part("load35")
def load35(c: Ctx) -> list:
    """Peak host memory per worker of loading a real-width hybrid checkpoint (8 layers, ~11 GB): dflash vs old."""
    d = str(c.tmp / "ckpt35")
    return [_bench(c, "load_bench.py", ["--layers", c.var("LOAD_LAYERS", "8", "4"), "--dir", d, "--out", str(c.out / "load35.json")],
                   ["--tiny", "--device", "cpu"], "load35.log", show=6, copy=[], clean=[d])]


@part("store")
def store(c: Ctx) -> list:
    tiny = ["--samples", "4", "--seq", "256", "--hidden", "64", "--encodings", "bf16,int5", "--workers", "1",
            "--startup-samples", "200", "--loader-epochs", "1"]
    return [_bench(c, "store_bench.py", ["--root", str(c.tmp / "sb"), "--out", str(c.out / "store.json")], tiny, "store.log",
                   show=22)]


@part("regen")
def regen(c: Ctx) -> list:
    """dflash regenerate's batched generation vs a per-prompt generate loop, real 27B hybrid layout, one GPU."""
    args = ["--prompts", c.var("REGEN_PROMPTS", "64", "4"), "--loop-prompts", c.var("REGEN_LOOP", "4", "2"),
            "--new-tokens", c.var("REGEN_NEW", "256", "8"), "--out", str(c.out / "regen.json")]
    return [_bench(c, "regen_bench.py", args, ["--tiny", "--min-len", "8", "--max-len", "32"], "regen.log", show=9,
                   hide=r"^\[transformers\]")]


@part("long")
def long(c: Ctx) -> list:
    """Issues 19.6/28.1: the 27B drafter's step at 2K/8K/16K tokens (and 16K with 2048 anchors): step time, MFU and
    peak memory (LONG_ARGS replaces the GPU arguments)."""
    args = (["--tiny", "--device", "cpu", "--points", "256:16,1024:32", "--steps", "1"] if c.tiny
            else os.environ.get("LONG_ARGS", "--steps 5").split())
    return [_bench(c, "long_bench.py", [*args, "--out", str(c.out / "long.json")], [], "long.log", hide=r"Warning|warn\(")]


@part("longdiag")
def longdiag(c: Ctx) -> list:
    """Issue 28.1: the long points with Inductor's defaults in the 5 layers (no layer options); a hook on
    get_block_shape names a failing kernel; one JSON line per point, torch's Inductor sources beside it."""
    points = ["--tiny", "--device", "cpu", "--points", "256:16", "--steps", "1"] if c.tiny else \
        os.environ.get("LONGDIAG_ARGS", "--points 8192:512,16384:2048").split()
    return [_bench(c, "compile_diag.py", [*points, "--layer-options", "{}", "--out", str(c.out / "longdiag.jsonl"),
                                          "--sources", str(c.out / "inductor_src.txt")], [], "longdiag.log",
                   hide=r"Warning|warn\(", show=30)]


@part("fastfwd")
def fastfwd(c: Ctx) -> list:
    """Issue 30 (~6 min on one GPU): the 27B hybrid (layers 0..61, 8 x 2048): bare forward reference vs fast (goal
    >= 12,000 tok/s), kernel families before/after, extraction int5/fp8/bf16 vs the fast bare forward (goal >= 0.95);
    then FP8 GEMMs (issues 30 item 4 and 45: speed, tap layers vs bf16, extraction in FF_FP8_EXTRACT encodings
    against the FP8 bare forward); then the bf16 equality tests on a small-width
    hybrid (figures: fastfwd_equal.json; the cached test's in fastfwd_test.log; FF_TEST_FILES adds other GPU
    test files, FF_TEST_JOBS > 1 runs them side by side), which find most kernels tuned by the bench (their autotuning is the long part; the
    cached test tunes the delta rule with a state and the per-step decode kernels). Tiny: torch stand-ins of the kernels on the CPU."""
    kc = str(c.tmp / "kc")
    env = {"TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR", kc), "TRITON_CACHE_AUTOTUNING": "1"}
    tiny = ["--tiny", "--device", "cpu", "--ops", "torch", "--batch", "1", "--seq", "32", "--reps", "1", "--batches",
            "1", "--encodings", "int5", "--warmup-batches", "1"]
    opts = ["--profile-batches", c.var("FF_PROFILE", "3", "1"), "--writers", c.var("FF_WRITERS", "thread", "thread,null"),
            *([] if c.var("FF_FP8", "1", "1") == "1" else ["--no-fp8-gemm"]),
            *([] if c.var("FF_REF", "1", "1") == "1" else ["--no-reference"]),
            "--fp8-scaling", c.var("FF_FP8_SCALING", "block", "block"),
            "--fp8-extract", c.var("FF_FP8_EXTRACT", "int5", "int5"),
            *([] if c.tiny else ["--batches", c.var("FF_BATCHES", "8", "1"),
                                 "--encodings", c.var("FF_ENCODINGS", "int5,fp8,bf16", "int5")])]
    bench = _bench(c, "fastfwd_bench.py", ["--store-dir", str(c.tmp / "ffs"), "--out", str(c.out / "fastfwd.json"),
                                           *opts], tiny, "fastfwd.log", env=env,
                   timeout=float(c.var("FF_LIMIT", "400", "900")), show=110,
                   hide=r"^\[transformers\]|USDT|falling back|_warn_once|Profiler clears")
    files = c.var("FF_TEST_FILES", "tests/test_fast_forward.py", "tests/test_fast_forward.py").split()
    if not files:  # FF_TEST_FILES="": the bench alone (the GPU tests run in their own call: part gputests)
        return [bench]
    side = c.var("FF_TEST_JOBS", "1", "1")  # >1: pytest-xdist (from .whl on the GPU machine), one file a worker
    test = Step([PY, "-m", "pytest", "-v", "-m", "gpu", *files, "-p", "no:cacheprovider", "--tb=short", "-s",
                 *(["-n", side, "--dist", "loadfile"] if side != "1" else []),
                 *(["--collect-only"] if c.tiny else [])], "fastfwd_test.log",
                env={**env, "DFLASH_FASTFWD_REPORT": str(c.out / "fastfwd_equal.json")},
                timeout=float(c.var("FF_TEST_LIMIT", "300", "600")), show=40,
                only=r"passed|failed|skipped|PASSED|FAILED|ERROR|Error")
    return [bench, test]


@part("concurrent")
def concurrent(c: Ctx) -> list:
    """Issue 17: extraction on GPU 0 and training on GPU 1, alone, then both at once from one growing store."""
    return [_bench(c, "concurrent_bench.py", ["--root", str(c.tmp / "cb"), "--out", str(c.out / "concurrent.json")],
                   ["--tiny"], "concurrent.log", timeout=float(c.var("CONC_LIMIT", "420", "900")), show=14,
                   hide=r"Warning|warn\(", clean=[])]


@part("node8")
def node8(c: Ctx) -> list:
    """Issue 34 on nvidia-h200-x8: `dflash run` 0-4 + 5-7, then extract alone on 0-4 and train alone on 5-7 and 5.
    NODE_PHASES picks phases (prepare, run, extract, train); one call per phase fits the 10-minute limit, and the
    27B checkpoint under out/node8 is kept for the next call on the same warm machine."""
    root = str(c.tmp / "nb") if c.tiny else os.environ.get("NODE_ROOT", str(ROOT / "out" / "node8"))
    args = ["--root", root, "--phases", c.var("NODE_PHASES", "prepare,run,extract,train", "prepare,run,extract,train"),
            "--out", str(c.out / "node8.json")]
    return [_bench(c, "node_bench.py", args, ["--tiny"], "node8.log", timeout=float(c.var("NODE_LIMIT", "590", "600")),
                   show=12, hide=r"Warning|warn\(")]


def _study(c: Ctx, script: str, name: str, args: list, tiny: list, limit: str, env: dict | None = None) -> Step:
    """A seeded study writing rows to TMP/NAME/results.jsonl, copied to OUT as they come (a cut-short call keeps them)."""
    d = c.tmp / name
    return _bench(c, script, ["--out", str(d), *args], tiny, f"{name}.log", env=env or {}, timeout=float(limit), show=20,
                  copy=[(d / "results.jsonl", c.out / f"{name}_results.jsonl")])


# the tiny studies' reference store holds 48 conversations (--set overrides training only: it used to extract all
# 3,236, ~45 s of a smoke run's CPU for each of tau, tau-start and archtau), in one shard (one worker process, ~5 s
# of CPU, fewer than the config's two)
TINY_EXTRACT = ["--extract-set", "extract.shards=1"]
TAU_TINY = ["--set", "train.max_steps=2", "--set", "data.max_samples=48", "--set", "eval.num_prompts=2",
            "--extract-set", "data.max_samples=48", *TINY_EXTRACT]


@part("archtau")
def archtau(c: Ctx) -> list:
    """Issue 20's paired dflash/dflash2 study on the host's CPUs: ARCH_SEEDS pairs, ARCH_EPOCHS epochs."""
    return [_study(c, "arch_tau.py", "archtau", ["--seeds", c.var("ARCH_SEEDS", "0..7", "0"),
                   "--set", f"train.epochs={c.var('ARCH_EPOCHS', '1', '1')}", "--jobs", c.var("ARCH_JOBS", "16", "1"),
                   "--threads", "1", "--cpu"], TAU_TINY, c.var("ARCH_LIMIT", "560", "900"))]


def _tau_args(c: Ctx) -> list:
    return ["--encodings", c.var("TAU_ENCODINGS", "bf16,int5", "bf16"), "--seeds", c.var("TAU_SEEDS", "0..19", "0"),
            "--jobs", c.var("TAU_JOBS", "10", "1"), "--threads", "1",
            *(["--cpu"] if c.tiny or os.environ.get("TAU_CPU") else [])]


@part("tau")
def tau(c: Ctx) -> list:
    """Issue 7's paired tau study on the GPU: tiny drafters side by side; rows reach OUT as they finish."""
    s = _study(c, "encoding_tau.py", "tau", _tau_args(c), TAU_TINY, c.var("TAU_LIMIT", "520", "900"),
               env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    s.copy.append((c.tmp / "tau" / "logs", c.out / "tau_logs"))
    return [s]


@part("tau-start")
def tau_start(c: Ctx) -> list:
    """The tau study detached and niced, from a copy of the tree (a later call re-sends the repo while it runs):
    its own session outlives this call while the machine stays warm; collect it with tau-collect."""
    repo = c.tmp / "taurepo"

    def copy_tree() -> None:
        shutil.rmtree(repo, ignore_errors=True)
        for d in ("pipeline", "stages", "data", "bench", "configs", "scripts", ".site"):
            if (ROOT / d).is_dir():
                shutil.copytree(ROOT / d, repo / d)
    s = _study(c, "encoding_tau.py", "tau", _tau_args(c), TAU_TINY, "0",
               env={"TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONPATH": f"{repo / '.site'}{os.pathsep}{repo}"})
    s.argv = ["nice", "-n", "19", *s.argv]
    s.cwd, s.detach, s.timeout, s.log = repo, True, None, str(c.tmp / "tau.log")
    return [copy_tree, s]


@part("tau-collect")
def tau_collect(c: Ctx) -> list:
    """Wait for the detached study (at most TAU_WAIT s), then copy what it finished."""
    from bench.parts_run import copy_path, wait_detached

    def collect() -> None:
        wait_detached(c.tmp / "tau.log", float(c.var("TAU_WAIT", "300", "900")))
        for src, dst in ((c.tmp / "tau" / "results.jsonl", c.out / "tau_results.jsonl"), (c.tmp / "tau.log", c.out / "tau.log"),
                         (c.tmp / "tau" / "logs", c.out / "tau_logs")):
            copy_path(src, dst)
        print("".join(Path(c.out / "tau.log").read_text().splitlines(True)[-20:]) if (c.out / "tau.log").exists() else "no tau.log")
    return [collect]


@part("packtau")
def packtau(c: Ctx) -> list:
    """Issue 28 item 3: packed vs plain tau pairs (bench/pack_tau.py) on the host's CPUs: PT_SEEDS pairs, PT_JOBS
    runs at once, PT_EPOCHS epochs (PT_EXTRACT_SET: an extraction override, e.g. data.max_samples=2000)."""
    extract_set = c.var("PT_EXTRACT_SET", "", "data.max_samples=120")
    return [_study(c, "pack_tau.py", "packtau", ["--seeds", c.var("PT_SEEDS", "0..7", "0"),
                   "--set", f"train.epochs={c.var('PT_EPOCHS', '1', '1')}", "--jobs", c.var("PT_JOBS", "16", "2"),
                   "--threads", "1", "--cpu", *(["--extract-set", extract_set] if extract_set else [])],
                   ["--set", "train.max_steps=2", "--set", "eval.num_prompts=2", *TINY_EXTRACT], c.var("PT_LIMIT", "560", "1800"))]


PM_TINY = ["--config", "configs/tiny.yaml", "--hidden", "128", "--vocab", "512", "--layer-ids", "1,3,5", "--encoding",
           "bf16", "--set", "drafter.max_position_embeddings=8192", "--set", "target.path=/nonexistent", "--set",
           "train.batch_size=1"]


@part("packmfu")
def packmfu(c: Ctx) -> list:
    """Issue 28 item 4 (1 GPU, ~8 min for chat, ~9 for long: one device call each): 27B-shape stores of a length mix (chat: mean ~1K, max_length 3072;
    long: mean ~4.5K, max 8K), `dflash train` PM_STEPS steps without then with packing (pack_tokens =
    max_length), accumulation 1: samples/s, tokens/s and MFU of useful FLOPs only (goal >= 62% on both mixes)."""
    steps = []
    for mix in c.var("PM_MIXES", "chat long", "chat").split():
        n = c.var("PM_STEPS", "55", "6")
        args = ["--root", str(c.tmp / f"pm-{mix}"), "--mix", mix, "--samples", c.var("PM_SAMPLES", "96", "10"),
                "--steps", n, "--cold-steps", n, "--set", f"data.max_length={8192 if mix == 'long' else 3072}",
                "--set", "train.accumulate_grad_batches=1", *os.environ.get("PM_ARGS", "").split(),
                "--gpus", "0", "0@train.packing=true", "--out", str(c.out / f"packmfu_{mix}.json")]
        steps.append(_bench(c, "train_e2e.py", args, PM_TINY, f"packmfu_{mix}.log",
                            timeout=float(c.var("PM_LIMIT", "470" if mix == "chat" else "560", "1800")), show=14,
                            only=r"first batch done|Error|error|^run |^warm|^cold|MFU|mix|recompil", clean=[str(c.tmp / f"pm-{mix}")]))
    return steps


@part("followtau")
def followtau(c: Ctx) -> list:
    """Issue 17's tau check on the host's CPUs: FT_SEEDS seeds side by side, each its own bench/follow_tau.py (own
    stores; FT_THREADS threads each, 2, or 1 at the tiny size beside the suite's other work), extraction slowed
    by FT_DELAY s a batch so training really follows."""
    runs = [_bench(c, "follow_tau.py", ["--out", str(c.tmp / "ft" / f"s{s}"), "--seeds", str(s), "--delay", c.var("FT_DELAY", "3", "0"),
                   "--extract-set", f"data.max_samples={c.var('FT_SAMPLES', '800', '48')}"],
                   ["--set", "train.max_steps=2", "--set", "eval.num_prompts=2", *TINY_EXTRACT], f"followtau-s{s}.log",
                   env={"OMP_NUM_THREADS": c.var("FT_THREADS", "2", "1")}, timeout=float(c.var("FT_LIMIT", "520", "900")), show=0)
            for s in range(int(c.var("FT_SEEDS", "8", "1")))]

    def summary() -> None:
        import json

        from bench.follow_tau import summarize
        rows = [json.loads(x) for f in sorted((c.tmp / "ft").glob("s*/results.jsonl")) for x in f.read_text().splitlines()]
        (c.out / "follow_tau.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{len(rows)} seeds finished")
        summarize(rows)
    return [runs, summary]


@part("handover")
def handover(c: Ctx) -> list:
    """Issue 41: `dflash run`'s handover on one device (1 GPU, ~5 min at the 27B drafter shape, HB_E2E=0: the tiny
    drafter, ~90 s): a training on GPU 0 asked to hand over after its warm-up, then its resume there: the
    checkpoint at the step, the stop, the warm relaunch to the first step (goal under 60 s in all)."""
    e2e = c.var("HB_E2E", "1", "0") == "1"
    sets = [] if e2e else ["--set", f"data.max_samples={c.var('HB_SAMPLES', '240', '48')}", "--set",
                           "train.num_workers=0", "--set", f"train.batch_size={c.var('HB_BATCH', '8', '4')}"]
    return [_bench(c, "handover_bench.py", ["--root", str(c.tmp / "hb"), "--after", c.var("HB_AFTER", "5", "1"),
                                            *(["--e2e", "--limit", "300"] if e2e else []), *sets,
                                            "--out", str(c.out / "handover.json")], [], "handover.log",
                   clean=[str(c.tmp / "hb")], timeout=float(c.var("HB_LIMIT", "560", "900")), show=6,
                   only=r"^handover|^run: expanded|Error|error|start-up")]


@part("tinyrate")
def tinyrate(c: Ctx) -> list:
    """The tiny drafter's GPU step rate without a profiler (num_workers=0, as the tau study trains)."""
    return _tiny_train(c, "tr", [], r"first batch|step [0-9]+/|Error", "400")


@part("tinyprof")
def tinyprof(c: Ctx) -> list:
    """Where a tiny drafter's GPU step goes (3.9 steps/s on the H200 vs 7.7 on the 2-core CPU)."""
    prof = str(c.out / "tiny_train.prof")
    steps = _tiny_train(c, "tp", ["-m", "cProfile", "-o", prof], r"first batch|step (50|100|150|200)/|Error|error", "200")
    stats = ("import pstats; s=pstats.Stats(%r); s.sort_stats('tottime').print_stats(30); "
             "s.sort_stats('cumulative').print_stats(60)" % prof)
    return [*steps, Step([PY, "-c", stats], "tiny_train_prof.txt", show=60)]


def _tiny_train(c: Ctx, d: str, wrap: list, only: str, steps: str) -> list:
    store, run = str(c.tmp / d / "bf16.zarr"), str(c.tmp / d / "run")
    sets = ["store.encoding=bf16", *(["data.max_samples=48", "extract.shards=1"] if c.tiny else [])]
    train = ["train.batch_size=8", f"train.max_steps={c.var('TINY_STEPS', steps, '3')}", "train.num_workers=0",
             f"train.run_dir={run}", "train.val_every=100000", "train.log_every=50"]
    x = [PY, "-m", "stages.cli", "extract", "--store", store, *(a for s in sets for a in ("--set", s))]
    t = [PY, *wrap, "-m", "stages.cli", "train", "--store", store,
         "--no-export", *(a for s in train for a in ("--set", s))]
    return [Step(x, f"{d}-extract.log", show=0, clean=[str(c.tmp / d)]), Step(t, f"{d}-train.log", show=12, only=only)]


def main(argv: list[str]) -> int:
    from bench.parts_run import run_part

    if argv[:1] == ["list"]:
        print("\n".join(PARTS))
        return 0
    if argv[:1] != ["run"] or len(argv) < 2:
        print(__doc__.strip().splitlines()[-6:][0], file=sys.stderr)
        return 2
    tiny = "--tiny" in argv
    out = Path(os.environ.get("OUT", "/tmp/out"))
    rc = 0
    for name in [a for a in argv[1:] if a != "--tiny"]:
        if name not in PARTS:
            print(f"unknown part {name}; the parts: {' '.join(PARTS)}")
            rc = 2
            continue
        rc = max(rc, run_part(name, PARTS[name](Ctx(out, tiny)), out))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
