"""CUDA-graph decode (``engine/cuda_graphs.py``): buckets, the one-line refusals, and on a GPU replay == eager at
every captured batch size including 1, for a decode step made of the KDA decode step (conv and recurrent
states updated in place) and the Triton MXFP4 expert combine. The GPU part runs only with
``K3SERVE_TEST_DEVICE=cuda`` (benchmarks/gpu_check.sh); it has never run on this project's CPU machines."""

from __future__ import annotations

import os

import pytest
import torch

from k3serve.engine.cuda_graphs import DecodeGraphs, buckets, check_cuda_graphs

ON_GPU = os.environ.get("K3SERVE_TEST_DEVICE") == "cuda" and torch.cuda.is_available()


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        buckets(0)


def test_refused_off_cuda_in_one_line():
    with pytest.raises(ValueError, match=r"^cuda_graphs: needs a CUDA device, got 'cpu'"):
        check_cuda_graphs("cpu")
    with pytest.raises(ValueError, match="cuda_graphs"):
        DecodeGraphs(lambda x: x, lambda b: [torch.zeros(b)], 4, "cpu")


H, K, W, E, TOPK, D, I = 2, 32, 4, 6, 2, 64, 64


def _decode_inputs(b: int, seed: int = 0) -> list[torch.Tensor]:
    """One decode token of b sequences: pre-conv q|k|v, conv state, gate and beta logits, KDA state (fp32), and
    the MoE input, routing weights and ids. Rows are the same for every b (row i from seed + i)."""
    rows = []
    for i in range(b):
        g = torch.Generator().manual_seed(seed + i)
        rows.append([torch.randn(3 * H * K, generator=g), torch.randn(3 * H * K, W - 1, generator=g),
                     torch.randn(H, K, generator=g), torch.randn(H, generator=g),
                     torch.randn(H, K, K, generator=g) * 0.1, torch.randn(D, generator=g),
                     torch.rand(TOPK, generator=g), torch.randperm(E, generator=g)[:TOPK]])
    return [torch.stack(col) for col in zip(*rows)]


@pytest.mark.skipif(not ON_GPU, reason="needs K3SERVE_TEST_DEVICE=cuda and a GPU")
def test_replay_equals_eager_at_every_bucket():
    pytest.importorskip("triton")
    from k3serve.ops import registry
    from k3serve.ops.activation import GatedActivation
    from k3serve.ops.mx import mxfp4_quantize

    dev = "cuda"
    g = torch.Generator().manual_seed(7)
    conv_w = (torch.randn(3 * H * K, W, generator=g) * 0.3).to(dev)
    dt_bias, a_log = torch.randn(H * K, generator=g).to(dev), torch.randn(H, generator=g).to(dev)
    p13, s13 = (t.to(dev) for t in mxfp4_quantize(torch.randn(E, 2 * I, D, generator=g) / D**0.5))
    p2, s2 = (t.to(dev) for t in mxfp4_quantize(torch.randn(E, D, I, generator=g) / I**0.5))
    glu = GatedActivation("situ", 4.0, 25.0)
    step_op, combine = registry.get("kda_decode_step"), registry.get("mxfp4_expert_combine")

    def step(qkv, conv_state, f, b, state, u, w, ids):
        o = step_op(qkv, conv_w, conv_state, f, dt_bias, a_log, b, state, lower_bound=-5.0)
        return torch.cat([o.reshape(o.shape[0], -1), combine(u, w, ids, p13, s13, p2, s2, glu)], dim=1)

    graphs = DecodeGraphs(step, _decode_inputs, 8, dev)
    assert graphs.sizes == [1, 2, 4, 8]
    for B in (1, 2, 3, 4, 5, 8):
        eager_in = [t.to(dev) for t in _decode_inputs(B, seed=100 + B)]
        graph_in = [t.clone() for t in eager_in]
        want = step(*eager_in)
        got = graphs(*graph_in).clone()
        after = graphs.static_inputs(B)
        exact = B in graphs.sizes  # same shapes as eager: the same kernels, so the same bits
        for name, x, y in [("out", got, want), ("conv_state", after[1], eager_in[1]), ("state", after[4], eager_in[4])]:
            if exact:
                assert torch.equal(x, y), f"B={B} {name}"
            else:  # padded to the bucket: other launch shapes may sum in another order
                assert torch.allclose(x, y, atol=1e-5, rtol=1e-5), f"B={B} {name}"
