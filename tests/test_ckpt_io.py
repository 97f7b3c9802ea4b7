"""Checkpoints off the critical path (stages/train_ckpt_io.py): a save returns after a host copy, the write runs
behind it, a second save waits for the first only, a failed or killed write leaves the previous file whole, and
last.ckpt's link and the replaced step file's removal follow the write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import stages.train_ckpt_io as io_mod  # noqa: E402
from pipeline.ckpt_io import relink as _relink  # noqa: E402
from stages.train_ckpt_io import AsyncCheckpointIO  # noqa: E402


@pytest.fixture
def gate(monkeypatch):
    """Writes wait until the test opens the gate; `started` is set when one begins."""
    opened, started, real = threading.Event(), threading.Event(), io_mod.write_atomic

    def gated(obj, path, stop=None):
        started.set()
        assert opened.wait(120), "the test never opened the gate"
        real(obj, path, stop)
    monkeypatch.setattr(io_mod, "write_atomic", gated)
    return opened, started


def ckpt(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4, 4), value)}, "global_step": int(value), "loops": [{"n": [1, 2]}]}


def test_a_save_returns_before_its_write_and_writes_the_state_of_its_call(tmp_path, gate):
    opened, started = gate
    lines: list[str] = []
    io = AsyncCheckpointIO(log=lines.append)
    state, path = ckpt(1.0), tmp_path / "step1.ckpt"
    io.save_checkpoint(state, path)
    assert started.wait(60) and not path.exists()  # the write is behind the save
    state["state_dict"]["w"].fill_(7.0)  # the next training step changes the weights in place
    state["loops"][0]["n"].append(3)
    opened.set()
    io.wait()
    got = torch.load(path, weights_only=True)
    assert torch.equal(got["state_dict"]["w"], torch.full((4, 4), 1.0)) and got["loops"] == [{"n": [1, 2]}]
    assert len(io.stalls) == 1 and len(lines) == 1 and lines[0].startswith("train: checkpoint step1.ckpt written: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1.ckpt"]  # no temporary file left


def test_a_second_save_waits_for_the_first_write_only(tmp_path, gate):
    opened, started = gate
    io = AsyncCheckpointIO(log=lambda s: None)
    io.save_checkpoint(ckpt(1.0), tmp_path / "a.ckpt")
    assert started.wait(60)
    second_done = threading.Event()
    t = threading.Thread(target=lambda: (io.save_checkpoint(ckpt(2.0), tmp_path / "b.ckpt"), second_done.set()))
    t.start()
    assert not second_done.wait(0.5)  # still waiting for the first write (the gate is shut)
    opened.set()
    t.join(120)
    assert second_done.is_set() and (tmp_path / "a.ckpt").exists()
    io.wait()
    assert torch.load(tmp_path / "b.ckpt", weights_only=True)["global_step"] == 2


def test_a_failed_write_keeps_the_previous_file_and_raises_at_the_next_wait(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AsyncCheckpointIO(log=lambda s: None)
    io.save_checkpoint(ckpt(1.0), path)
    io.wait()
    real_save = torch.save

    def disk_full(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(io_mod.torch, "save", disk_full)
    io.save_checkpoint(ckpt(2.0), path)
    with pytest.raises(OSError, match="No space left"):
        io.wait()
    monkeypatch.setattr(io_mod.torch, "save", real_save)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_what_follows_a_failed_write_is_dropped_even_when_asked_for_after_the_failure(tmp_path, monkeypatch):
    """A write can fail before Lightning asks for the link and the removal that follow it (a full disk fails at
    once): those actions are dropped, so last.ckpt keeps naming the previous, complete checkpoint and that
    checkpoint is not removed (seen in test_disk_full's end-to-end run: a dangling last.ckpt, step 2 deleted)."""
    old = tmp_path / "step2.ckpt"
    io = AsyncCheckpointIO(log=lambda s: None)
    io.save_checkpoint(ckpt(2.0), old)
    io.wait()

    def disk_full(obj, f):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(io_mod.torch, "save", disk_full)
    io.save_checkpoint(ckpt(4.0), tmp_path / "step4.ckpt")
    while not io._pending.done():  # the write has failed before anything asks for what follows it
        time.sleep(0.01)
    ran = []
    io.after_write(lambda: ran.append("link last.ckpt -> step4.ckpt"))
    io.remove_checkpoint(old)
    assert ran == [] and old.exists()
    with pytest.raises(OSError, match="No space left"):
        io.wait()
    io.after_write(lambda: ran.append("after the error was raised"))  # a later, good state runs its actions
    assert ran == ["after the error was raised"]


KILLED_WRITER = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from stages.train_ckpt_io import AsyncCheckpointIO

class Slow:  # pickled halfway through the checkpoint: the write stalls there until the process is killed
    def __reduce__(self):
        open(sys.argv[1] + ".writing", "w").close()
        time.sleep(600)
        return (int, (0,))

io = AsyncCheckpointIO(log=lambda s: None)
io.save_checkpoint({"global_step": 1, "w": torch.ones(1000)}, sys.argv[1])
io.wait()
io.save_checkpoint({"global_step": 2, "w": torch.zeros(1000), "slow": Slow(), "after": torch.ones(100000)}, sys.argv[1])
io.wait()
"""


@pytest.mark.slow  # a subprocess importing torch and Lightning
def test_a_process_killed_during_a_write_leaves_the_previous_checkpoint_readable(tmp_path):
    path = tmp_path / "last.ckpt"
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), str(ROOT)])
    marker = Path(f"{path}.writing")
    deadline = time.monotonic() + 600  # a hang guard, not a speed requirement
    while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), f"the writer did not reach its second write (exit {p.poll()})"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    got = torch.load(path, weights_only=True)  # what --resume reads
    assert got["global_step"] == 1 and torch.equal(got["w"], torch.ones(1000))


def test_the_last_link_and_the_removal_of_the_replaced_file_follow_the_write(tmp_path, gate):
    opened, started = gate
    io = AsyncCheckpointIO(log=lambda s: None)
    old, new, last = tmp_path / "step3.ckpt", tmp_path / "step6.ckpt", tmp_path / "last.ckpt"
    torch.save(ckpt(3.0), old)
    _relink(str(old), str(last))
    io.save_checkpoint(ckpt(6.0), new)
    assert started.wait(60)
    io.after_write(lambda: _relink(str(new), str(last)))  # what LinkAfterWrite queues
    io.remove_checkpoint(str(old))  # what ModelCheckpoint asks for next (save_top_k=1)
    assert os.readlink(last) == "step3.ckpt" and old.exists()  # a crash now: resume reads step 3
    opened.set()
    io.wait()
    assert os.readlink(last) == "step6.ckpt" and not old.exists()
    assert torch.load(last, weights_only=True)["global_step"] == 6
    ran = []
    io.after_write(lambda: ran.append(1))  # nothing in flight: at once
    assert ran == [1]


@pytest.mark.gpu
def test_cuda_tensors_go_to_pinned_buffers_reused_by_the_next_save():
    """On CUDA the host copy lands in pinned memory (a fast device-to-host copy) and the next save reuses it."""
    from stages.train_ckpt_io import HostCopy

    copy = HostCopy()
    w = torch.randn(1024, 1024, device="cuda")
    first = copy({"state_dict": {"w": w}, "step": 1})
    assert first["state_dict"]["w"].is_pinned() and torch.equal(first["state_dict"]["w"], w.cpu())
    buf = first["state_dict"]["w"].data_ptr()
    w.add_(1.0)
    second = copy({"state_dict": {"w": w}, "step": 2})
    assert second["state_dict"]["w"].data_ptr() == buf and torch.equal(second["state_dict"]["w"], w.cpu())
    early = HostCopy()  # pinned at training start (stages/train_task.on_train_start): the first save uses them
    early.reserve([((1024, 1024), torch.float32)])
    early.join()
    pinned = early.pool[((1024, 1024), torch.float32)][0]
    assert pinned.is_pinned()
    out = early({"state_dict": {"w": w}})["state_dict"]["w"]
    assert out.data_ptr() == pinned.data_ptr() and torch.equal(out, w.cpu())


def test_fast_pinning_finds_torchs_host_allocator_setting():
    """The setting exists under one of the names tried (torch 2.11 on the GPU host, 2.13 here): a rename in a later
    torch would silently bring back the 15 s first-checkpoint stall, so this fails instead."""
    from stages.train_ckpt_io import fast_pinning

    assert fast_pinning() is True


def test_reserved_buffers_take_the_first_saves_copies_in_any_order_and_are_reused():
    """The pool pinned at training start (here unpinned CPU buffers) receives the first save's tensors, whatever
    their order; two tensors of one shape get two buffers; an unforeseen one is allocated then and kept."""
    from stages.train_ckpt_io import HostCopy

    copy = HostCopy(device_types=("cpu",), pin=False)
    copy.reserve([((4, 4), torch.float32), ((4, 4), torch.float32), ((3,), torch.bfloat16)])
    copy.join()
    reserved = {b.data_ptr() for bufs in copy.pool.values() for b in bufs}
    assert copy.reserved == 3 and len(reserved) == 3
    a, b, c, extra = torch.randn(4, 4), torch.randn(4, 4), torch.randn(3).bfloat16(), torch.randn(2, 5)
    first = copy({"opt": [c, b], "state_dict": {"a": a, "x": extra}, "step": 7})
    got = [first["opt"][0], first["opt"][1], first["state_dict"]["a"]]
    assert {t.data_ptr() for t in got} == reserved
    assert all(torch.equal(x, y) for x, y in zip(got, [c, b, a])) and torch.equal(first["state_dict"]["x"], extra)
    assert first["step"] == 7 and first["state_dict"]["x"].data_ptr() not in reserved
    a.add_(1.0)
    second = copy({"state_dict": {"a": a, "x": extra}, "opt": [b, c]})
    assert {second["state_dict"]["a"].data_ptr(), second["opt"][0].data_ptr(), second["opt"][1].data_ptr()} == reserved
    assert torch.equal(second["state_dict"]["a"], a) and sum(len(v) for v in copy.pool.values()) == 4


def test_checkpoint_specs_foresee_every_tensor_of_a_training_checkpoint():
    """The reservation's forecast is the multiset of (shape, dtype) of the model's state dict and AdamW's
    (foreach) moments after a step: a wrong forecast would bring the first save's pinning stall back."""
    from collections import Counter

    from stages.train_ckpt_io import checkpoint_specs

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4, bias=False))
    model[1].weight.requires_grad_(False)
    model.register_buffer("seen", torch.zeros(3, dtype=torch.long))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=True)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    held = [t for t in model.state_dict().values()]
    held += [v for s in opt.state_dict()["state"].values() for k, v in s.items() if k != "step"]  # step: CPU scalar
    assert Counter(checkpoint_specs(model, "cpu")) == Counter((tuple(t.shape), t.dtype) for t in held)
    fused = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)  # CUDA's choice
    fused.step()
    held = [t for t in model.state_dict().values()] + [v for s in fused.state_dict()["state"].values() for v in s.values()]
    assert Counter(checkpoint_specs(model, "cpu", step_on_device=True)) == Counter((tuple(t.shape), t.dtype) for t in held)


