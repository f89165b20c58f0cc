"""Datasets: determinism, lengths, real shared prefixes (multi-turn and trace), text rendering, arrivals."""

from __future__ import annotations

import json
import math

import numpy as np

import pytest

from k3serve.bench.datasets import WORDS, DatasetConfig, build_dataset, parse_dataset, render_text
from k3serve.bench.runner import LoadConfig, arrival_schedule


def test_random_is_seeded_and_respects_lengths():
    cfg = DatasetConfig("random", num_prompts=50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=8,
                        vocab_size=300, seed=1)
    a, b = build_dataset(cfg), build_dataset(cfg)
    assert a == b and a != build_dataset(DatasetConfig("random", 50, 100, 20, 0.5, 8, vocab_size=300, seed=2))
    assert all(58 <= r.prompt_len <= 158 and 10 <= r.output_len <= 30 for r in a)  # prefix 8 + [50, 150]
    assert len({r.prompt_len for r in a}) > 10
    assert all(0 <= t < 300 for r in a for t in r.prompt_ids)
    assert len({tuple(r.prompt_ids[:8]) for r in a}) == 1 and len({tuple(r.prompt_ids[8:]) for r in a}) == 50
    assert build_dataset(DatasetConfig("random", 3, 10, 4))[0].prompt_len == 10
    assert len(build_dataset(DatasetConfig("random", input_len=1, output_len=1))) == 1000


def test_multiturn_prompts_extend_the_previous_turn():
    reqs = build_dataset(DatasetConfig("multiturn", num_prompts=7, input_len=6, output_len=4, turns=3,
                                       prefix_len=5))
    # 3 sessions, turn-major order, truncated to 7: s0t0 s1t0 s2t0 s0t1 s1t1 s2t1 s0t2
    assert [r.after for r in reqs] == [None, None, None, 0, 1, 2, 3]
    for r in reqs:
        if r.after is not None:
            prev = reqs[r.after]
            assert r.prompt_ids[: prev.prompt_len] == prev.prompt_ids  # a real shared prefix
            assert r.prompt_len == prev.prompt_len + prev.output_len + 6
            assert [role for role, _ in r.turns][-2:] == ["assistant", "user"]
    assert {tuple(r.prompt_ids[:5]) for r in reqs} == {tuple(reqs[0].turns[0][1])}  # the system prompt
    assert reqs[0].turns[0][0] == "system"


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


