"""Reading a training checkpoint (`RUN/checkpoints/*.ckpt`) without ever running code from it.

A `.ckpt` is a torch pickle, and a pickle can name any Python callable to run while it is read: a checkpoint
that travelled between people or machines (`dflash export X.ckpt`, `dflash eval X.ckpt`, a `last.ckpt` planted
in a run directory for `--resume`) must never get to do that.

Contract:
- `load_training_checkpoint(path, mmap=False)` is the one way dflash reads a `.ckpt`: `torch.load` with
  `weights_only=True` (tensors, dicts, lists, tuples, numbers, strings; no callable) inside a `safe_globals`
  context that allows exactly `ALLOWED_GLOBALS`, the types our checkpoints hold beyond those. Lightning's
  checkpoint (step, loops, optimizer and scheduler states, callback states, our `dflash` metadata) holds none:
  the list is empty, and adding to it is a decision a reviewer sees.
- A file that names anything else is refused with `UnsafeCheckpoint` (a UserError: one line naming the file and
  the global it asked for) before any of it runs; a file that is not a readable checkpoint at all (truncated,
  another format) gets `UnreadableCheckpoint`, also one line.
- `SafeCheckpointIO` (stages/train.py's Lightning checkpoint plugin) routes `Trainer.fit(ckpt_path=...)` through
  the same function, whatever `weights_only` Lightning asks for.
- `require_regular(path, what)` refuses a FIFO, device, socket or directory with `SpecialFile` (one line) from its
  os.stat alone, never opening it (a FIFO would block the read forever); every loader of a checkpoint, an
  export's files or a store file read by path calls it before opening. A missing path passes (the caller says).
- At the start of `dflash train` (stages/train.py, the launcher only): `remove_stale_temps(ckpt_dir)` deletes the
  `.NAME.tmpPID` files of writers no longer alive (a kill during a write), and with `--resume`
  `repair_last_link(ckpt_dir)` makes `last.ckpt` name a checkpoint that exists: a dangling or missing link goes
  to the newest one present (a valid versioned `last-vN.ckpt` of older runs counts), Lightning's `last-vN` links
  are removed, and one line says what was changed. A regular last.ckpt (the final save) is kept.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import stat
import sys
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.errors import UserError

# the types a dflash checkpoint may hold beyond weights_only's built-in set (tensors, containers, primitives)
ALLOWED_GLOBALS: list = []


class UnsafeCheckpoint(UserError, ValueError):
    """A checkpoint that asks to run or build something no dflash checkpoint holds; not loaded."""


class UnreadableCheckpoint(UserError, ValueError):
    """A file that is not a readable torch checkpoint (truncated, damaged, another format)."""


class SpecialFile(UserError, ValueError):
    """A path a loader would read that is not a regular file (a FIFO, a device, a socket, a directory)."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def require_regular(path: str | Path, what: str = "file") -> None:
    """Raise SpecialFile unless `path` (its link followed) is a regular file; decided by os.stat, nothing opened."""
    p = str(path).removeprefix("file://")
    if "://" in p:
        return  # a remote file (fsspec): no special files there
    try:
        mode = os.stat(p).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise SpecialFile(f"{p}: is {kind}, not a regular file, so it was not read; the {what} must be a plain "
                          "file: remove it or pass the real file")


def _named_global(msg: str) -> str:
    """What the refused pickle asked for, from torch's weights_only error text (best effort)."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.<>]+)", msg)
    if m:
        return m.group(1)
    first = next((line.strip() for line in msg.splitlines() if line.strip() and "weights_only" not in line), "")
    return first[:160] or "a non-tensor object"


def load_training_checkpoint(path: str | Path, mmap: bool = False, map_location: Any = "cpu") -> dict:
    """The checkpoint's dict, read with weights_only=True and the explicit allow-list (see the module contract)."""
    p = str(path).removeprefix("file://")
    require_regular(p, "training checkpoint")  # a FIFO planted as last.ckpt would block torch.load forever
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            if "://" in p:  # a remote run directory (fsspec), as Lightning's own loader reads it
                from lightning.fabric.utilities.cloud_io import get_filesystem

                with get_filesystem(p).open(p, "rb") as f:
                    ckpt = torch.load(f, map_location=map_location, weights_only=True)
            else:
                ckpt = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(
            f"{p}: refused to load: it asks for {_named_global(str(e))}, which no dflash checkpoint holds (loading "
            "it could run code from the file). Use a checkpoint written by dflash train, or one from a source you "
            "trust re-saved as plain tensors") from None
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        if isinstance(e, OSError) and e.errno not in (None, errno.EINVAL):  # a real IO error (EINVAL: torch's
            raise                                                            # reader on a torn file)
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UnreadableCheckpoint(f"{p}: not a readable training checkpoint (truncated or damaged? {first}); use "
                                   "another checkpoint of the run, e.g. an earlier step*.ckpt") from None
    if not isinstance(ckpt, dict):
        raise UnreadableCheckpoint(f"{p}: holds a {type(ckpt).__name__}, not a training checkpoint's dict")
    return ckpt


