"""`train.profile_steps` (stages/train_profile.py): the profiled window's figures and files, and the config's
checks. The GPU half (busy/idle, kernel families) runs in bench/device_run.sh e2eprof; here the CPU path and
the interval arithmetic behind the idle fraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.gpu_trace import union_us as _union_us
from stages.train_profile import family

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_the_union_of_kernel_intervals_counts_overlaps_once():
    assert _union_us([]) == 0
    assert _union_us([(0, 10), (5, 15), (20, 25)]) == 20  # two streams overlapping 5 us, then a gap
    assert _union_us([(0, 100), (10, 20), (30, 40)]) == 100  # nested
    assert _union_us([(5, 6), (0, 1)]) == 2  # any order


def test_kernel_names_fall_into_families():
    assert family("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert family("triton_tem_fused_flex_attention_0") == "flex/triton"
    assert family("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "nccl"
    assert family("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert family("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert family("something_else") == "other"


@pytest.mark.parametrize("bad, says", [("[4,2]", "first < last"), ("[1,2,3]", "profile_steps"),
                                       ("[-1,2]", "profile_steps")])
def test_a_window_that_is_not_first_below_last_is_refused(bad, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
        load_config(TINY, [f"train.profile_steps={bad}"])


def test_a_profiled_cpu_run_writes_the_window_it_covered(tiny_store, tmp_path, capsys):
    from stages.train import run_train

    run = tmp_path / "run"
    cfg = load_config(TINY, [f"train.run_dir={run}", "train.max_steps=5", "train.profile_steps=[2,4]",
                             "train.num_workers=0"])
    assert run_train(cfg, store=tiny_store, export=False) == 0
    s = json.loads((run / "logs" / "profile-rank0.json").read_text())
    assert s["steps"] == 2 and s["wall_ms_per_step"] > 0
    assert "gpu_busy_ms_per_step" not in s  # no GPU: no device figures, rather than zeros
    ops = {h["name"] for h in s["top_host_ops"]}
    assert len(ops) >= 5 and all(h["self_ms_per_step"] >= 0 and h["calls"] >= 1 for h in s["top_host_ops"])
    ranges = {r["name"] for r in s["top_ranges"]}
    assert any("Optimizer.step" in r for r in ranges), ranges  # the optimizer's range is named
    text = (run / "logs" / "profile-rank0.txt").read_text()
    assert text.startswith("optimizer steps 2-3: ") and "| host op |" in text
    assert "train: profiled steps 2-3: " in capsys.readouterr().err


def test_user_annotations_on_the_gpu_are_not_counted_as_kernels():
    """The GPU spans of `Optimizer.step#AdamW.step` and compiled-graph calls cover the kernels inside them (and the
    backlog before): counted as kernels they made "other" 24% of the GPU time and hid the idle gaps."""
    from types import SimpleNamespace

    from pipeline.gpu_trace import device_work

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [SimpleNamespace(name="nvjet_sm90_tst_192x192", device_type=cuda),
          SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=cuda),
          SimpleNamespace(name="## Call CompiledFxGraph abc ##", device_type=cuda),
          SimpleNamespace(name="ProfilerStep", device_type=cuda, is_user_annotation=True),
          SimpleNamespace(name="aten::mm", device_type=cpu),
          SimpleNamespace(name="Memcpy DtoH (Device -> Pinned)", device_type=cuda),
          SimpleNamespace(name="Event Sync", device_type=cuda), SimpleNamespace(name="Stream Sync", device_type=cuda),
          SimpleNamespace(name="Device Sync", device_type=cuda)]  # the host's waits (enable_cuda_sync_events)
    assert [e.name for e in device_work(ev)] == ["nvjet_sm90_tst_192x192", "Memcpy DtoH (Device -> Pinned)"]
