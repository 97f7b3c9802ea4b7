"""GPU only (issue 27 item 4): with drafter.is_causal false, compiled flex_attention with the BlockMask equals SDPA
with the dense mask (outputs and gradients, bf16, a sliding and a full layer of a DFlash 2 drafter), and `dflash
train` -> export -> `dflash eval --online` keeps the key end to end on one GPU. The CPU smoke tests of the same
functions are in tests/test_is_causal.py. Run on the GPU machine: `bash bench/device_run.sh iscausal`."""

from __future__ import annotations

import pytest
import torch

from helpers_is_causal import flex_vs_sdpa, run_pipeline

pytestmark = pytest.mark.gpu


def test_compiled_flex_matches_sdpa_with_is_causal_false():
    r = flex_vs_sdpa("cuda", S=700, compile=True, backward=True, dtype=torch.bfloat16)
    print(r)
    assert r["out"] < 2e-2 and r["grad"] < 5e-2, r
    assert r["rule"] > 1e-3, r  # and the bidirectional rule really differs from the default one (fp32)


@pytest.mark.gpu_alone  # starts dflash on the GPU: run alone (bench part gputests)
def test_train_export_eval_keep_is_causal_on_gpu(tmp_path):
    rep = run_pipeline(tmp_path, gpu=True, samples=240, train_sets=[
        "train.precision=bf16-mixed", "train.compile=on", "train.epochs=2", "train.val_every=20"])
    print({k: rep[k] for k in ("offline", "online") if k in rep})
    assert rep["offline"]["tau"] > 1.0
