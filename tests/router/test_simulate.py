import json

import numpy as np
import pytest

from k3serve.core.kv_events import BlockRemoved, BlockStored, SnapshotRemoved, SnapshotStored
from k3serve.router.cache_model import ReplicaCache, ideal_hits
from k3serve.router.prefix_index import PrefixIndex, SnapshotRule
from k3serve.router.simulate import SimConfig, simulate
from k3serve.router.trace import TraceRequest, load_trace, scale_trace


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rec(ms, n_in, n_out, ids):
    return {"timestamp": ms, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_cache_evicts_chain_tails_first_and_reports_events():
    cache = ReplicaCache(capacity_blocks=3, block_tokens=512)
    b1 = cache.insert([1, 2], [2], now=0.0)
    assert b1.seq == 0
    assert b1.events == (BlockStored((1, 2), None, 1024), SnapshotStored(2, 1024))
    cache.insert([3], [1], now=1.0)
    b3 = cache.insert([4], [1], now=2.0)  # over capacity: the tail of the oldest chain (2) goes first
    assert b3.seq == 2
    assert b3.events[-2:] == (SnapshotRemoved(2), BlockRemoved((2,)))
    assert cache.lookup([1, 2]) == (1, 0)  # MLA block 1 still cached, but no snapshot at depth 1
    assert cache.lookup([4]) == (1, 1)


def test_cache_events_keep_the_index_equal_to_the_cache():
    cache = ReplicaCache(capacity_blocks=5, block_tokens=512)
    index = PrefixIndex(512)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in np.cumsum(rng.integers(1, 3, size=rng.integers(1, 5)))] for _ in range(40)]
    for p in prompts:
        mla, _ = cache.lookup(p)
        index.apply(0, cache.insert(p, SnapshotRule(2).depths(len(p), mla), 0.0))
    for p in prompts:
        mla, usable = cache.lookup(p)
        assert index.match_depths(p).get(0, (0, 0)) == (mla, usable)


def test_simulator_metrics_on_a_hand_made_trace(tmp_path):
    # one replica; block = 512 tokens; prefill = 0.02 s + uncached tokens / 10,000 tok/s
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [
        rec(0, 1024, 2, [1, 2]),        # A: cold, 1024 tokens -> TTFT 0.1224; snapshot at its end (2)
        rec(1000, 1536, 2, [1, 2, 3]),  # B: resumes at A's end, 512 left -> 0.0712; snapshot at 3
        rec(2000, 1124, 2, [1, 4, 5]),  # C: shares block 1 but no snapshot at 1 -> all 1124 -> 0.1324;
                                        #    leaves a branch snapshot at 1
        rec(3000, 600, 2, [1, 6]),      # D: resumes at C's branch snapshot, 88 left -> 0.0288
    ]))
    cfg = SimConfig(replicas=1, cache_blocks=100, state_interval=0)
    r = simulate(trace, cfg, "kv")
    ttft = [0.1224, 0.0712, 0.1324, 0.0288]
    assert r.hit_rate == pytest.approx(3 / 10)  # 0 + 2 + 0 + 1 of 2 + 3 + 3 + 2 blocks
    assert r.ideal_hit_rate == pytest.approx(3 / 10)
    assert r.ttft_p50_s == pytest.approx(np.percentile(ttft, 50))
    assert r.ttft_p99_s == pytest.approx(np.percentile(ttft, 99))
    assert r.load_max_over_mean == 1.0 and r.requests_per_replica == [4]
    # without branch snapshots D finds no snapshot at depth 1
    r = simulate(trace, SimConfig(replicas=1, cache_blocks=100, state_interval=0, branch_snapshots=False), "kv")
    assert r.hit_rate == pytest.approx(2 / 10)


def test_simulator_queueing_and_load_on_two_replicas(tmp_path):
    # three identical 1024-token prompts at t=0 on 2 replicas, round robin: r0 gets #0 and #2.
    # #2 waits for #0 (0.1224 s), then hits both blocks: 1 token to compute -> 0.0201 s more.
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [rec(0, 1024, 1, [1, 2])] * 3))
    r = simulate(trace, SimConfig(replicas=2, cache_blocks=10, state_interval=0), "round_robin")
    assert r.requests_per_replica == [2, 1]
    assert r.load_max_over_mean == pytest.approx(2 / 1.5)
    assert r.hit_rate == pytest.approx(2 / 6)
    assert r.ttft_p50_s == pytest.approx(0.1224)
    assert r.ttft_p99_s == pytest.approx(np.percentile([0.1224, 0.1224, 0.1224 + 0.0201], 99))
    assert r.prefill_tokens_max_over_mean == pytest.approx(1025 / 1024.5)


def test_kv_keeps_a_prefix_family_together(tmp_path):
    rows = [rec(i * 5000, 2048, 1, [1, 2, 3, 10 + i]) for i in range(6)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    kv = simulate(trace, SimConfig(replicas=3, cache_blocks=50, state_interval=0), "kv")
    rr = simulate(trace, SimConfig(replicas=3, cache_blocks=50, state_interval=0), "round_robin")
    # after the first two (the second leaves the branch snapshot at 3), every request reuses 3 blocks
    assert kv.hit_rate == pytest.approx(3 * 4 / 24)
    assert kv.ideal_hit_rate == pytest.approx(3 * 4 / 24)
    assert rr.hit_rate < kv.hit_rate


def test_ideal_hits_and_scaling():
    rule = SnapshotRule(interval=0)
    assert ideal_hits([[1, 2], [1, 2, 3], [1, 4]], rule) == (2, 7)
    reqs = [TraceRequest(0.0, 512, 1, (0,)), TraceRequest(2.0, 1024, 1, (0, 1))]
    scaled = scale_trace(reqs, repeat=2, time_scale=0.5)
    assert [r.arrival_s for r in scaled] == [0.0, 1.0, 2.0, 3.0]
    assert [r.block_ids for r in scaled] == [(0,), (0, 1), (2,), (2, 3)]
    with pytest.raises(ValueError):
        scale_trace(reqs, repeat=0)


@pytest.mark.parametrize("line, field", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "timestamp"),
    ('{"input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "timestamp"),
    ("not json", ":1:"),
])
def test_bad_trace_lines_name_the_problem(tmp_path, line, field):
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(ValueError, match=field):
        load_trace(p)


def test_sim_config_validation():
    with pytest.raises(ValueError):
        SimConfig(replicas=0, cache_blocks=1)
    with pytest.raises(ValueError):
        SimConfig(replicas=1, cache_blocks=1, prefill_tokens_per_s=0)
