"""How the training loader's worker processes start: the one owner of their multiprocessing context.

Contract:
- A worker never forks from the training process: that process already runs zarr's IO thread, and forking
  beside it deadlocked a DDP rank. Workers fork from a forkserver instead, a fresh interpreter that imports
  torch and the loader's modules (`PRELOAD`) and starts no thread, so a worker is ready in a fraction of a
  second where a spawned one imports torch again (2-4 s on the 2-core machine; a training and a validation
  worker per rank, before the first batch).
- `start_early()` launches that server at the start of `dflash train`: its imports overlap Lightning's import
  and the drafter's build. `context()` hands it to the DataLoaders (it starts the server itself when nobody
  did). A worker watches its training process, not its parent the server (data/store_dataset.worker_init,
  pipeline/lifecycle.watch_parent): the server lives as long as any worker does (each holds its liveness
  pipe), so the workers exit first when their trainer dies (SIGKILL included), then the server.
- Where the forkserver is unavailable (no fork on the platform) or does not come up, spawn, as before:
  slower, never wrong. DFLASH_LOADER_START=spawn picks spawn on purpose (a comparison, a suspect server).
"""

from __future__ import annotations

import multiprocessing
import os

# what every worker imports before its first batch (the dataset's unpickling, the store's reader and codecs);
# none of them starts a thread at import
PRELOAD = ["torch", "numpy", "zarr", "numcodecs.blosc", "data.store_dataset", "data.packing"]

_ctx = None  # the started forkserver context; None until start_early/context ran


def start_early():
    """Start the forkserver now (idempotent; a no-op under spawn): returns its context, or None for spawn."""
    global _ctx
    if os.environ.get("DFLASH_LOADER_START") == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    if _ctx is not None:
        return _ctx
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *PRELOAD])
    try:
        forkserver.ensure_running()
    except OSError:  # no server (no fork, no socket): the loaders spawn
        return None
    _ctx = ctx
    return ctx


def context():
    """The multiprocessing context for a DataLoader with workers: the forkserver (started here when nobody did),
    or spawn."""
    return start_early() or multiprocessing.get_context("spawn")