def test_a_write_skips_the_records_crc32_loads_back_equal_and_restores_torchs_setting(tmp_path):
    """Issue 46 item 3: the checkpoint's zip records carry no CRC32 (its computation cost 28% of the write's rate on
    the H200 host); the file loads back equal through dflash's loader; torch's own setting is as it was."""
    import zipfile

    from pipeline.ckpt_io import load_training_checkpoint

    obj = {"state_dict": {"w": torch.randn(1000)}, "global_step": 7}
    before = torch.serialization.get_crc32_options()
    io_mod.write_atomic(obj, tmp_path / "a.ckpt")
    assert torch.serialization.get_crc32_options() == before
    torch.save(obj, tmp_path / "plain.pt")  # control: torch's default computes them
    crcs = lambda p: {i.filename.split("/", 1)[1]: i.CRC for i in zipfile.ZipFile(p).infolist()}  # noqa: E731
    assert crcs(tmp_path / "plain.pt")["data/0"] != 0 and crcs(tmp_path / "a.ckpt")["data/0"] == 0
    back = load_training_checkpoint(tmp_path / "a.ckpt")
    assert back["global_step"] == 7 and torch.equal(back["state_dict"]["w"], obj["state_dict"]["w"])


class _StopAfter:
    """A stop flag that is set from its n-th look on: the write is stopped midway, after torch.save began."""

    def __init__(self, n: int):
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


