"""Shared fixtures. Tests keep torch to the two cores CI has and to deterministic seeds."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
