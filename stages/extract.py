"""`dflash extract`: validate the data, create (or check) the store, run one worker process per shard.

Contract:
- Everything that can fail cheaply fails before any worker starts: config, data rows (ingest), tokenizer,
  target metadata, an existing store made by a different run (named differences).
- One run per shard: the parent takes the lock of every shard it runs (pipeline/store_lock.py) before
  starting any worker, so a second `dflash extract` on the same shards is refused at once, naming the
  holder's host and pid; each worker writes under its parent's lock (the lock is live while either runs).
  A lock left by a killed run is taken over by the next one, no cleanup needed.
- Shard i runs on GPU gpus[i] (default: GPU i) with only that GPU visible; with no GPU, workers run on the
  CPU sharing the cores. `--shard-index SET` (`3`, `0-4`, `0,2,4`, `0-2,5`; `parse_shard_set`) runs only
  those shards of `--shards`: one call per node (or per scheduler task) with the same `--shards`, the node's
  shards on its own GPUs (the j-th shard of the set on the j-th GPU, or on `--gpus`' j-th entry).
- The parent prints live progress (per shard and total samples, tokens, tokens/s, ETA): a redrawn line on a
  terminal, plain periodic lines otherwise. Workers' stderr goes to STORE/logs/extract-shard-NNNNN.log.
- The workers run under `pipeline.lifecycle.Supervisor`. A failing worker stops the others (SIGTERM, then
  SIGKILL), and the command exits 1 naming the shard, its error and how to resume. Ctrl-C/SIGTERM stops all
  workers after their current commit (exit 130); a second Ctrl-C kills them at once. Rerunning the same
  command resumes from every shard's last commit.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from pipeline import provenance as prov
from pipeline import store as st
from pipeline.config import Config
from pipeline.encoding import raw_bytes_per_token
from pipeline.errors import UserError
from pipeline.lifecycle import ExitCode, Supervisor, failure_reason, fmt_eta, fmt_rate, place_shards
from pipeline.target import load_tokenizer


class ExtractError(UserError, RuntimeError):
    pass


def build_provenance(cfg: Config, tokenizer, samples, num_shards: int, command: str) -> dict:
    """This run's root record (pipeline.provenance builds it) with ingest's fingerprint of `samples` and the
    target precision extract.target_precision resolves to (pipeline/fp8_block.py; its line when it says one)."""
    from data.ingest import dataset_fingerprint
    from pipeline.fp8_block import resolve
    from pipeline.fp8_weights import quantization
    from pipeline.target import local_target_dir

    precision, line = resolve(cfg.extract.target_precision, quantization(local_target_dir(cfg.target.path)),
                              cfg.target.path)
    if line:
        print(f"extract: {line}", file=sys.stderr, flush=True)
    return prov.build_provenance(cfg, tokenizer, samples, num_shards, command, dataset_fingerprint(samples),
                                 precision=precision)


def _log_dir(store: str) -> Path:
    d = Path(store) / "logs" if st.is_local(store) else Path("dflash-logs")
    d.mkdir(parents=True, exist_ok=True)
    return d


class Monitor:
    """Collects workers' JSON progress lines and prints a summary."""

    def __init__(self, shards: list[int], out=sys.stderr):
        self.state: dict[int, dict] = {i: {} for i in shards}
        self.first: dict[int, tuple[float, int]] = {}
        self.errors: dict[int, str] = {}
        self.out, self.tty = out, out.isatty()
        self.lock = threading.Lock()
        self.last_print = 0.0

    def feed(self, shard: int, line: str) -> None:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            return
        with self.lock:
            if msg.get("event") == "progress":
                self.state[shard] = msg
                self.first.setdefault(shard, (time.time(), msg["tokens"]))
            elif msg.get("event") == "error":
                self.errors[shard] = msg.get("error", "unknown error")

    def shard_rates(self) -> dict[int, dict]:
        """Per shard: tokens/s since this call first heard from it, and the ETA of its planned tokens."""
        out = {}
        with self.lock:
            for i, s in self.state.items():
                t0, k0 = self.first.get(i, (time.time(), 0))
                dt, left = time.time() - t0, s.get("planned_tokens", 0) - s.get("tokens", 0)
                rate = (s.get("tokens", 0) - k0) / dt if dt > 1 else 0.0
                out[i] = {"rate_tok_s": rate, "eta_s": left / rate if rate > 0 else None}
        return out

    def line(self) -> str:
        with self.lock:
            tok = sum(s.get("tokens", 0) for s in self.state.values())
            ptok = sum(s.get("planned_tokens", 0) for s in self.state.values())
            smp = sum(s.get("samples", 0) for s in self.state.values())
            psmp = sum(s.get("planned_samples", 0) for s in self.state.values())
            rate = 0.0
            for i, (t0, k0) in self.first.items():
                dt = time.time() - t0
                if dt > 1:
                    rate += (self.state[i].get("tokens", 0) - k0) / dt
            eta = (ptok - tok) / rate if rate > 0 else None
            per = " ".join(
                f"[{i}] {100 * s.get('tokens', 0) / max(1, s.get('planned_tokens', 1)):.0f}%" for i, s in self.state.items()
            )
        return f"extract: {smp}/{psmp} samples, {tok}/{ptok} tokens, {fmt_rate(rate)} tok/s, ETA {fmt_eta(eta)}  {per}"

    def maybe_print(self, force: bool = False, status_file: Optional[Path] = None, state: str = "running",
                    error: str = "") -> None:
        now = time.time()
        if force or now - self.last_print >= (1.0 if self.tty else 15.0):
            self.last_print = now
            end = "\r" if self.tty and not force else "\n"
            line = self.line()
            print(line.ljust(100 if self.tty else 0), end=end, file=self.out, flush=True)
            if status_file is not None:  # read by `dflash status` from another shell
                tmp = status_file.with_suffix(".tmp")
                rates = self.shard_rates()
                tmp.write_text(json.dumps({"state": state, "line": line, "pid": os.getpid(), "time": now,
                                           "host": socket.gethostname(), "error": error,
                                           "shards": {str(k): {**v, **rates[k]} for k, v in self.state.items()}}))
                tmp.replace(status_file)


