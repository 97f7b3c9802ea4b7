"""Shared pytest setup: GPU tests run only where CUDA exists; everything else runs on 2 CPU cores."""

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def one_thread():
    """Toy-sized matmuls: thread hand-offs cost more than they save (10 ms per tiny linear on a loaded 2-core
    machine with 2 threads), as the online eval does for tiny targets."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    """A tiny replica of the real target's class (Qwen3_5ForConditionalGeneration: vision tower, 8 layers of
    3 x linear + 1 full attention twice, sharded checkpoint with mtp tensors; scripts/make_tiny_hybrid.py),
    ~2 MB, built once per test session."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from scripts.make_tiny_hybrid import build_tiny_hybrid

    return build_tiny_hybrid(tmp_path_factory.mktemp("hybrid") / "qwen3_5-tiny")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
