"""State hand-off is exact: prefill N then decode N+1 equals a prefill of N+1, for every layer kind, and any
split of a prefill into chunks equals the whole prefill (fp32)."""

from __future__ import annotations

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.models.generate import SimpleRunner, greedy_generate
from k3serve.models.kimi import build_model
from k3serve.models.registry import packaged_config
from k3serve.models.writer import init_random_

CONFIGS = ["k3-tiny", "kimi-linear-tiny", "k3-tiny-grouped"]


@pytest.fixture(scope="module", params=CONFIGS)
def model(request):
    cfg = ModelConfig.from_file(packaged_config(request.param))
    m = init_random_(build_model(cfg), seed=0).eval()
    assert {"kda", "mla"} <= set(cfg.text.layer_kinds)
    return m


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("n", [1, 16, 37, 70])
def test_prefill_then_decode_equals_longer_prefill(model, n):
    ids = _ids(n + 1, n)
    whole = SimpleRunner(model, max_seqs=1, max_len=n + 1).step({0: ids})
    runner = SimpleRunner(model, max_seqs=1, max_len=n + 1)
    runner.step({0: ids[:n]})
    last = runner.step({0: ids[n:]})
    torch.testing.assert_close(last, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [(5,), (16, 32), (1, 2, 3, 50)])
def test_chunked_prefill_equals_whole(model, splits):
    ids = _ids(64, 7)
    whole = SimpleRunner(model, max_seqs=1, max_len=64).step({0: ids})
    runner = SimpleRunner(model, max_seqs=1, max_len=64)
    bounds = [0, *splits, 64]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out = runner.step({0: ids[a:b]})
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)


def test_mixed_batch_of_prefill_and_decode_equals_alone(model):
    a, b = _ids(30, 1), _ids(12, 2)
    alone_a = greedy_generate(model, [a], 6)[0]
    alone_b = greedy_generate(model, [b], 6)[0]
    runner = SimpleRunner(model, max_seqs=2, max_len=40)
    # sequence 0 is already decoding while sequence 1 prefills in the same packed step
    la = runner.step({0: a})
    out_a = [int(la.argmax())]
    mixed = runner.step({0: [out_a[-1]], 1: b})
    out_a.append(int(mixed[0].argmax()))
    out_b = [int(mixed[1].argmax())]
    for _ in range(4):
        step = runner.step({0: [out_a[-1]], 1: [out_b[-1]]})
        out_a.append(int(step[0].argmax()))
        out_b.append(int(step[1].argmax()))
    assert out_a == alone_a[:6]
    assert out_b == alone_b[:5]
