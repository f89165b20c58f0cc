"""``engine/capture_check.py``: every kind of host sync a CUDA graph cannot capture raises, with and without
inference mode; capture-safe ops pass; the patched Tensor methods come back on exit, also after an error."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.capture_check import CaptureCheck, HostSyncError

X = torch.arange(6.0)

SYNCS = {
    "item": lambda: X.sum().item(),
    "int": lambda: int(X[1]),
    "bool": lambda: bool(X[1] > 0),
    "tolist": lambda: X.tolist(),
    "numpy": lambda: X.numpy(),
    "nonzero": lambda: X.nonzero(),
    "bool_mask_index": lambda: X[X > 2],
    "masked_select": lambda: X.masked_select(X > 2),
    "unique": lambda: torch.unique(X),
    "bincount": lambda: torch.bincount(X.long()),
    "repeat_interleave": lambda: torch.repeat_interleave(X.long()),
    "tensor_from_list": lambda: torch.tensor([1, 2, 3]),
    "equal": lambda: torch.equal(X, X),
}


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("name", sorted(SYNCS))
def test_refuses_host_syncs(name, inference):
    with torch.inference_mode(inference):
        with pytest.raises(HostSyncError, match="not capture-safe"):
            with CaptureCheck():
                SYNCS[name]()


def test_deliberate_item_in_a_step_is_named():
    def step(x):
        n = int((x > 0).sum().item())  # the kind of read-back the MLA chunk plan did
        return x[:n] * 2

    with pytest.raises(HostSyncError, match=r"decode step is not capture-safe: aten\.(_local_scalar_dense|item)"):
        with CaptureCheck("decode step"):
            step(X)


@pytest.mark.parametrize("inference", [False, True])
def test_capture_safe_ops_pass(inference):
    with torch.inference_mode(inference):
        lens = torch.tensor([3, 1, 5])
        with CaptureCheck():
            pad = torch.arange(8)[None, :] >= lens[:, None]
            s = torch.randn(3, 8).masked_fill(pad, float("-inf")).softmax(-1)
            idx = torch.repeat_interleave(torch.arange(3), lens, output_size=9)
            out = torch.zeros(9).index_add_(0, idx.clamp(max=8), torch.ones(9))
            top = s.topk(2, dim=-1).indices
            s.gather(1, top)
    assert out.sum() == 9


def test_methods_restored_after_error():
    tolist = torch.Tensor.tolist
    with pytest.raises(HostSyncError):
        with CaptureCheck():
            X.tolist()
    assert torch.Tensor.tolist is tolist and X.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert X.sum().item() == 15.0
