"""Stage two on CPU: 2-process gloo DDP from the store alone (target absent), loss falls and tau > 1, kill and
resume, refusals, non-finite loss, and export equal to the trained module. Runs as subprocesses so that
Lightning's per-rank re-execution never re-runs pytest."""

from __future__ import annotations

import csv
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers_cli import FEW_ANCHORS, HANG_S, dflash, dflash_each, must_pass, start  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
# tiny_store: the session's shared store (tests/conftest.py)

def _train_args(store, run_dir, *extra):
    # the target path points nowhere: training must need nothing but the store
    return ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run_dir}",
            "--set", "target.path=/nonexistent/target-checkpoint", "--set", "train.num_workers=1", *extra]


def _start(args: list):
    """A dflash command in the background (helpers_cli.start), for a run that only gives a reference and can
    overlap the test's other runs; must_pass(run.result()) waits for it (a hang guard only) and wants exit 0."""
    return start([sys.executable, "-m", "stages.cli", *args])


def _metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_ddp_two_processes_learns_without_target(tiny_store, tmp_path):
    run = tmp_path / "run"
    r = dflash(*_train_args(tiny_store, run, "--devices", "2", "--set", "train.epochs=4", "--set", "train.batch_size=8",
                            "--set", "train.val_every=10", "--set", "train.log_every=2"))
    summary = json.loads((run / "summary.json").read_text())
    rows = _metrics(run)
    losses = [float(x["train/loss"]) for x in rows if x.get("train/loss")]
    assert len(losses) >= 4 and sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses
    assert summary["val"]["val/tau"] > 1.2, summary
    assert (run / "export" / "model.safetensors").exists() and (run / "checkpoints" / "last.ckpt").exists()
    first = {rank: float(s) for s, rank in re.findall(r"train: first batch done ([0-9.]+) s after start on rank (\d)", r.stderr)}
    assert sorted(first) == ["0", "1"], r.stderr[-2000:]  # each rank reports its own wait (compile)
    assert all(0 < s < 600 for s in first.values()), r.stderr[-2000:]  # the user's wait, compile included
    assert json.loads((run / "progress.json").read_text())["state"] == "finished"