def safe_checkpoint_io_class(base: type) -> type:
    """A subclass of Lightning CheckpointIO `base` whose load_checkpoint is `load_training_checkpoint`."""

    class SafeCheckpointIO(base):
        def load_checkpoint(self, path, map_location=None, weights_only=None):  # noqa: ARG002 - always safe
            return load_training_checkpoint(path, map_location=map_location or "cpu")

    return SafeCheckpointIO


# ---- the run directory's checkpoint names after a kill ------------------------------------------------------

STEP_RE = re.compile(r"^step(\d+)(?:-v\d+)?\.ckpt$")  # Lightning's step files (stages/train.py: "step{step}")
VERSIONED_LAST_RE = re.compile(r"^last-v\d+\.ckpt$")
TEMP_RE = re.compile(r"^\..+\.tmp(\d+)$")  # stages/train_ckpt_io.write_atomic's and relink's temporaries


def remove_stale_temps(ckpt_dir: Path) -> list[str]:
    """Delete the `.NAME.tmpPID` files in `ckpt_dir` whose writer (PID on this machine) is not alive; their names."""
    from pipeline.procinfo import pid_alive

    gone = []
    for f in sorted(Path(ckpt_dir).iterdir()) if Path(ckpt_dir).is_dir() else []:
        m = TEMP_RE.match(f.name)
        if m and not pid_alive(int(m.group(1))):
            f.unlink(missing_ok=True)
            gone.append(f.name)
    return gone


def _is_file(p: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return False


def _step(p: Path) -> int:
    m = STEP_RE.match(p.name)
    return int(m.group(1)) if m else -1


def newest_step_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The newest step checkpoint (`step*.ckpt`, a regular file) in ckpt_dir, None when there is none."""
    present = [f for f in Path(ckpt_dir).glob("step*.ckpt") if STEP_RE.match(f.name) and _is_file(f)]
    return max(present, key=lambda f: (_step(f), f.name), default=None)


def repair_last_link(ckpt_dir: Path, log=None) -> str | None:
    """Make ckpt_dir/last.ckpt name an existing checkpoint (see the module contract); the line it logged, or None
    when nothing needed changing."""
    ckpt_dir = Path(ckpt_dir)
    last = ckpt_dir / "last.ckpt"
    versioned = sorted(f for f in ckpt_dir.glob("last-v*.ckpt") if VERSIONED_LAST_RE.match(f.name) and f.is_symlink())
    changed = []
    if os.path.lexists(last) and not last.is_symlink():
        require_regular(last, "last.ckpt")  # a full checkpoint (the final save) stays; a FIFO is refused
    else:
        named = [Path(os.path.realpath(f)) for f in ([last] if last.is_symlink() else []) + versioned]
        named = [f for f in named if _is_file(f)]
        newest = newest_step_checkpoint(ckpt_dir)
        pick = max(named or ([newest] if newest else []), key=lambda f: (_step(f), f.name), default=None)
        now = Path(os.path.realpath(last)) if last.is_symlink() else None
        if pick is not None and now != pick.resolve():
            old = ("was missing" if now is None else f"named {os.readlink(last)}, which is missing" if not
                   _is_file(now) else f"named {os.readlink(last)}, older than a versioned link's")
            relink(str(pick), str(last))
            changed.append(f"last.ckpt {old}; it now names {pick.name}, the newest checkpoint present")
    for f in versioned:
        f.unlink(missing_ok=True)
    if versioned:
        changed.append(f"removed the versioned link(s) {', '.join(f.name for f in versioned)}")
    if not changed:
        return None
    line = f"train: --resume repaired {ckpt_dir}: " + "; ".join(changed)
    (log or (lambda s: print(s, file=sys.stderr, flush=True)))(line)
    return line


def relink(filepath: str, linkpath: str) -> None:
    """Point `linkpath` at `filepath` (relative) in one rename: a new link beside it, os.replace, fsync of the
    directory. The old link names its file until the rename; after it, the new one does."""
    if os.path.abspath(filepath) == os.path.abspath(linkpath):
        return
    d = os.path.dirname(linkpath)
    tmp = os.path.join(d, f".{os.path.basename(linkpath)}.tmp{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(filepath, d), tmp)
    os.replace(tmp, linkpath)
    fd = os.open(d or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
