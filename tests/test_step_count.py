"""One trained tiny run, on a terminal (issue 43 item 3): one step count in metrics.csv, summary.json, the progress
lines and the eval report; metrics.csv's lr, wall-time and tokens/s columns; dflash's step line is the only
progress display (Lightning's bar is off); eval's headline tau on stdout and `--json` on eval and status."""

from __future__ import annotations

import csv
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import HANG_S, ROOT, TINY, dflash  # noqa: E402


def _on_a_terminal(args: list[str]) -> tuple[int, str]:
    """`dflash ARGS` with stdout and stderr on a pseudo-terminal: (exit code, everything it printed)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, stdout=slave, stderr=slave,
                         stdin=subprocess.DEVNULL, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "120"})
    os.close(slave)
    out, deadline = b"", time.time() + HANG_S  # a hang guard only
    while time.time() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: every writer is gone
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    os.close(master)
    return p.wait(timeout=HANG_S), out.decode(errors="replace")


@pytest.mark.slow  # a 12-step tiny training run on the CPU and an offline eval of it (~40 s)
def test_one_step_count_new_metrics_columns_and_one_progress_display(tiny_store, tmp_path):
    run = tmp_path / "run"
    rc, shown = _on_a_terminal(["train", "--config", TINY, "--store", tiny_store, "--no-export",
                                "--set", f"train.run_dir={run}", "--set", "train.max_steps=12",
                                "--set", "train.log_every=5", "--set", "train.val_every=6",
                                "--set", "train.num_workers=0"])
    assert rc == 0, shown[-3000:]
    steps = [int(ln.split()[2].split("/")[0]) for ln in shown.splitlines() if ln.startswith("train: step ")]
    assert steps == [5, 10], shown[-3000:]
    assert "Epoch 0" not in shown and "it/s" not in shown, shown[-3000:]  # Lightning's bar: not drawn
    with open(run / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    trained = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in trained] == [5, 10, 12]  # the progress line's count (10 steps: 5 and 10; the last)
    assert [int(r["step"]) for r in rows if r["val/tau"]] == [6, 12]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 12 and summary["val"]["step"] == 12
    for r in trained:
        assert 0 < float(r["train/lr"]) <= 3e-3 and float(r["train/tokens_per_s"]) > 0
    walls = [float(r["train/wall_s"]) for r in trained]
    assert walls == sorted(walls) and walls[0] > 0
    out = tmp_path / "eval"
    r = dflash("eval", str(run / "checkpoints" / "last.ckpt"), "--store", tiny_store, "--out", str(out),
               "--set", "eval.max_anchors_per_sample=8", "--max-samples", "8")
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["steps"] == 12 and report["drafter"]["origin"]["step"] == 12
    walk = report["offline"]["serving_walk"]["tau"]
    assert r.stdout == (f"tau {walk:.3f} tokens per verify step (offline serving walk over 8 stored samples; --online "
                        f"measures it against the target); details on stderr and in {out / 'report.json'}\n")
    assert "eval: offline tau" in r.stderr  # the rest stays on stderr
    j = dflash("eval", str(run / "checkpoints" / "last.ckpt"), "--store", tiny_store, "--out", str(out),
               "--set", "eval.max_anchors_per_sample=8", "--max-samples", "8", "--json")
    got, again = json.loads(j.stdout), json.loads((out / "report.json").read_text())  # the one report, whole
    assert got["path"] == str(out / "report.json") and got["offline"] == again["offline"]
    assert got["training"] == again["training"] and got["drafter"] == again["drafter"]
    status = json.loads(dflash("status", "--json", str(run)).stdout)
    assert (status["kind"], status["state"], status["step"]) == ("training", "finished", 12)
    assert status["last_checkpoint"] == str(run / "checkpoints" / "last.ckpt")
