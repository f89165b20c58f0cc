"""Acceptance 2 through the engine: at temperature > 0 the tokens emitted under speculation (draft_model and
eagle3) are distributed as without it. N requests of one prompt run with speculation off and on; the second
and third output tokens (the first comes from the prefill; these come from verify rows: accepted drafts,
residual draws and bonus tokens) are compared, conditioned on the most frequent preceding tokens, by a
two-sample chi-square test of homogeneity. Each check's false-alarm rate is ALPHA = 1e-3; the control (a
different temperature) must be rejected, so the test can fail."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from k3serve.engine.sampling_params import SamplingParams
from tests.engine.spec_parity import random_head, spec

ALPHA = 1e-3
N = 1500
PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]
TARGET = "k3-tiny-random"


def _samples(eh, model, config, temperature=0.9) -> list[list[int]]:
    cfg = {"max_num_seqs": 64, "kv_cache_memory": 64 * 2**20, "max_model_len": 64}
    engine = eh.make_engine(model, speculative_config=config, **cfg)
    params = SamplingParams(temperature=temperature, top_k=5, max_tokens=3, ignore_eos=True)
    for i in range(N):
        engine.add_request(str(i), PROMPT, params)
    out = [o.token_ids for o in eh.drain(engine).values()]
    if config is not None:
        assert engine.scheduler.num_draft_tokens > 0
    return out


def _p_homogeneous(a: list[int], b: list[int]) -> float:
    """P-value of Pearson's chi-square test that samples ``a`` and ``b`` come from one distribution."""
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb))
    table = torch.tensor([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = len(keys) - 1
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def _checks(off, on) -> list[float]:
    """P-values: token 2 given the most frequent token 1, token 3 given the most frequent (token 1, token 2)."""
    t1 = Counter(o[0] for o in off).most_common(1)[0][0]
    t12 = Counter(tuple(o[:2]) for o in off).most_common(1)[0][0]
    return [_p_homogeneous([o[1] for o in off if o[0] == t1], [o[1] for o in on if o[0] == t1]),
            _p_homogeneous([o[2] for o in off if tuple(o[:2]) == t12], [o[2] for o in on if tuple(o[:2]) == t12])]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_temperature_sampling_keeps_the_distribution(eh, method, tmp_path):
    model = eh.get_model(TARGET)
    head = random_head(model, tmp_path / "head") if method == "eagle3" else None
    torch.manual_seed(0)
    off = _samples(eh, model, None)
    on = _samples(eh, model, spec(method, 3, draft=TARGET, head=head, max_running=64))
    assert min(_checks(off, on)) > ALPHA
    if method == "draft_model":  # the control: another temperature is told apart
        assert min(_checks(off, _samples(eh, model, None, temperature=0.2))) < ALPHA
