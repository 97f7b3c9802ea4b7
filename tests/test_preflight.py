"""Preflight checks: GPU usage parsed from nvidia-smi names the GPU and its holders; disk warning; keyed cache."""

import pytest

from pipeline import preflight
from pipeline.preflight import PreflightError, compile_cache_dir, compile_cache_root, physical_gpu, disk_warning, parse_gpu_usage


def test_busy_gpu_is_named_with_its_holders(monkeypatch):
    gpus = [["0", "GPU-a", "1000", "143771"], ["1", "GPU-b", "140000", "143771"]]
    apps = [["GPU-b", "4242", "python", "139000"]]
    info = parse_gpu_usage(gpus, apps)
    assert info[1]["holders"] == ["pid 4242 python (139000 MiB)"] and info[0]["free_gib"] > 130
    monkeypatch.setattr(preflight, "_smi", lambda q, kind="--query-gpu": gpus if kind == "--query-gpu" else apps)
    preflight.check_gpus_free([0], need_gib=60)
    with pytest.raises(PreflightError, match=r"GPU 1 has 3\.7 GiB free.*pid 4242 python"):
        preflight.check_gpus_free([0, 1], need_gib=60)
    with pytest.raises(PreflightError, match="GPU 7 does not exist"):
        preflight.check_gpus_free([7], need_gib=1)
    preflight.check_gpus_free([0, 0], need_gib=60)  # two workers on GPU 0: 120 of its ~139 GiB free
    with pytest.raises(PreflightError, match=r"GPU 0 has .* needs ~180 GiB \(3 workers x 60\)"):
        preflight.check_gpus_free([0, 0, 0], need_gib=60)


def test_disk_warning_and_keyed_cache(tmp_path):
    assert disk_warning(str(tmp_path / "s.zarr"), 1) is None
    assert "GB missing" in disk_warning(str(tmp_path / "s.zarr"), 1e18)
    a = compile_cache_dir(tmp_path, {"torch": "2.11", "drafter": {"hidden": 5120}})
    b = compile_cache_dir(tmp_path, {"torch": "2.13", "drafter": {"hidden": 5120}})
    assert a != b and (a / "key.json").exists()
    (a / "artifact").write_text("x")
    assert not (compile_cache_dir(tmp_path, {"torch": "2.11", "drafter": {"hidden": 5120}}, rebuild=True) / "artifact").exists()


def test_compile_cache_root_is_shared_and_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_COMPILE_CACHE", str(tmp_path / "cc"))
    assert compile_cache_root() == tmp_path / "cc"
    monkeypatch.delenv("DFLASH_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_root() == tmp_path / "xdg" / "dflash" / "compile"


def test_gpu_indices_map_through_the_schedulers_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert physical_gpu(3) == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert (physical_gpu(0), physical_gpu(1)) == ("5", "7")  # a child given "0" would land on someone's GPU 0
    with pytest.raises(PreflightError, match="CUDA_VISIBLE_DEVICES=5,7 shows 2 GPU"):
        physical_gpu(2)


def test_shard_gpu_choice():
    from stages.extract import ExtractError, shard_gpus

    assert shard_gpus(None, 5, None, 8) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
    assert shard_gpus([3, 4], 2, None, 8) == {0: 3, 1: 4}
    assert shard_gpus(None, 5, 3, 1) == {3: 0}  # one shard under a scheduler: its (first visible) GPU
    assert shard_gpus([2], 5, 3, 4) == {3: 2}
    assert shard_gpus([0, 1, 2, 3, 4], 5, 3, 8) == {3: 3}
    assert shard_gpus(None, 5, None, 0) == {}
    assert shard_gpus(None, 2, None, 1) == {0: 0, 1: 0}  # the demo's 2 shards on a one-GPU machine share it
    assert shard_gpus(None, 5, None, 2) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    with pytest.raises(ExtractError, match="needs 5 GPUs"):
        shard_gpus([0, 1], 5, None, 8)
    with pytest.raises(ExtractError, match="sees 2 GPU"):
        shard_gpus([0, 3], 2, None, 2)
    with pytest.raises(ExtractError, match="one GPU"):
        shard_gpus([0, 1], 5, 3, 8)


def test_cpu_threads_share_the_usable_cores_unless_omp_num_threads_is_set(monkeypatch):
    """Extraction, regeneration and CPU training size their torch threads here: the usable cores shared out, less
    a reserve (training's loader worker), at least 1; an explicit OMP_NUM_THREADS wins (the test suite sets 1)."""
    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [preflight.cpu_threads(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert preflight.cpu_threads(2, reserve=1) == 3 and preflight.cpu_threads(8, reserve=1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert preflight.cpu_threads(1) == 3 and preflight.cpu_threads(4, reserve=1) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # empty or not a count: as if unset
    assert preflight.cpu_threads(2) == 4