@pytest.mark.parametrize("after", [0, 1, 3])
def test_a_stopped_write_raises_and_leaves_the_previous_file(tmp_path, after):
    path = tmp_path / "a.ckpt"
    io_mod.write_atomic(ckpt(1.0), path)
    big = {"state_dict": {f"w{i}": torch.randn(1000) for i in range(8)}, "global_step": 2}
    with pytest.raises(io_mod.Superseded):  # also when torch's zip writer wraps the refusal in its own error
        io_mod.write_atomic(big, path, _StopAfter(after))
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]  # no temporary file left


def test_the_final_save_supersedes_a_write_in_flight(tmp_path, gate):
    """Issue 46 item 3: a step checkpoint still being written when the final one comes is given up: its file never
    appears, its link is not made, and the removal it held (the step file it replaced) runs after the final write."""
    opened, started = gate
    lines: list[str] = []
    io = AsyncCheckpointIO(log=lines.append)
    done: list[str] = []
    opened.set()
    io.save_checkpoint(ckpt(1.0), tmp_path / "step1.ckpt")
    io.wait()
    opened.clear()
    started.clear()
    io.save_checkpoint(ckpt(2.0), tmp_path / "step2.ckpt")
    io.after_write(lambda: done.append("link last -> step2"))
    io.after_write(lambda: (done.append("remove step1"), (tmp_path / "step1.ckpt").unlink()), kind="remove")
    assert started.wait(60)
    assert io.supersede()
    opened.set()
    io.save_checkpoint(ckpt(3.0), tmp_path / "last.ckpt")  # the final save: waits for the given-up write only
    io.wait()
    assert done == ["remove step1"]  # after the final write, and no link to the file that was given up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 3
    assert any("step2.ckpt given up" in x for x in lines) and not io.supersede()  # nothing in flight now


def test_a_superseded_writes_removals_never_run_when_the_final_write_fails(tmp_path, gate, monkeypatch):
    opened, started = gate
    io = AsyncCheckpointIO(log=lambda s: None)
    done: list[str] = []
    io.save_checkpoint(ckpt(2.0), tmp_path / "step2.ckpt")
    io.after_write(lambda: done.append("remove step1"), kind="remove")
    assert started.wait(60) and io.supersede()
    opened.set()
    io.wait()

    def full(obj, path, stop=None):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(io_mod, "write_atomic", full)
    io.save_checkpoint(ckpt(3.0), tmp_path / "last.ckpt")
    with pytest.raises(OSError):
        io.wait()
    assert done == [] and not (tmp_path / "last.ckpt").exists()  # the previous checkpoint keeps its file
