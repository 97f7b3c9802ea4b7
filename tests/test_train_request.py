"""`run_train` builds one frozen `TrainRequest` (issue 44 item 2): every parameter of run_train is a field of the
request under its own name and reaches it unchanged, so a new `dflash train` flag is run_train's parameter and the
request's field, and the phases (stages/train_phases.py, stages/train_fit.py) get it from the conductor."""

from __future__ import annotations

import dataclasses
import inspect

import pytest


def test_every_run_train_parameter_is_a_field_of_the_request_and_reaches_it(monkeypatch, tmp_path):
    import stages.train as train
    from pipeline.config import load_config

    params = inspect.signature(train.run_train).parameters
    assert [f.name for f in dataclasses.fields(train.TrainRequest)] == list(params)
    seen = []
    monkeypatch.setattr(train, "_train", lambda req: seen.append(req) or 0)
    monkeypatch.delenv("DFLASH_TRAIN_FOLLOW", raising=False)
    cfg = load_config(None, [f"train.run_dir={tmp_path / 'run'}"])
    given = dict(store="s.zarr", gpus=[1, 2], devices=3, resume=True, command="dflash train --resume", export=False,
                 rebuild_compile_cache=True, follow=True, init_from="exp", num_nodes=2, committed_only=True)
    assert set(given) == set(params) - {"cfg"}
    assert train.run_train(cfg, **given) == 0
    req = seen[0]
    assert req.cfg is cfg and {k: getattr(req, k) for k in given} == given
    assert req.store_path == "s.zarr" and req.paths.last == tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.resume = False
    train.run_train(cfg)
    assert seen[1].store_path == cfg.store.path and seen[1].follow is False
    monkeypatch.setenv("DFLASH_TRAIN_FOLLOW", "1")  # a following launcher's rank follows too
    train.run_train(cfg)
    assert seen[2].follow is True