def parse_shard_set(value, num_shards: int) -> Optional[list[int]]:
    """--shard-index as the sorted shards it names: an int, or text such as `3`, `0-4`, `0,2,4`, `0-2,5`. Each
    shard once, each in 0..num_shards-1, else an ExtractError naming the value and the fix."""
    if value is None or isinstance(value, int):
        out = None if value is None else [value]
    else:
        out, text = [], str(value).replace(" ", "")
        for part in text.split(","):
            lo, dash, hi = part.partition("-")
            if not (lo.isdigit() and (not dash or hi.isdigit())):
                raise ExtractError(f"--shard-index {value!r}: expected shard indices such as 3, 0-4, 0,2,4 or 0-2,5")
            a, b = int(lo), int(hi) if dash else int(lo)
            if b < a:
                raise ExtractError(f"--shard-index {value!r}: the range {part} runs backwards; write {b}-{a}")
            out += range(a, b + 1)
        if len(set(out)) < len(out):
            raise ExtractError(f"--shard-index {value!r} names a shard twice: each shard runs on one node only")
    if out is not None:
        bad = [i for i in out if not 0 <= i < num_shards]
        if bad:
            raise ExtractError(f"--shard-index {value}: shard(s) {bad} out of range for --shards {num_shards} "
                               f"(0..{num_shards - 1}); every node passes the same --shards")
        out = sorted(out)
    return out


def shard_gpus(gpus: Optional[list[int]], num_shards: int, shard_index, n_gpu: int) -> dict[int, int]:
    """Which GPU each shard to run gets (`pipeline.lifecycle.place_shards`: --gpus, --shards and the shard
    set of --shard-index), a misfit as an ExtractError naming the fix."""
    shard_set = parse_shard_set(shard_index, num_shards) if n_gpu else None
    return place_shards(gpus, num_shards, n_gpu, shard_set, error=ExtractError)


