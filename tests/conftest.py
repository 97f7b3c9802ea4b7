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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
