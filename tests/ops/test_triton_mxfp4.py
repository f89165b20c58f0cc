"""The Triton MXFP4 expert combine (``ops/moe/triton_mxfp4.py``) equals the naive per-token spec on odd shapes:
token counts off the tile size, idle experts, a hidden width off the K step, skewed routing, both activations,
fp32 and bf16, MXFP8 activation fake-quant. On a CPU box it runs under Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py when no GPU is present); without triton (the plain install)
it is skipped. ``K3SERVE_TEST_DEVICE=cuda`` runs it on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from k3serve.ops import registry  # noqa: E402
from k3serve.ops.activation import GatedActivation  # noqa: E402
from k3serve.ops.moe import mxfp4_expert_combine, naive_mxfp4_expert_combine  # noqa: E402
from k3serve.ops.moe.triton_mxfp4 import expert_tiles, triton_mxfp4_expert_combine  # noqa: E402
from k3serve.ops.mx import mxfp4_quantize  # noqa: E402

DEVICE = os.environ.get("K3SERVE_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("K3SERVE_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

SITU = GatedActivation("situ", 4.0, 25.0)


def _case(N, E, k, D, I, seed, idle=(), skew=False):
    g = torch.Generator().manual_seed(seed)
    live = [e for e in range(E) if e not in idle]
    u = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.tensor(live)[torch.randperm(len(live), generator=g)[:k]] for _ in range(N)])
    if skew:
        ids[:, 0] = live[0]
    weights = torch.rand(N, k, generator=g)
    w13 = mxfp4_quantize(torch.randn(E, 2 * I, D, generator=g) / D**0.5)
    w2 = mxfp4_quantize(torch.randn(E, D, I, generator=g) / I**0.5)
    return u, weights, ids, *w13, *w2


def _on(device, *ts):
    return [t.to(device) for t in ts]


@pytest.mark.parametrize("N,E,k,D,I,idle,skew", [
    (1, 4, 1, 32, 32, (), False),            # one token: one tile, every other tile empty
    (13, 5, 2, 96, 64, (4,), False),         # 26 rows over 4 live experts; D = 96 ends mid K step
    (37, 8, 3, 64, 96, (0, 5, 6), True),     # skew: one expert's run spans several tiles
])
@pytest.mark.parametrize("glu", [GatedActivation("silu"), SITU], ids=["silu", "situ"])
def test_triton_equals_naive_fp32(N, E, k, D, I, idle, skew, glu):
    u, w, ids, p13, s13, p2, s2 = _case(N, E, k, D, I, seed=N + E, idle=idle, skew=skew)
    want = naive_mxfp4_expert_combine(u, w, ids, p13, s13, p2, s2, glu)
    got = triton_mxfp4_expert_combine(*_on(DEVICE, u, w, ids, p13, s13, p2, s2), glu).cpu()
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert float((got - want).abs().max()) < 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("act_quant", [None, "rceil"])
def test_triton_equals_torch_form_bf16(act_quant):
    """bf16: the torch form rounds h and a to bf16 between its GEMMs, the kernel keeps the fp32 accumulators
    through the activation: equal to bf16 precision."""
    u, w, ids, p13, s13, p2, s2 = _case(19, 6, 2, 64, 64, seed=3, idle=(2,))
    u = u.bfloat16()
    want = mxfp4_expert_combine(u, w, ids, p13, s13, p2, s2, SITU, act_quant=act_quant)
    ref = naive_mxfp4_expert_combine(u, w, ids, p13, s13, p2, s2, SITU, act_quant=act_quant)
    got = triton_mxfp4_expert_combine(*_on(DEVICE, u, w, ids, p13, s13, p2, s2), SITU, act_quant=act_quant).cpu()
    for other in (want, ref):
        assert float((got - other).norm() / other.norm()) < 2e-2


def test_act_quant_fp32_equals_naive():
    u, w, ids, p13, s13, p2, s2 = _case(9, 4, 2, 64, 32, seed=5)
    want = naive_mxfp4_expert_combine(u, w, ids, p13, s13, p2, s2, SITU, act_quant="floor")
    got = triton_mxfp4_expert_combine(*_on(DEVICE, u, w, ids, p13, s13, p2, s2), SITU, act_quant="floor").cpu()
    # fake-quantised a can flip one MXFP8 step where the fp32 sums differ in the last bit
    assert float((got - want).norm() / want.norm()) < 1e-3


def test_expert_tiles_cover_each_run_once():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [3, 2], [3, 1]])  # expert 3: 5 rows, experts 4..6 idle
    order, e, lo, hi = expert_tiles(ids, 7, block_m=2)
    flat = ids.reshape(-1)[order]
    assert e.numel() == min(10, 5 + 7)
    seen = []
    for t in range(e.numel()):
        rows = list(range(int(lo[t]), int(hi[t])))
        assert len(rows) <= 2 and all(int(flat[r]) == int(e[t]) for r in rows)
        seen += rows
    assert sorted(seen) == list(range(10))


def test_registered_for_cuda_only():
    """Dispatch never picks the kernel for CPU tensors; forcing it runs it (here: the interpreter)."""
    u, w, ids, p13, s13, p2, s2 = _case(5, 4, 2, 32, 32, seed=9)
    assert "triton" in registry.backends("mxfp4_expert_combine")
    fn = registry.pick("mxfp4_expert_combine", u, w, ids, p13, s13, p2, s2, SITU)
    assert fn is not triton_mxfp4_expert_combine
    if DEVICE == "cpu":
        with registry.use("mxfp4_expert_combine", "triton"):
            got = registry.get("mxfp4_expert_combine")(u, w, ids, p13, s13, p2, s2, SITU)
        want = naive_mxfp4_expert_combine(u, w, ids, p13, s13, p2, s2, SITU)
        assert float((got - want).norm() / want.norm()) < 1e-5


def test_refuses_a_plain_function():
    u, w, ids, p13, s13, p2, s2 = _case(2, 2, 1, 32, 32, seed=1)
    with pytest.raises(ValueError, match="GatedActivation"):
        triton_mxfp4_expert_combine(u, w, ids, p13, s13, p2, s2, lambda a, b: a * b)