def run_extract(cfg: Config, *, shards: Optional[int] = None, gpus: Optional[list[int]] = None,
                shard_index=None, store: Optional[str] = None, command: str = "dflash extract") -> int:
    """`shard_index`: None (every shard), one index, or a set as `--shard-index` gives it (`parse_shard_set`)."""
    from data.ingest import ingest

    store_path = store or cfg.store.path
    num_shards = cfg.extract.shards if shards is None else shards
    if num_shards < 1:
        raise ExtractError(f"--shards {num_shards}: the number of shards must be at least 1")
    shard_set = parse_shard_set(shard_index, num_shards)
    from pipeline.store_lock import acquire_all, refuse_if_held

    refuse_if_held(store_path, shard_set if shard_set is not None else list(range(num_shards)))  # before ingest
    tokenizer = load_tokenizer(cfg.target.path, cfg.target.trust_remote_code)
    samples, report = ingest(cfg.data, tokenizer)  # raises on bad rows before any worker starts
    print(report.summary(), file=sys.stderr)
    provenance = build_provenance(cfg, tokenizer, samples, num_shards, command)
    prov.create_or_open_store(store_path, provenance)
    todo = shard_set if shard_set is not None else list(range(num_shards))
    if all(s.done for s in _shard_states(store_path) if s.index in todo):
        if st.exists(st.frozen_head_path(store_path)):
            print(f"extract: nothing to do, the store at {store_path} is already complete for shard(s) {todo}", file=sys.stderr)
            return ExitCode.OK
        todo = todo[:1]  # a finished shard's worker writes the missing frozen head and stops
    locks = {lk.index: lk for lk in acquire_all(store_path, todo, command)}  # refused at once if another run holds one
    # a failing worker stops the others; Ctrl-C/SIGTERM: SIGTERM to every worker (it commits, exits 143), again: SIGKILL
    workers = Supervisor(signals="terminate", quiet=(ExitCode.OK, ExitCode.WORKER_STOPPED))
    try:
        return _run_workers(cfg, num_shards, gpus, shard_set, store_path, command,
                            provenance, samples, todo, locks, workers)
    finally:
        workers.stop_all()  # (all have exited unless this process failed) no worker outlives its lock
        for lk in locks.values():
            lk.release()


