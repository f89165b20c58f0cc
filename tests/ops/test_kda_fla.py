"""flash-linear-attention backends of "kda_chunk" / "kda_decode" (``ops/kda/fla.py``) equal the naive
recurrence: varlen odd lengths, fp32 initial states, decode with the state updated in place, a prefill cut at
snapshot positions. Skipped without fla (the plain install). On a CPU box fla's recurrent kernel runs under
Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``); ``chunk_kda`` needs a GPU (see fla.py for
why), so its tests run with ``K3SERVE_TEST_DEVICE=cuda`` (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("fla")

from k3serve.ops import registry  # noqa: E402
from k3serve.ops.kda import naive_kda_decode, naive_recurrent_kda  # noqa: E402
from k3serve.ops.kda.fla import fla_chunk_kda, fla_kda_decode, fla_recurrent_kda  # noqa: E402

from tests.ops.test_kda_split import check_split, kda_inputs  # noqa: E402

DEVICE = os.environ.get("K3SERVE_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("fla's kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("K3SERVE_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)
needs_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="fla chunk_kda does not run under Triton's interpreter")
PREFILL = [pytest.param(fla_recurrent_kda, id="recurrent"),
           pytest.param(fla_chunk_kda, id="chunk", marks=needs_gpu)]
# fla's chunk form sums in another order (and in tf32 dots on GPU) than the token loop
ATOL = {fla_recurrent_kda: 2e-5, fla_chunk_kda: 5e-3}


@pytest.mark.parametrize("fn", PREFILL)
@pytest.mark.parametrize("lens", [[37], [5, 23, 1, 17]])
def test_prefill_equals_naive(fn, lens):
    q, k, v, g, beta, cu, s0 = kda_inputs(lens)
    want_o, want_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    on = [t.to(DEVICE) for t in (q, k, v, g, beta, cu, s0)]
    o, s = fn(*on[:5], initial_state=on[6], cu_seqlens=on[5])
    assert s.dtype == torch.float32 and s.shape == want_s.shape
    assert torch.allclose(o.cpu(), want_o, atol=ATOL[fn]) and torch.allclose(s.cpu(), want_s, atol=ATOL[fn])


@pytest.mark.parametrize("fn", PREFILL)
def test_prefill_without_initial_state(fn):
    q, k, v, g, beta, cu, _ = kda_inputs([9, 20])
    want_o, want_s = naive_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu)
    o, s = fn(*(t.to(DEVICE) for t in (q, k, v, g, beta)), cu_seqlens=cu.to(DEVICE))
    assert torch.allclose(o.cpu(), want_o, atol=ATOL[fn]) and torch.allclose(s.cpu(), want_s, atol=ATOL[fn])


@pytest.mark.parametrize("fn", PREFILL)
def test_snapshot_split_equals_naive(fn):
    check_split(fn, [19, 5, 30], [16, 0, 29], device=DEVICE, atol=ATOL[fn])


def test_decode_equals_naive_in_place():
    q, k, v, g, beta, _, s0 = kda_inputs([1, 1, 1])
    q, k, v, g, beta = (t[0] for t in (q, k, v, g, beta))  # one token of each of 3 sequences
    want_o, want_s = naive_kda_decode(q, k, v, g, beta, s0)
    state = s0.to(DEVICE)
    o, s = fla_kda_decode(*(t.to(DEVICE) for t in (q, k, v, g, beta)), state, out_state=state)
    assert s.data_ptr() == state.data_ptr()
    assert torch.allclose(o.cpu(), want_o, atol=2e-5) and torch.allclose(state.cpu(), want_s, atol=2e-5)


def test_dispatch_picks_fla_for_cuda_only():
    q, k, v, g, beta, cu, s0 = kda_inputs([3])
    assert registry.pick("kda_chunk", q, k, v, g, beta) is not fla_chunk_kda
    assert registry.pick("kda_decode", q[0], k[0], v[0], g[0], beta[0], s0) is not fla_kda_decode
    if DEVICE == "cuda":
        qc = q.cuda()
        assert registry.pick("kda_chunk", qc, k, v, g, beta) is fla_chunk_kda
