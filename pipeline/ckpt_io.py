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
"""

from __future__ import annotations

import errno
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import UserError

# the types a dflash checkpoint may hold beyond weights_only's built-in set (tensors, containers, primitives)
ALLOWED_GLOBALS: list = []


class UnsafeCheckpoint(UserError, ValueError):
    """A checkpoint that asks to run or build something no dflash checkpoint holds; not loaded."""


class UnreadableCheckpoint(UserError, ValueError):
    """A file that is not a readable torch checkpoint (truncated, damaged, another format)."""


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
