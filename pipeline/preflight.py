"""Checks before any heavy work: the named GPUs are free, the store has room, the compile cache is ours.

Contract:
- `check_gpus_free(gpus, need_gib)` reads `nvidia-smi` (no CUDA context is created in the caller) and raises
  `PreflightError` naming each GPU that does not exist or whose free memory is below what the job needs,
  with the processes holding it. Without nvidia-smi (CPU machines) it checks nothing.
  `target_gib(path)`: the GiB of a local target's weight files, what each worker loading it needs.
- `disk_warning(path, bytes_needed)` returns a warning line when the filesystem of a local store has less
  free space than the estimate, else None.
- `disk_full_error(exc)` is the ENOSPC/EDQUOT OSError anywhere in an exception's chain (Lightning wraps and
  re-raises), else None; `disk_full_message(err, path, resume)` is the one line `DiskFull` carries: the file
  refused, its disk (mount point, free space) and the command that resumes once space is freed.
- `check_target_path(path, key)` refuses a local target path that is missing, not a directory, unreadable or
  without a JSON config.json, as one line naming the path and the config key (extract and regenerate: before any
  transformers traceback).
- `usable_cores()` is the number of cores this process may run on (its CPU affinity, which a scheduler's
  cgroup sets), not the machine's count. `cpu_threads(processes, reserve)` is the torch threads each of
  `processes` CPU processes side by side gets: OMP_NUM_THREADS when it is set (the caller runs several jobs on
  the same cores), else the usable cores, less `reserve`, shared out; at least 1.
- `compile_cache_dir(root, key_parts)` is a directory keyed by what produced the artifacts (torch version,
  dflash version, the model configuration); different code never shares a cache, so nobody deletes one
  by hand. `rebuild=True` empties it first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Optional

from pipeline.errors import UserError


class PreflightError(UserError, RuntimeError):
    pass


def _smi(query: str, kind: str = "--query-gpu") -> Optional[list[list[str]]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"{kind}={query}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def parse_gpu_usage(gpus_csv: list[list[str]], apps_csv: list[list[str]]) -> dict[int, dict]:
    """index -> {free_gib, total_gib, holders: ["pid name (MiB)"]} from nvidia-smi CSV rows."""
    info = {}
    for idx, uuid, used, total in gpus_csv:
        info[int(idx)] = {"uuid": uuid, "free_gib": (float(total) - float(used)) / 1024, "total_gib": float(total) / 1024,
                          "holders": []}
    by_uuid = {v["uuid"]: k for k, v in info.items()}
    for uuid, pid, name, mem in apps_csv:
        if uuid in by_uuid:
            info[by_uuid[uuid]]["holders"].append(f"pid {pid} {name} ({mem} MiB)")
    return info


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cpu_threads(processes: int = 1, reserve: int = 0) -> int:
    """See the module contract. OpenMP threads that outnumber the cores spin against each other: two tiny
    trainings of two threads each side by side on 2 cores took 3x the CPU time of one alone, one thread each
    took the same as alone (docs/benchmarks-log.md, "Test suite: one OpenMP thread a process")."""
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, usable_cores() // max(1, processes) - reserve)


def physical_gpu(g: int) -> str:
    """A GPU index as this process sees it (torch, --gpus) -> the device a child's CUDA_VISIBLE_DEVICES names.

    Under a scheduler that set CUDA_VISIBLE_DEVICES=5,6 index 0 is physical GPU 5 (or a UUID); a child given
    a bare "0" would land on GPU 0, which belongs to someone else."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else []
    if not ids:
        return str(g)
    if g >= len(ids):
        raise PreflightError(f"GPU {g} is not visible: CUDA_VISIBLE_DEVICES={visible} shows {len(ids)} GPU(s), "
                             f"indices 0..{len(ids) - 1}")
    return ids[g]


def target_gib(path: str) -> float:
    """GiB of a local checkpoint's safetensors files (0 for a hub id): what a worker loading it needs on its GPU."""
    d = Path(path)
    return sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**30 if d.is_dir() else 0.0


