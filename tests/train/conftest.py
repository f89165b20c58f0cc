"""Training tests run on one thread: on the shared 2-core box two threads oversubscribe and run 10x slower. Each
ends with denormals kept again: ``train()`` flushes them process-wide, and the MX spec tests that may run after
them in the same process compute subnormals (test_scale_clamps_at_2_pow_minus_127 failed after test_train)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    torch.set_flush_denormal(False)
