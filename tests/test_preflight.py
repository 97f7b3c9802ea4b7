"""Preflight checks: GPU usage parsed from nvidia-smi names the GPU and its holders; disk warning; keyed cache."""

import pytest

from pipeline import preflight
from pipeline.preflight import PreflightError, compile_cache_dir, compile_cache_root, disk_warning, parse_gpu_usage


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