TRACE = [{"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 3]},
         {"timestamp": 1500, "input_length": 1030, "output_length": 0, "hash_ids": [1, 2, 4]},
         {"timestamp": 2750, "input_length": 300, "output_length": 5, "hash_ids": [9]}]


def test_trace_hash_ids_map_to_fixed_token_blocks(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", TRACE)
    a, b, c = build_dataset(DatasetConfig("trace", trace_path=path, seed=5))
    assert (a.prompt_len, b.prompt_len, c.prompt_len) == (1100, 1030, 300)
    assert a.prompt_ids[:1024] == b.prompt_ids[:1024]  # hash ids 1, 2 shared
    assert a.prompt_ids[1024:1030] != b.prompt_ids[1024:1030]
    assert (a.output_len, b.output_len) == (7, 1)  # max_tokens >= 1
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, 0.5, 1.75)
    again = build_dataset(DatasetConfig("trace", trace_path=path, seed=5, num_prompts=1))
    assert len(again) == 1 and again[0] == a
    other_seed = build_dataset(DatasetConfig("trace", trace_path=path, seed=6))[0]
    assert other_seed.prompt_ids != a.prompt_ids


def test_trace_output_len_replaces_the_records_lengths(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", TRACE)
    assert [r.output_len for r in build_dataset(DatasetConfig("trace", trace_path=path, output_len=16))] == [16] * 3
    assert [r.output_len for r in build_dataset(DatasetConfig("trace", trace_path=path))] == [7, 1, 5]
    assert build_dataset(DatasetConfig("random", 2, 4))[0].output_len == 128  # the synthetic default


def test_trace_block_size_shrinks_prompts_and_keeps_sharing(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", TRACE)
    a, b, c = build_dataset(DatasetConfig("trace", trace_path=path, trace_block_size=32))
    # 1100 = 2*512 + 76 -> 2*32 + round(76/16); 1030 -> 64 + round(6/16)=0 -> at least 1; 300 -> round(18.75)
    assert (a.prompt_len, b.prompt_len, c.prompt_len) == (64 + 5, 64 + 1, 19)
    assert a.prompt_ids[:64] == b.prompt_ids[:64] and a.prompt_ids[64] != b.prompt_ids[64]


def test_mooncake_trace_replays_whole(mooncake_trace):
    reqs = build_dataset(DatasetConfig("trace", trace_path=str(mooncake_trace), num_prompts=200,
                                       trace_block_size=16))
    assert len(reqs) == 200
    first = {}
    reused = 0
    for r in reqs:
        key = tuple(r.prompt_ids[:16])
        reused += key in first
        first.setdefault(key, r)
    assert reused > 50  # the trace's prefix reuse survives the mapping (127 of 200 share a first block)
    assert all(r.arrival_s is not None for r in reqs) and reqs[0].arrival_s == 0.0  # rebased to the first
    assert reqs[-1].arrival_s == pytest.approx((1_022_025 - 973_362) / 1000)


def test_bad_specs_and_configs():
    assert parse_dataset("random") == ("random", None)
    assert parse_dataset("trace:/x/y.jsonl") == ("trace", "/x/y.jsonl")
    for bad in ("sharegpt", "random:x", "trace", "trace:"):
        with pytest.raises(ValueError, match="dataset"):
            parse_dataset(bad)
    with pytest.raises(ValueError, match="--range-ratio"):
        DatasetConfig("random", range_ratio=1.0)
    with pytest.raises(ValueError, match="--num-prompts"):
        DatasetConfig("random", num_prompts=0)
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        build_dataset(DatasetConfig("trace", trace_path="/nonexistent/trace.jsonl"))


def test_each_word_is_one_kimi_token():
    tok = pytest.importorskip("k3serve.tokenizer").Tokenizer.kimi("k3")
    assert all(len(tok.encode(" " + w)) == 1 for w in WORDS)
    ids = list(np.random.default_rng(0).integers(0, 2048, 500))
    assert len(tok.encode(render_text(ids))) == 500
    # a shared id prefix is a shared token prefix
    a, b = tok.encode(render_text(ids[:300] + [1, 2])), tok.encode(render_text(ids[:300] + [7]))
    assert list(a[:300]) == list(b[:300])


def test_arrivals():
    reqs = build_dataset(DatasetConfig("random", num_prompts=4000, input_len=1, output_len=1))
    assert arrival_schedule(reqs, LoadConfig()) == [0.0] * 4000
    poisson = arrival_schedule(reqs, LoadConfig(request_rate=20.0, seed=3))
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05) and gaps.std() == pytest.approx(1 / 20, rel=0.1)
    assert poisson == arrival_schedule(reqs, LoadConfig(request_rate=20.0, seed=3))
    regular = np.diff(arrival_schedule(reqs, LoadConfig(request_rate=20.0, burstiness=50.0)))
    assert regular.mean() == pytest.approx(1 / 20, rel=0.05) and regular.std() < 0.2 * gaps.std()
    with pytest.raises(ValueError, match="--request-rate"):
        LoadConfig(request_rate=0.0)


def test_trace_timestamps_drive_arrivals_unless_a_rate_is_given(tmp_path):
    reqs = build_dataset(DatasetConfig("trace", trace_path=write_trace(tmp_path / "t.jsonl", TRACE)))
    assert arrival_schedule(reqs, LoadConfig()) == [0.0, 0.5, 1.75]
    assert arrival_schedule(reqs, LoadConfig(time_scale=0.5)) == [0.0, 0.25, 0.875]
    assert arrival_schedule(reqs, LoadConfig(request_rate=math.inf)) == [0.0] * 3
