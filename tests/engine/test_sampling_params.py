"""SamplingParams validation: every invalid value is one ValueError naming its field."""

from __future__ import annotations

import pytest

from k3serve import SamplingParams

BAD = [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("inf")), ("top_p", 0), ("top_p", 1.01),
    ("top_k", -2), ("top_k", 2.0), ("min_p", -0.1), ("min_p", 1.5), ("seed", 1.0), ("seed", "1"),
    ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]), ("max_tokens", 0), ("min_tokens", -1),
    ("ignore_eos", 1), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 1.0), ("temperature", True),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_invalid_value_names_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens:"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[7, 8], temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (7, 8) and p.greedy and not p.needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties
    seeds = {SamplingParams(seed=3, n=4).for_sample(i).seed for i in range(4)}
    assert len(seeds) == 4 and SamplingParams(n=4).for_sample(2).n == 1
