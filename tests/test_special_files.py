"""Special files are refused without being opened (issue 40 item 4): a FIFO where a loader expects a file (an
export's config.json, model.safetensors or dflash_meta.json, a target checkpoint's config.json, index or
weights, a store file read by path) is one line naming it (pipeline/ckpt_io.require_regular); reading one
blocks forever. A watcher process releases and reports any reader: a regression fails, never hangs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers_drafters import tiny_drafter
from pipeline.checkpoint import sha256_file, weight_files
from pipeline.targets import read_target_config, transformers_text_config
from pipeline.ckpt_io import SpecialFile
from pipeline.export import export_drafter, load_exported
from pipeline.store import read_bytes
from pipeline.target import target_fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")


# opens each FIFO for writing whenever a reader is there (O_NONBLOCK: it succeeds only then), says so, closes it
_WATCHER = """
import os, sys, time
while True:
    for f in sys.argv[1:]:
        try:
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            print(os.path.basename(f), flush=True)
        except OSError:
            pass
    time.sleep(0.02)
"""


@contextlib.contextmanager
def _unopened(*fifos):
    """Fails the test when the block opens any of `fifos` for reading. A reader blocked in open() (in Rust, holding
    the GIL, where no signal or thread of this process reaches it) is released by a watcher process, whose write
    end closes at once (the reader sees an empty file): a regression fails here instead of hanging."""
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, *map(str, fifos)], stdout=subprocess.PIPE, text=True)
    try:
        yield
    finally:
        watcher.terminate()
        opened = watcher.communicate()[0].split()
    assert not opened, f"opened for reading instead of refused: {sorted(set(opened))}"


def _fifo_in_place_of(f):
    f.unlink()
    os.mkfifo(f)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    d = tiny_drafter(0, target_layer_ids=[1, 3, 5], sliding_window=6)
    out = export_drafter(d, d.arch, tmp_path_factory.mktemp("e") / "export", vocab_size=50, num_target_layers=8,
                         dtype="float32", extra_metadata={"store": "s"})
    (out / "checksums.sha256").unlink()  # its list would refuse the FIFO as "missing": the loaders' own check here
    return out


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "dflash_meta.json"])
def test_an_export_file_that_is_a_fifo_is_refused(export, tmp_path, name):
    d = tmp_path / "x"
    shutil.copytree(export, d)
    _fifo_in_place_of(d / name)
    with _unopened(d / name), pytest.raises(SpecialFile) as e:
        load_exported(d)
    assert str(e.value).startswith(f"{d / name}: is a FIFO, not a regular file, so it was not read")
    assert "\n" not in str(e.value)


def test_target_checkpoint_files_and_store_files_that_are_fifos_are_refused(tmp_path):
    ckpt = tmp_path / "target"
    ckpt.mkdir()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    os.mkfifo(ckpt / "model-1.safetensors")
    os.mkfifo(ckpt / "config.json")
    os.mkfifo(tmp_path / "zarr.json")
    with _unopened(ckpt / "model-1.safetensors", ckpt / "config.json", tmp_path / "zarr.json"):
        with pytest.raises(SpecialFile, match="model-1.safetensors: is a FIFO"):
            weight_files(ckpt)
        with pytest.raises(SpecialFile, match="config.json: is a FIFO"):
            transformers_text_config(ckpt)
        with pytest.raises(SpecialFile, match="config.json: is a FIFO"):
            read_target_config(ckpt)
        with pytest.raises(SpecialFile, match="config.json: is a FIFO"):
            target_fingerprint(str(ckpt))
        with pytest.raises(SpecialFile, match="model-1.safetensors: is a FIFO"):
            sha256_file(ckpt / "model-1.safetensors")
        with pytest.raises(SpecialFile, match=r"zarr.json: is a FIFO, not a regular file.*the store file must"):
            read_bytes(str(tmp_path / "zarr.json"))
    (tmp_path / "ok.json").write_text("{}")
    assert read_bytes(str(tmp_path / "ok.json")) == b"{}"  # a regular file reads as before


def test_eval_of_a_drafter_path_that_is_a_fifo_names_it_as_one(tmp_path):
    """`dflash eval FIFO`: the path exists but is neither an export directory nor a checkpoint file; the error
    says what it is (it said "does not exist"), and nothing opens it."""
    from stages.eval import load_drafter

    fifo = tmp_path / "last.ckpt"
    os.mkfifo(fifo)
    with _unopened(fifo):
        with pytest.raises(SpecialFile, match="last.ckpt: is a FIFO, not a regular file"):
            load_drafter(str(fifo))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(str(tmp_path / "nothing.ckpt"))
