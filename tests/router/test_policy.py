from collections import Counter

import numpy as np
import pytest

from k3serve.router.policy import (
    POLICIES,
    KVPolicy,
    LeastLoad,
    PolicyConfig,
    ReplicasView,
    RequestView,
    RoundRobin,
    SessionAffinity,
    make_policy,
)


def view(overlap, pending, decode, cached=None, mla=None, ids=None):
    n = len(overlap)
    return ReplicasView(
        ids=np.array(ids if ids is not None else range(n)),
        overlap=np.array(overlap),
        mla_overlap=np.array(mla if mla is not None else overlap),
        pending_prefill_blocks=np.array(pending),
        decode_blocks=np.array(decode),
        cached_blocks=np.array(cached if cached is not None else [0] * n),
    )


def test_kv_reproduces_dynamos_worked_example():
    # Dynamo docs: 10-block request, cached 2/5/8 -> prefill 8/5/2, decode 10/5/9 -> costs 18/10/11 -> worker 1
    policy = KVPolicy(PolicyConfig(weight=1.0, cache_weight=0.0))
    v = view(overlap=[2, 5, 8], pending=[0, 0, 0], decode=[10, 5, 9])
    assert policy.costs(RequestView(10), v).tolist() == [18, 10, 11]
    assert policy.choose(RequestView(10), v) == 1


def test_kv_counts_queued_prefill_so_a_hot_prefix_spills_over():
    policy = KVPolicy(PolicyConfig(weight=1.0, cache_weight=0.0))
    hot = view(overlap=[8, 0], pending=[0, 0], decode=[0, 0])
    assert policy.choose(RequestView(10), hot) == 0
    swamped = view(overlap=[8, 0], pending=[30, 0], decode=[0, 0])  # 30 blocks queued ahead on replica 0
    assert policy.choose(RequestView(10), swamped) == 1


def test_kv_hybrid_overlap_and_cache_term():
    # both replicas hold 6 MLA blocks, only replica 1 has a snapshot (at 4): usable 0 vs 4
    req = RequestView(10)
    v = view(overlap=[0, 4], mla=[6, 6], pending=[0, 0], decode=[0, 0])
    assert KVPolicy().choose(req, v) == 1
    # replica 0 holds the MLA prefix (no snapshot), replica 1 nothing: prefill is equal, the cache term
    # prefers not to duplicate the prefix; with cache_weight 0 it is a tie broken by free cache
    v = view(overlap=[0, 0], mla=[6, 0], pending=[0, 0], decode=[0, 0], cached=[100, 10])
    assert KVPolicy(PolicyConfig(cache_weight=1.0)).choose(req, v) == 0
    assert KVPolicy(PolicyConfig(cache_weight=0.0)).choose(req, v) == 1


def test_kv_temperature_samples_in_proportion():
    policy = KVPolicy(PolicyConfig(weight=1.0, cache_weight=0.0, temperature=1.0, seed=3))
    v = view(overlap=[0, 10], pending=[0, 0], decode=[0, 0])  # normalised costs 1 and 0
    picks = Counter(policy.choose(RequestView(10), v) for _ in range(4000))
    p1 = picks[1] / 4000
    assert abs(p1 - 1 / (1 + np.exp(-1))) < 0.03  # exp(0) / (exp(0) + exp(-1)) = 0.731
    cold = KVPolicy(PolicyConfig(weight=1.0, cache_weight=0.0, temperature=0.01, seed=3))
    assert {cold.choose(RequestView(10), v) for _ in range(100)} == {1}


def test_ids_are_returned_not_positions():
    v = view(overlap=[0, 5], pending=[0, 0], decode=[0, 0], ids=[7, 3])
    assert KVPolicy().choose(RequestView(10), v) == 3


def test_round_robin_and_least_load():
    rr = RoundRobin()
    v = view(overlap=[9, 0, 0], pending=[0, 0, 0], decode=[0, 0, 0])
    assert [rr.choose(RequestView(1), v) for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoad()
    v = view(overlap=[9, 0, 0], pending=[5, 1, 0], decode=[0, 3, 2])
    assert ll.choose(RequestView(1), v) == 2
    tied = view(overlap=[0, 0], pending=[0, 0], decode=[0, 0])
    assert {ll.choose(RequestView(1), tied) for _ in range(4)} == {0, 1}


def test_session_affinity_sticks_and_falls_back():
    s = SessionAffinity()
    v = view(overlap=[0, 0, 9], pending=[0, 0, 0], decode=[0, 0, 0])
    assert s.choose(RequestView(10, "alice"), v) == 2  # new session: kv picks the cached replica
    moved = view(overlap=[9, 0, 0], pending=[0, 0, 0], decode=[0, 0, 0])
    assert s.choose(RequestView(10, "alice"), moved) == 2  # sticks despite the cache now elsewhere
    assert s.choose(RequestView(10), moved) == 0  # no header: kv
    gone = view(overlap=[0, 0], pending=[0, 0], decode=[0, 5], ids=[0, 1])  # replica 2 not routable
    assert s.choose(RequestView(10, "alice"), gone) == 0
    assert s.choose(RequestView(10, "alice"), moved) == 0  # rebound


def test_registry_and_validation():
    assert set(POLICIES) == {"kv", "round_robin", "least_load", "session"}
    assert make_policy("kv").name == "kv"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        PolicyConfig(weight=-1)
    with pytest.raises(ValueError):
        PolicyConfig(temperature=float("nan"))
    with pytest.raises(ValueError):
        view(overlap=[1], pending=[1, 2], decode=[0])
