"""Training tests run on one thread: on the shared 2-core box two threads oversubscribe and run 10x slower."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
