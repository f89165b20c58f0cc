"""Through the HTTP app, concurrent greedy completions with prefix caching and preemption on give the same
tokens with the engine split over processes (gloo on CPU) as in one process: tensor parallel 2 and 4 (rank 0
broadcasts every step; each rank holds its shard: heads, vocabulary, MoE width), tensor + expert parallel 2
(whole experts spread over the ranks) and 2 data-parallel replicas."""

from __future__ import annotations

import asyncio

import pytest

from tests.distributed.conftest import complete_all, serving

# each layout starts engine processes that load the model: ~15 s alone, minutes on a loaded 2-core box
pytestmark = pytest.mark.slow


def test_single_process_baseline_preempts_and_hits_the_prefix_cache(single_process_outputs):
    outs, stats = single_process_outputs
    assert all(len(o) == 8 for o in outs)
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0, stats


@pytest.mark.parametrize("layout", [{"tp": 2}, {"dp": 2}, {"tp": 4}, {"tp": 2, "dp": 2}, {"tp": 2, "ep": True}],
                         ids=["tp2", "dp2", "tp4", "tp2dp2", "tp2ep2"])
def test_parallel_layout_matches_one_process(single_process_outputs, layout):
    async def run():
        async with serving(**layout) as (http, state):
            outs = await complete_all(http)
            return outs, state.client.stats

    outs, stats = asyncio.run(run())
    assert outs == single_process_outputs[0]
    if "tp" in layout:  # one scheduler sees the same workload as the single process
        assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0, stats
