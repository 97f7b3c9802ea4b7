"""stages/lightning_import.py: Lightning imported with torchmetrics reduced to Metric and MetricCollection, in a fresh
interpreter (the installed Lightning and torchmetrics): the light path is taken, the optional backends are not
imported, a LightningModule fits, other torchmetrics modules still import on demand; the opt-out imports in full."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys, torch
from stages.lightning_import import import_lightning
how = import_lightning()
import lightning as L

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 1)
    def training_step(self, batch, _):
        loss = self.w(batch).pow(2).mean()
        self.log("loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, accelerator="cpu", devices=1)
trainer.fit(M(), loader)
loaded = sorted(m for m in ("transformers", "torchmetrics.functional", "torchmetrics.classification",
                            "torchmetrics.text", "scipy", "matplotlib") if m in sys.modules)
import torchmetrics.aggregation  # a lazily imported torchmetrics module still loads (Lightning's spike detection)
import torchmetrics
print(json.dumps({"how": how, "steps": trainer.global_step, "loaded": loaded,
                  "metric_is_real": torchmetrics.Metric.__module__, "mean": torchmetrics.aggregation.MeanMetric.__name__}))
"""


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_light_path_skips_the_backends_and_fits():
    r = _probe(DFLASH_FULL_TORCHMETRICS="0")
    assert r["how"] == "light"
    assert r["steps"] == 3
    assert r["loaded"] == []  # no transformers, no metric family, no matplotlib (installed here by the dev extra)
    assert r["metric_is_real"] == "torchmetrics.metric" and r["mean"] == "MeanMetric"


@pytest.mark.slow
def test_opt_out_imports_torchmetrics_in_full():
    r = _probe(DFLASH_FULL_TORCHMETRICS="1")
    assert r["how"] == "full" and r["steps"] == 3
    assert "torchmetrics.functional" in r["loaded"]  # what the light path avoids, so the first test can fail
    assert "matplotlib" in r["loaded"]  # torchmetrics' plot module imports it when installed (the dev extra)