@pytest.mark.slow  # a dflash train subprocess (or several): 8-25 s
def test_export_matches_trained_module(tiny_store, tmp_path):
    from pipeline.export import load_exported
    from pipeline.masks import make_attend
    from stages.export import export_checkpoint, load_checkpoint_drafter

    run = tmp_path / "run"
    # a second run of the same seed, for the reproduction checked at the end, beside the first
    again_run = _start(_train_args(tiny_store, tmp_path / "again", "--set", "train.max_steps=3", "--no-export",
                                   *FEW_ANCHORS))
    dflash(*_train_args(tiny_store, run, "--set", "train.max_steps=3", "--no-export", *FEW_ANCHORS))
    ckpt = str(run / "checkpoints" / "last.ckpt")
    out = export_checkpoint(ckpt, str(tmp_path / "export"), dtype="float32")
    trained, _ = load_checkpoint_drafter(ckpt)
    exported, arch, meta = load_exported(out)
    assert meta["dflash_config"]["target_layer_ids"] == [1, 3, 5] and "partial_rotary_factor" not in meta
    torch.manual_seed(0)
    S, A, bs, H = 40, 3, arch.block_size, arch.hidden_size
    feats = torch.randn(1, S, 3 * H)
    anchors = torch.tensor([[5, 17, 30]])
    q_pos = (anchors[..., None] + torch.arange(bs)).view(1, A * bs)
    emb = torch.randn(1, A * bs, H)
    attend = make_attend("sdpa", anchors=anchors, block_size=bs, ctx_len=S, layer_types=arch.layer_types,
                         sliding_window=arch.sliding_window)
    ctx_pos = torch.arange(S)[None]
    with torch.no_grad():
        a = trained(emb, trained.project_context(feats), q_pos, ctx_pos, attend)
        b = exported(emb, exported.project_context(feats), q_pos, ctx_pos, attend)
    torch.testing.assert_close(a, b)
    # the same seed reproduces the run: seeded initial weights, seeded data order and anchors
    must_pass(again_run.result())
    again, _ = load_checkpoint_drafter(str(tmp_path / "again" / "checkpoints" / "last.ckpt"))
    for (name, p), q in zip(trained.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.slow  # a dflash train subprocess (or several): 8-25 s
def test_one_progress_line_per_step_and_one_checkpoint_file(tiny_store, tmp_path):
    """With gradient accumulation several batches end at one optimizer step: the log gets one line per step.
    A checkpoint written at the last step is not written again: last.ckpt links it (no second full copy)."""
    run = tmp_path / "run"
    r = dflash(*_train_args(tiny_store, run, "--set", "train.max_steps=3", "--set", "train.checkpoint_every=3",
                            "--set", "train.accumulate_grad_batches=2", "--set", "train.log_every=1", "--no-export",
                            *FEW_ANCHORS))
    steps = re.findall(r"train: step (\d+)/", r.stderr)
    assert steps == ["1", "2", "3"], r.stderr[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and last.resolve() == (run / "checkpoints" / "step3.ckpt").resolve()
    full = [f.name for f in (run / "checkpoints").iterdir() if not f.is_symlink() and not f.name.startswith("best-")]
    assert full == ["step3.ckpt"]
    # the best checkpoint by val tau (validated at the last step) is weights only: no second full copy
    best = torch.load(run / "checkpoints" / "best-step3.ckpt", map_location="cpu", weights_only=False)
    assert "optimizer_states" not in best and best["dflash"]["step"] == 3
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3
    # the end of the run says when training ended and how long the final checkpoint took after it
    end = re.search(r"train: training done at step 3; writing the final checkpoint\n.*?train: final checkpoint (\S+) in place "
                    r"([0-9.]+) s after training ended", r.stderr, re.S)
    assert end and end.group(1) == str(last) and float(end.group(2)) < 60, r.stderr[-3000:]


@pytest.mark.slow
def test_kill_and_resume_continues_from_checkpoint(tiny_store, tmp_path):
    run = tmp_path / "run"
    # a fresh run of the same length, for the step count the resumed run must reach exactly (the anchors a sample
    # change no step count: FEW_ANCHORS, as the runs below), beside the killed and the resumed run
    ref = tmp_path / "ref"
    ref_run = _start(_train_args(tiny_store, ref, "--set", "train.epochs=2", "--no-export", *FEW_ANCHORS))
    args = [sys.executable, "-m", "stages.cli", *_train_args(tiny_store, run, "--set", "train.checkpoint_every=5",
                                                               "--set", "train.epochs=2", "--no-export", *FEW_ANCHORS)]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpts = run / "checkpoints"
    deadline = time.time() + HANG_S  # a hang guard only (tests/helpers_cli.py)
    while time.time() < deadline and p.poll() is None:
        if any(f.name.startswith("step") and int(f.stem[4:] or 0) >= 10 for f in ckpts.glob("step*.ckpt")):
            time.sleep(1.0)  # let last.ckpt follow the step checkpoint
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)
    step0 = before["global_step"]
    assert step0 >= 5
    r = dflash(*_train_args(tiny_store, run, "--set", "train.checkpoint_every=5", "--set", "train.epochs=2",
                            "--no-export", *FEW_ANCHORS), "--resume")
    after = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)
    total = json.loads((run / "summary.json").read_text())["global_step"]
    must_pass(ref_run.result())
    assert total == json.loads((ref / "summary.json").read_text())["global_step"] > step0
    assert after["global_step"] == total
    assert after["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["epoch"] == 1
    assert "lr_schedulers" in after and after["lr_schedulers"][0]["last_epoch"] == total
    assert r.returncode == 0


@pytest.mark.slow  # a dflash train subprocess (or several): 8-25 s
def test_refusals(tiny_store, tmp_path):
    run = tmp_path / "run"
    # five ways the store does not fit the config: one refusal names each on its own line (config_differences in
    # pipeline/provenance.py), so one command proves all five (they were five subprocesses, ~8 s each); it and
    # the two refusals below run in one subprocess (dflash_each)
    r, resume, missing = dflash_each(
        _train_args(tiny_store, run, "--set", "drafter.hidden_size=64", "--set", "target.layer_ids=[1,2,3]",
                    "--set", "target.name=some-other-model", "--set", "drafter.mask_token_id=99999",
                    "--set", "data.enable_thinking=true"),
        [*_train_args(tiny_store, run), "--resume"],
        _train_args(str(tmp_path / "missing.zarr"), run))
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    for says in ("hidden size: store has 128, drafter.hidden_size is 64", "layer ids: store has [1, 3, 5], config gives",
                 "target: store was extracted from 'dflash-tiny-target', config says 'some-other-model'",
                 "vocab: drafter.mask_token_id 99999 is outside", "enable_thinking=False"):
        assert sum(says in x for x in lines) == 1, (says, r.stderr[-3000:])
    assert not run.exists()  # refused before anything is written (by any of the three)
    assert resume.returncode == 2 and "no checkpoint" in resume.stderr, resume.stderr[-3000:]
    assert missing.returncode == 2 and "dflash extract" in missing.stderr, missing.stderr[-3000:]


@pytest.mark.slow  # a dflash train subprocess (or several): 8-25 s
def test_nonfinite_loss_stops_with_step_and_hint(tiny_store, tmp_path):
    run = tmp_path / "run"
    r = dflash(*_train_args(tiny_store, run, "--set", "train.lr=1.0e+30", "--set", "train.warmup_ratio=0.0",
                            "--set", "train.grad_clip=0.0", "--no-export"), check=False)
    assert r.returncode != 0
    assert "non-finite loss at step" in r.stderr and "--resume" in r.stderr


@pytest.mark.slow
def test_a_dead_rank_ends_the_job_without_hanging(tiny_store, tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "stages.cli", *_train_args(tiny_store, run, "--devices", "2", "--set",
                                                               "train.epochs=50", "--no-export")]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + HANG_S
    child = []
    while time.time() < deadline and not child:  # wait for rank 1 (Lightning starts it with LOCAL_RANK=1)
        time.sleep(0.5)
        for pid in subprocess.run(["pgrep", "-f", f"train.run_dir={run}"], capture_output=True, text=True).stdout.split():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"LOCAL_RANK=1" in env and (run / "progress.json").exists():
                child.append(int(pid))
    assert child, "rank 1 never started"
    os.kill(child[0], signal.SIGKILL)
    rc = p.wait(timeout=HANG_S)  # no hang: the launcher notices its dead rank
    assert rc != 0
    left = subprocess.run(["pgrep", "-f", f"train.run_dir={run}"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"


def test_compute_dtype_follows_precision():
    """bf16 frozen head and features only under a bf16 precision on GPU: a "32-true" GPU run has fp32 layers
    and no autocast, and bf16 inputs made its first linear fail."""
    from stages.train_task import compute_dtype

    assert compute_dtype("cuda", "bf16-mixed") == torch.bfloat16 and compute_dtype("cuda", "bf16-true") == torch.bfloat16
    assert compute_dtype("cuda", "32-true") == torch.float32 and compute_dtype("cpu", "bf16-mixed") == torch.float32


def test_the_head_is_loaded_ahead_onto_the_device_lightning_gives_the_rank():
    """Issue 46: the head's check thread loads it where the training module will hold it: Lightning's
    parallel_devices[local_rank] (the --gpus entry of this local rank), in the compute dtype."""
    from stages.train_nodes import Topology
    from stages.train_phases import Ranks, head_device

    top = Topology(num_nodes=2, per_node=3, node=1, local=1, rank=4, env="lightning", external=False)
    gpu = Ranks(use_gpu=True, accel="gpu", devs=[5, 6, 7], precision="bf16-mixed", top=top, launcher=False)
    assert head_device(gpu) == (torch.device("cuda", 6), torch.bfloat16)
    fp32 = Ranks(use_gpu=True, accel="gpu", devs=[5, 6, 7], precision="32-true", top=top, launcher=False)
    assert head_device(fp32) == (torch.device("cuda", 6), torch.float32)
    cpu = Ranks(use_gpu=False, accel="cpu", devs=2, precision="32-true", top=top, launcher=False)
    assert head_device(cpu) == (torch.device("cpu"), torch.float32)


@pytest.mark.slow
def test_gradient_accumulation_normalises_over_the_window(tiny_store, tmp_path):
    """Batch 1 x 3 accumulation through the real loader, module and Lightning loop: the optimizer sees the
    gradient of (sum of the 3 micro-batches' weighted losses) / (their total weight), i.e. a long sample
    weighs more than a short one, as in one batch of 3. Per-micro-batch normalisation fails this."""
    import lightning as L

    from pipeline import store as st
    from pipeline.config import load_config
    from pipeline.store_reader import StoreReader
    from stages.train import _dataloaders, check_store_matches
    from stages.train_task import DrafterTask

    cfg = load_config(TINY, ["train.batch_size=1", "train.accumulate_grad_batches=3", "train.num_workers=0",
                             f"train.run_dir={tmp_path}"])
    attrs = st.read_root_attrs(tiny_store)
    reader = StoreReader(tiny_store)

    def task():
        torch.manual_seed(0)
        return DrafterTask(cfg, check_store_matches(cfg, attrs), attrs["target"]["vocab_size"],
                           st.frozen_head_path(tiny_store), 10, attrs["encoding"], store_path=tiny_store)

    class Grab(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.grads = {n: p.grad.clone() for n, p in module.drafter.named_parameters()}

    trained, grab = task(), Grab()
    train_dl, _, sampler = _dataloaders(cfg, tiny_store, reader, 0, 1, 1)
    trained.train_sampler = sampler
    L.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=3, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, callbacks=[grab]).fit(trained, train_dataloaders=train_dl)

    ref = task()
    ref._load_head()
    dl, _, _ = _dataloaders(cfg, tiny_store, reader, 0, 1, 1)
    batches = [b for _, b in zip(range(3), dl)]
    sums, weights = zip(*[(lambda r: (r[0], r[1]["weight_sum"]))(ref._forward(b)) for b in batches])
    assert len({round(float(w), 3) for w in weights}) > 1  # the micro-batches weigh differently
    (sum(sums) / sum(weights)).backward()
    for n, p in ref.drafter.named_parameters():
        torch.testing.assert_close(grab.grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_final_checkpoint_is_written_before_the_weights_are_freed(tiny_store, tmp_path):
    """A run shorter than checkpoint_every: the final checkpoint holds the trained weights even though they are
    freed right after it (as on GPU). Lightning's ModelCheckpoint writes last.ckpt in its own on_train_end;
    the final checkpoint must come after that one, or a second write would save the freed (empty) weights."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from pipeline import store as st
    from pipeline.config import load_config
    from pipeline.store_reader import StoreReader
    from stages.progress import FinalCheckpoint
    from stages.train import _dataloaders, check_store_matches
    from stages.train_task import DrafterTask

    cfg = load_config(TINY, ["train.batch_size=4", "train.num_workers=0", f"train.run_dir={tmp_path}"])
    attrs = st.read_root_attrs(tiny_store)
    torch.manual_seed(0)
    task = DrafterTask(cfg, check_store_matches(cfg, attrs), attrs["target"]["vocab_size"],
                       st.frozen_head_path(tiny_store), 10, attrs["encoding"], store_path=tiny_store)
    train_dl, _, task.train_sampler = _dataloaders(cfg, tiny_store, StoreReader(tiny_store), 0, 1, 1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=1000, save_last="link")
    final = FinalCheckpoint(ckpt, tmp_path / "checkpoints" / "last.ckpt", free=True)
    trained = {}

    def finish(trainer, module):
        trained.update({k: v.detach().clone() for k, v in module.state_dict().items() if k.startswith("drafter.")})
        final(trainer, module)

    task.on_train_finished = finish
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, callbacks=[ckpt]).fit(task, train_dataloaders=train_dl)
    assert all(p.numel() == 0 and p.grad is None for p in task.drafter.parameters())  # freed, gradients too
    # one write: ModelCheckpoint's own end-of-training save came first and the final one found it in place
    # (run before it, the final save made ModelCheckpoint write last-v1.ckpt from the freed weights)
    assert sorted(x.name for x in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3 and trained
    for k, v in trained.items():
        torch.testing.assert_close(saved["state_dict"][k], v, msg=k)


def test_compile_workers_end_with_the_final_checkpoint_only_where_inductor_ran(monkeypatch):
    """FinalCheckpoint ends Inductor's compile-worker pool beside the final write (torch's exit handler waited ~4 s
    for it after the last line on an H100); a process that never compiled imports nothing for it."""
    import types

    from stages.progress import end_compile_workers

    calls = []
    fake = types.ModuleType("torch._inductor.async_compile")
    fake.shutdown_compile_workers = lambda: calls.append("shutdown")
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile", raising=False)
    end_compile_workers()
    assert calls == [] and "torch._inductor.async_compile" not in sys.modules
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    end_compile_workers()
    assert calls == ["shutdown"]


def test_progress_rate_and_eta_leave_the_first_batch_compile_out(tmp_path, monkeypatch, capsys):
    """A 30 s first batch (the compile) followed by 1 step/s: lines report 1 step/s and the ETA that follows
    from it, not the rate diluted by the compile (0.09 steps/s, an ETA ten times too long)."""
    from types import SimpleNamespace

    from stages import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    trainer = SimpleNamespace(global_step=0, world_size=1, global_rank=0, is_global_zero=True, current_epoch=0,
                              estimated_stepping_batches=100, callback_metrics={})
    lines = progress.ProgressLines(tmp_path, every=1, started=0.0)
    lines.on_train_start(trainer, None)
    batch = {"seq_lens": torch.tensor([100, 28])}
    for t, step in ((30.0, 1), (31.0, 2), (32.0, 3)):
        clock[0], trainer.global_step = t, step
        lines.on_train_batch_end(trainer, None, None, batch, step - 1)
    err = capsys.readouterr().err
    assert "first batch done 30.0 s after start" in err, err
    last = err.strip().splitlines()[-1]
    assert re.search(r"step 3/100 .* 1\.00 steps/s 128 tok/s ETA 1\.6 min", last), last
    assert json.loads((tmp_path / "progress.json").read_text())["steps_per_s"] == 1.0


def test_lr_schedule_is_linear_warmup_then_cosine_to_zero_and_norms_skip_decay(tiny_store):
    """The recipe's schedule (design brief: cosine with 4% warmup) over 100 optimizer steps: lr rises over the
    first 4 steps, peaks at train.lr, is half of it midway through the cosine, and ends at zero; weight
    decay applies to matrices, never to norms' 1-D weights."""
    from types import SimpleNamespace

    from pipeline import store as st
    from pipeline.config import load_config
    from stages.train import check_store_matches
    from stages.train_task import DrafterTask

    cfg = load_config(TINY, ["train.lr=1e-3", "train.warmup_ratio=0.04", "train.weight_decay=0.01"])
    attrs = st.read_root_attrs(tiny_store)
    task = DrafterTask(cfg, check_store_matches(cfg, attrs), attrs["target"]["vocab_size"],
                       st.frozen_head_path(tiny_store), 10, attrs["encoding"], store_path=tiny_store)
    task._trainer = SimpleNamespace(estimated_stepping_batches=100)
    conf = task.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert conf["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(101):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.25e-3) and lrs[3] == pytest.approx(1e-3)  # warmup: 4 steps
    assert lrs[:4] == sorted(lrs[:4]) and max(lrs) == pytest.approx(1e-3)
    assert lrs[4 + 48] == pytest.approx(0.5e-3)  # halfway through the 96 cosine steps
    assert lrs[100] == pytest.approx(0.0, abs=1e-12) and lrs[4:] == sorted(lrs[4:], reverse=True)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert len(no_decay["params"]) > 0


def test_the_task_clips_the_global_gradient_norm_itself_and_uses_foreach_adamw_on_the_cpu(tiny_store, tmp_path):
    """train.grad_clip is applied by DrafterTask.configure_gradient_clipping (Lightning's precision plugin refuses
    the fused AdamW CUDA runs use, so the Trainer gets no clip value): the optimizer's parameters come out with
    a global norm of exactly grad_clip, as Lightning's own call gives; on the CPU the optimizer stays foreach."""
    from pipeline import store as st
    from pipeline.config import load_config
    from stages.train import check_store_matches
    from stages.train_task import DrafterTask

    attrs = st.read_root_attrs(tiny_store)
    for clip in (0.25, None):
        cfg = load_config(TINY, [f"train.grad_clip={'null' if clip is None else clip}", f"train.run_dir={tmp_path}"])
        task = DrafterTask(cfg, check_store_matches(cfg, attrs), attrs["target"]["vocab_size"],
                           st.frozen_head_path(tiny_store), 10, attrs["encoding"], store_path=tiny_store)
        task.planned_steps = 10  # (the data plan's; no Trainer here)
        opt = task.configure_optimizers()["optimizer"]
        assert opt.defaults["foreach"] and not opt.defaults["fused"]
        params = [p for g in opt.param_groups for p in g["params"]]
        gen = torch.Generator().manual_seed(0)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        before = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
        task.configure_gradient_clipping(opt, gradient_clip_val=None)
        after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
        assert before > 10 and after == pytest.approx(before if clip is None else clip, rel=1e-5)
