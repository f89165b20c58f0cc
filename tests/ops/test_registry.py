"""The op registry: per-call dispatch by priority and ``accepts``, forced backends, post-load hooks."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops import native, registry
from k3serve.ops.kda.cpu import kda_decode_step_cpu
from k3serve.ops.kda.step import kda_decode_step


@pytest.fixture
def op():
    """A throwaway op name, removed from the registry afterwards (test_naming checks every registered op)."""
    name = "test_registry_op"
    yield name
    registry._BACKENDS.pop(name, None)
    registry._FORCED.pop(name, None)
    registry._DISPATCH.pop(name, None)


def _cuda_only(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def test_dispatch_picks_the_highest_priority_backend_that_accepts_the_call(op):
    registry.register(op, "naive")(lambda x: "naive")
    registry.register(op, "torch")(lambda x: "torch")
    registry.register(op, "gpu", priority=20, accepts=_cuda_only)(lambda x: "gpu")
    registry.register(op, "bf16", priority=10, accepts=lambda x: x.dtype == torch.bfloat16)(lambda x: "bf16")
    fn = registry.get(op)
    assert fn(torch.zeros(2)) == "torch"
    assert fn(torch.zeros(2, dtype=torch.bfloat16)) == "bf16"
    assert fn(torch.zeros(2, device="meta")) == "torch"  # the gpu form refuses meta inputs
    assert registry.active(op) == "gpu"
    assert [b.name for b in registry.candidates(op)] == ["gpu", "bf16", "torch"]


def test_a_top_backend_that_accepts_everything_is_returned_itself(op):
    def torch_form(x):
        return x

    registry.register(op, "torch")(torch_form)
    registry.register(op, "naive")(lambda x: x)
    assert registry.get(op) is torch_form  # no dispatch wrapper on single-form ops


def test_naive_is_the_last_resort_and_alternatives_run_only_when_named(op):
    registry.register(op, "naive")(lambda x: "naive")
    registry.register(op, "bucketed")(lambda x: "bucketed")  # no priority: named or forced only
    assert registry.get(op)(0) == "naive"
    assert registry.get(op, "bucketed")(0) == "bucketed"


def test_forcing_a_backend_wins_over_dispatch_and_is_restored(op):
    registry.register(op, "torch")(lambda x: "torch")
    registry.register(op, "naive")(lambda x: "naive")
    registry.register(op, "fast", priority=5)(lambda x: "fast")
    assert registry.get(op)(0) == "fast"
    with registry.use(op, "naive"):
        assert registry.get(op)(0) == "naive"
        assert registry.pick(op, 0)(0) == "naive"
        assert registry.active(op) == "naive"
    assert registry.get(op)(0) == "fast" and registry.forced(op) is None


def test_no_accepting_backend_is_an_error(op):
    registry.register(op, "gpu", priority=1, accepts=_cuda_only)(lambda x: x)
    with pytest.raises(TypeError, match="no backend accepts"):
        registry.get(op)(torch.zeros(1))


def test_registering_again_refreshes_dispatch(op):
    registry.register(op, "torch")(lambda x: "torch")
    assert registry.get(op)(0) == "torch"
    registry.register(op, "fast", priority=3)(lambda x: "fast")
    assert registry.get(op)(0) == "fast"


def test_native_kda_step_serves_cpu_fp32_only():
    N, H, K, V, W = 2, 2, 4, 4, 4
    C = 2 * H * K + H * V

    def args(dtype):
        return (torch.randn(N, C, dtype=dtype), torch.randn(C, W), torch.zeros(N, C, W - 1),
                torch.randn(N, H, K, dtype=dtype), torch.zeros(H * K), torch.zeros(H), torch.randn(N, H, dtype=dtype),
                torch.zeros(N, H, K, V))

    want = kda_decode_step_cpu if native.available() else kda_decode_step
    assert registry.pick("kda_decode_step", *args(torch.float32), lower_bound=None) is want
    assert registry.pick("kda_decode_step", *args(torch.bfloat16), lower_bound=None) is kda_decode_step


def test_post_load_runs_each_hook_once_per_call():
    seen = []

    def hook(model):
        seen.append(model)

    registry.register_post_load("test", hook)
    registry.register_post_load("test", hook)  # registering twice keeps one hook
    try:
        registry.post_load("m")
        assert seen == ["m"]
    finally:
        registry._POST_LOAD[:] = [(b, h) for b, h in registry._POST_LOAD if h is not hook]
