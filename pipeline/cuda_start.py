"""Starting CUDA on a device without holding Python's GIL (issue 46: the warm first batch).

`dflash train` loads the frozen head onto its GPU in a background thread while the main thread imports Lightning
(pipeline/provenance.start_frozen_head_check). The first CUDA call of the process goes through torch's lazy
initialisation, which runs the driver's start (`cuInit`) and device queries while holding the GIL, so for those
seconds the main thread's imports stand still: on an H100 (2026-12-06) Lightning's imports took 8.6 s with the head
loaded beside them against 4.9 s without.

`start_cuda(index)` does the expensive part first, through the driver API called with ctypes (a foreign call
releases the GIL for its duration): `cuInit(0)`, then `cuDevicePrimaryCtxRetain` on device `index` (an ordinal
after CUDA_VISIBLE_DEVICES, as torch counts), which creates the device's primary context, the one torch's runtime
then uses. torch's own initialisation afterwards finds the driver started and the context made.

Contract: never raises and never imports torch; returns the seconds it took, or None when there is no CUDA driver
(libcuda.so.1 absent: a CPU machine) or a driver call failed (then torch's own start does the work, as before).
The retained context is never released: it lives as long as the process, as torch's does.
"""

from __future__ import annotations

import ctypes
import time
from typing import Optional

DRIVER = "libcuda.so.1"


def _driver():
    try:
        return ctypes.CDLL(DRIVER)
    except OSError:
        return None


def start_cuda(index: int, lib=None) -> Optional[float]:
    """Start the CUDA driver and make device `index`'s primary context off the GIL; seconds taken, else None.
    `lib`: the driver library (a test passes a stand-in); loaded from DRIVER when not given."""
    t = time.perf_counter()
    lib = lib if lib is not None else _driver()
    if lib is None:
        return None
    try:
        if lib.cuInit(0) != 0:
            return None
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
        if lib.cuDeviceGet(ctypes.byref(dev), int(index)) != 0:
            return None
        if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return None
    except (AttributeError, OSError, ctypes.ArgumentError):
        return None
    return time.perf_counter() - t