def check_gpus_free(gpus: list[int], need_gib: float) -> None:
    """gpus: indices as this process sees them (mapped through CUDA_VISIBLE_DEVICES to nvidia-smi's); a GPU
    named k times (k workers share it) must have k x need_gib free."""
    rows = _smi("index,uuid,memory.used,memory.total")
    if rows is None:
        return
    apps = _smi("gpu_uuid,pid,process_name,used_memory", "--query-compute-apps") or []
    info = parse_gpu_usage(rows, apps)
    problems = []
    for g, k in Counter(gpus).items():
        g = physical_gpu(g)
        if not g.isdigit():
            continue  # named by UUID: nvidia-smi's index table cannot check it
        g = int(g)
        if g not in info:
            problems.append(f"GPU {g} does not exist (this machine has {sorted(info)})")
        elif info[g]["free_gib"] < need_gib * k:
            held = ", ".join(info[g]["holders"]) or "unknown processes"
            problems.append(f"GPU {g} has {info[g]['free_gib']:.1f} GiB free of {info[g]['total_gib']:.0f}, the job needs "
                            f"~{need_gib * k:.0f} GiB" + (f" ({k} workers x {need_gib:.0f})" if k > 1 else "")
                            + f"; held by {held}")
    if problems:
        raise PreflightError("GPUs not available:\n  " + "\n  ".join(problems)
                             + "\nStop what holds them or pick others with --gpus.")


def disk_warning(path: str, bytes_needed: float) -> Optional[str]:
    if "://" in str(path):
        return None
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < bytes_needed:
        return (f"warning: {p} has {free / 1e9:.1f} GB free but the store needs about {bytes_needed / 1e9:.1f} GB more "
                f"({(bytes_needed - free) / 1e9:.1f} GB missing); extraction stops cleanly when the disk fills and "
                "resumes once space is freed")
    return None


def check_target_path(path: str, key: str = "target.path") -> None:
    """A target path that cannot be a target, as one PreflightError naming the path and the key: a local path
    (absolute, ./, ../, ~ or more than one `/`: never a hub id) that does not exist, is not a readable directory
    or has no config.json. A hub id (`org/name`) is left to the loader (load_tokenizer words its failure)."""
    p = Path(path).expanduser()
    local = p.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1 or p.exists()
    if not local:
        return
    fix = f"set {key} (in the config or --set {key}=DIR) to the target's checkpoint directory or a hub id"
    if not p.exists():
        raise PreflightError(f"{key} {path} does not exist; {fix}")
    if not p.is_dir():
        raise PreflightError(f"{key} {path} is not a directory (a checkpoint directory holds config.json, the "
                             f"tokenizer and the weights); {fix}")
    if not os.access(p, os.R_OK | os.X_OK) or not os.access(p / "config.json", os.R_OK):
        what = "has no config.json" if not (p / "config.json").exists() else "is not readable by this user"
        raise PreflightError(f"{key} {path} {what}; {fix}")
    from pipeline.targets import read_target_config

    try:
        read_target_config(p)  # the one reader: a FIFO refused unread, JSON that is no object refused
    except (OSError, ValueError) as e:
        raise PreflightError(f"{key} {path}: its config.json is not readable JSON ({str(e).splitlines()[0]}); "
                             f"{fix}") from None


class DiskFull(UserError, OSError):
    """A write failed for lack of space (or quota); the message names the disk and the resume command."""


def disk_full_error(exc: BaseException) -> Optional[OSError]:
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        stack += [e.__cause__, e.__context__]
    return None


def _mount_point(path: Path) -> Path:
    p = Path(os.path.realpath(path))
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def disk_full_message(err: OSError, path: str, resume: str) -> str:
    where = Path(str(err.filename or path))
    probe = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
    mount, free = _mount_point(probe), shutil.disk_usage(probe).free
    return (f"the disk holding {where} is full ({err.strerror or 'No space left on device'}; {mount} has "
            f"{free / 1e9:.2f} GB free). Checkpoints already written are intact (each is written to a temporary "
            f"file and renamed into place). Free space on {mount}, then resume with: {resume}")


def compile_cache_root() -> Path:
    """Where compiled kernels are kept across runs: $DFLASH_COMPILE_CACHE, else $XDG_CACHE_HOME/dflash/compile,
    else ~/.cache/dflash/compile. Shared by every run of the same drafter shape (new hyperparameters, more
    epochs, a resume), so only the first run on a machine pays the cold compile."""
    if os.environ.get("DFLASH_COMPILE_CACHE"):
        return Path(os.environ["DFLASH_COMPILE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash" / "compile"


def compile_cache_dir(root: Path, key_parts: dict, rebuild: bool = False) -> Path:
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    d = Path(root) / key
    if rebuild and d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    (d / "key.json").write_text(json.dumps(key_parts, sort_keys=True, default=str, indent=1))
    return d


def use_compile_cache(d: Path) -> None:
    """Point this process's (and its children's) inductor and triton caches into `d`."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(d) / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(Path(d) / "triton")
