"""Fixtures shared by the post-training tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other tests for cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
