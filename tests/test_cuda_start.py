"""pipeline/cuda_start.py (issue 46): the driver calls that start CUDA off the GIL, in order, and every way they can
fail ending in None (torch's own start then does the work); and the frozen-head thread's start-up line."""

from __future__ import annotations

import ctypes

from pipeline.cuda_start import start_cuda
from stages.train_startup import read_phase_text, thread_line


class FakeDriver:
    """libcuda.so.1's three calls, recording their arguments; `fail`: the call that returns an error code."""

    def __init__(self, fail: str | None = None):
        self.calls, self.fail = [], fail

    def _ret(self, name):
        return 100 if name == self.fail else 0  # CUDA_ERROR_NO_DEVICE

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return self._ret("cuInit")

    def cuDeviceGet(self, dev, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        ctypes.cast(dev, ctypes.POINTER(ctypes.c_int)).contents.value = 40 + ordinal  # the driver's device handle
        return self._ret("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        self.calls.append(("cuDevicePrimaryCtxRetain", dev.value))
        return self._ret("cuDevicePrimaryCtxRetain")


def test_start_cuda_inits_the_driver_then_retains_the_devices_primary_context():
    lib = FakeDriver()
    took = start_cuda(3, lib=lib)
    assert took is not None and took >= 0
    assert lib.calls == [("cuInit", 0), ("cuDeviceGet", 3), ("cuDevicePrimaryCtxRetain", 43)]


def test_start_cuda_stops_at_the_first_failing_call_and_says_none():
    for fail, made in (("cuInit", 1), ("cuDeviceGet", 2), ("cuDevicePrimaryCtxRetain", 3)):
        lib = FakeDriver(fail)
        assert start_cuda(0, lib=lib) is None and len(lib.calls) == made, fail
    assert start_cuda(0, lib=object()) is None  # a library without the driver's symbols


def test_start_cuda_without_a_driver_is_none(monkeypatch):
    monkeypatch.setattr("pipeline.cuda_start.DRIVER", "libno-such-cuda-driver.so.1")
    assert start_cuda(0) is None


def test_the_frozen_head_threads_line_counts_from_the_process_start():
    timeline = [("began", 105.25), ("checksum", 2.0), ("CUDA start", 0.5), ("load", 1.25)]
    assert thread_line(timeline, 100.0) == ("train: frozen-head thread 3.8 s: began 5.2, checksum 2.0, "
                                            "CUDA start 0.5, load 1.2")
    assert thread_line(timeline, 100.0, " on rank 1").startswith("train: frozen-head thread on rank 1 3.8 s: ")
    assert thread_line([], 100.0) is None
    # the benches read it back with the format's owner (bench/train_e2e.phase_line)
    assert read_phase_text(thread_line(timeline, 100.0, " on rank 1"), "frozen-head thread") == {
        "began": 5.2, "checksum": 2.0, "CUDA start": 0.5, "load": 1.2}
    assert read_phase_text(thread_line(timeline, 100.0), "start-up") is None