def _run_workers(cfg: Config, num_shards: int,
                 gpus: Optional[list[int]], shard_index: Optional[list[int]], store_path: str, command: str,
                 provenance: dict, samples, todo: list[int], locks: dict, workers: Supervisor) -> int:
    import torch

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # shard -> GPU index as this process sees it (`shard_index`: the set parse_shard_set made of --shard-index)
    gpu_of = place_shards(gpus, num_shards, n_gpu, shard_index, error=ExtractError)
    if n_gpu:
        from pipeline.preflight import check_gpus_free, target_gib

        placed = [gpu_of[i] for i in todo]
        if len(set(placed)) < len(placed):
            print(f"extract: {len(placed)} shards on {len(set(placed))} GPU(s) {sorted(set(placed))}; "
                  "--gpus or --shards changes that", file=sys.stderr)
        check_gpus_free(placed, need_gib=target_gib(cfg.target.path) + 8)
    _disk_check(store_path, provenance, samples, num_shards, todo)
    from pipeline.kernels import kernel_report

    kernels = kernel_report(provenance["target"].get("layer_types"), "cuda" if n_gpu else "cpu",
                            cfg.extract.fast_forward)
    if kernels:
        print(f"extract: {kernels}", file=sys.stderr)
    resume_hint = f"resume with the same command: {command}"
    logs = _log_dir(store_path)
    from pipeline.lifecycle import Tee

    if not isinstance(sys.stderr, Tee):  # the parent's own lines go to STORE/logs/extract.log too
        sys.stderr = Tee(sys.stderr, logs / "extract.log")
    from pipeline.preflight import cpu_threads

    threads = cpu_threads(len(todo))  # on the CPU: each worker's share (OMP_NUM_THREADS when set)
    # the workers' one config and their samples, resolved and tokenised here once (not once more per worker)
    from data.ingest import save_shard_samples
    from pipeline.config import write_config

    resolved = write_config(cfg, logs / "extract-config.yaml")
    for i in todo:
        save_shard_samples(samples, num_shards, i, logs / f"extract-samples-{i:05d}.npz")
    monitor = Monitor(todo)
    # one status file per call: a node's shard set writes its own (its first shard names it), so that nodes
    # sharing the store do not overwrite each other's; `dflash status` merges them
    status_file = logs / ("extract-status.json" if todo == list(range(num_shards))
                          else f"extract-status-from-{todo[0]:05d}.json")
    for i in todo:
        env = dict(os.environ)
        if n_gpu:
            from pipeline.preflight import physical_gpu

            env["CUDA_VISIBLE_DEVICES"] = physical_gpu(gpu_of[i])  # through the scheduler's CUDA_VISIBLE_DEVICES
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [sys.executable, "-m", "stages.extract_worker", "--config", str(resolved), "--samples",
               str(logs / f"extract-samples-{i:05d}.npz"), "--shard-index", str(i), "--shards", str(num_shards),
               "--store", store_path, "--threads", str(0 if n_gpu else threads), "--lock-token", locks[i].token]
        p = workers.spawn(i, cmd, log=logs / f"extract-shard-{i:05d}.log", env=env,
                          on_line=lambda line, i=i: monitor.feed(i, line))
        locks[i].add_pid(p.pid)  # the lock stays live while the worker runs, even if this process dies

    end = workers.watch(tick=lambda: monitor.maybe_print(status_file=status_file))
    codes = end.codes
    final = "finished" if all(c == 0 for c in codes.values()) else ("stopped" if end.stops else "failed")
    err = "; ".join(f"shard {i}: {e}" for i, e in monitor.errors.items())
    monitor.maybe_print(force=True, status_file=status_file, state=final, error=err)
    if end.failed is not None:
        failed, log = end.failed, logs / f"extract-shard-{end.failed:05d}.log"
        print(f"extract: shard {failed} failed: {failure_reason(codes[failed], log, monitor.errors.get(failed))}\n"
              f"  log: {log}\n  committed work is kept; fix the cause and {resume_hint}", file=sys.stderr)
        return ExitCode.FAILED
    if end.exit_code == ExitCode.STOPPED:
        print(f"extract: stopped; committed work is kept; {resume_hint}", file=sys.stderr)
        return ExitCode.STOPPED
    nonfinite = sum(s.get("nonfinite", 0) for s in monitor.state.values())
    if nonfinite:
        print(f"extract: {nonfinite} sample(s) had NaN/Inf features and were not written", file=sys.stderr)
    left = [s.index for s in _shard_states(store_path) if not s.done]
    where = "complete" if not left else f"waiting for shard(s) {left}"
    print(f"extract: finished shard(s) {todo}; store {store_path} is {where}", file=sys.stderr)
    return ExitCode.OK


def _disk_check(store_path: str, record: dict, samples, num_shards: int, todo: list[int]) -> None:
    from pipeline.preflight import disk_warning

    done = {s.index: s.progress.committed_tokens for s in _shard_states(store_path) if s.progress is not None}
    mine = sum(len(s.input_ids) for i in todo for s in st.shard_rows(samples, i, num_shards))
    left = max(0, mine - sum(done.get(i, 0) for i in todo))
    raw = raw_bytes_per_token(record["encoding"], len(record["layer_ids"]), record["hidden_size"])
    per_tok = raw * (0.8 if record["encoding"] == "bf16" else 1.0)  # lossless coding gains ~1.25x on bf16 only
    warning = disk_warning(store_path, left * per_tok)
    if warning:
        print(warning, file=sys.stderr)


def _shard_states(store_path: str) -> list:
    """Every shard's checked commit record; one that fails its checksum counts as not done here (no progress):
    its own worker stops on it, naming it, and another node's damaged shard does not stop this node's run."""
    return st.read_all_progress(store_path, report=True)


