"""`k3serve bench` end to end against the fake streaming server (conftest.py): the JSON aggregates agree with
a recomputation from the raw timestamps, and the timestamps agree with the server's known timing."""

from __future__ import annotations

import json

import pytest

from k3serve.cli import main

SLACK_S = 0.5  # scheduling noise allowed on a shared 2-core machine


def bench(tmp_path, url: str, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    rc = main(["bench", "--base-url", url, "--disable-tqdm", "--result-file", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def test_json_matches_raw_timestamps_and_server_timing(fake_server, tmp_path, recompute):
    srv = fake_server.reset(ttft_s=0.06, itl_s=0.02)
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "6", "--input-len", "12", "--output-len", "5",
                    "--max-concurrency", "3", "--goodput", "ttft:200", "tpot:10", "--metric-percentiles", "50,99")
    assert rc == 0 and res["completed"] == 6 and res["failed"] == 0
    want = recompute(res, {"ttft": 200, "tpot": 10})
    for key, value in want.items():
        assert res[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # tpot SLO 10 ms < the server's 20 ms token gap: no request is good
    assert res["request_goodput"] == 0.0
    for r in res["requests"]:
        assert r["output_tokens"] == 5 and r["output_tokens_from"] == "usage" and len(r["chunk_s"]) == 5
        assert r["input_tokens"] == 12
        ttft = r["chunk_s"][0] - r["send_s"]
        assert 0.06 <= ttft < 0.06 + SLACK_S  # the server waits 60 ms after the request arrives
        assert r["end_s"] - r["send_s"] >= 0.06 + 4 * 0.02
        assert r["send_s"] >= r["scheduled_s"]
    # the server sends chunk k at arrival + 60 ms + k * 20 ms: on average 20 ms apart, plus client noise
    assert 15 <= res["mean_itl_ms"] <= 50 and 15 <= res["mean_tpot_ms"] <= 50
    # every request is sent in order: 3 slots, 6 requests -> the server never sees more than 3 at once
    assert srv.state.peak_in_flight == 3 == res["max_concurrent_requests"]
    assert res["total_output_tokens"] == 30 and res["total_input_tokens"] == 72


def test_request_bodies_are_token_ids_with_usage_and_ignore_eos(fake_server, tmp_path):
    srv = fake_server.reset()
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "3", "--input-len", "7", "--output-len", "2",
                    "--prefix-len", "4", "--seed", "3")
    assert rc == 0
    probe, *bodies = srv.state.bodies  # the first request is the preflight probe (max_tokens 1)
    assert probe["max_tokens"] == 1 and res["model_id"] == "fake-model"
    for b in bodies:
        assert b["model"] == "fake-model" and b["stream"] is True and b["ignore_eos"] is True
        assert b["stream_options"] == {"include_usage": True} and b["max_tokens"] == 2
        assert len(b["prompt"]) == 11 and all(isinstance(t, int) and 0 <= t < 2048 for t in b["prompt"])
    assert len({tuple(b["prompt"][:4]) for b in bodies}) == 1  # the shared prefix
    assert len({tuple(b["prompt"]) for b in bodies}) == 3


def test_usage_counts_tokens_when_chunks_hold_several(fake_server, tmp_path, recompute):
    srv = fake_server.reset(tokens_per_chunk=2, itl_s=0.02)
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "2", "--input-len", "4", "--output-len", "8")
    assert rc == 0
    for r in res["requests"]:
        assert len(r["chunk_s"]) == 4 and r["output_tokens"] == 8
    # TPOT divides by tokens (7), ITL is per chunk: about half of ITL
    assert res["mean_tpot_ms"] == pytest.approx(recompute(res, {})["mean_tpot_ms"])
    assert res["mean_tpot_ms"] < 0.75 * res["mean_itl_ms"]


def test_without_usage_tokens_are_counted_from_the_stream(fake_server, tmp_path):
    srv = fake_server.reset(usage=False)
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "2", "--input-len", "4", "--output-len", "3")
    assert rc == 0
    assert all(r["output_tokens"] == 3 and r["output_tokens_from"] == "stream" for r in res["requests"])
    assert res["total_input_tokens"] == 8  # the dataset's lengths, without usage


def test_chat_role_chunk_is_not_the_first_token(fake_server, tmp_path):
    srv = fake_server.reset(ttft_s=0.08)
    rc, res = bench(tmp_path, srv.url, "--endpoint", "chat", "--dataset", "multiturn", "--num-prompts", "4",
                    "--turns", "2", "--input-len", "5", "--output-len", "3")
    assert rc == 0 and res["prompt_format"] == "text"
    assert res["mean_ttft_ms"] >= 80  # the role-only chunk arrives at once and must not count
    bodies = srv.state.bodies[1:]
    assert [len(b["messages"]) for b in bodies] == [1, 1, 3, 3]
    # a second turn repeats its session's first turn, then the answer and a new question
    first_turns = {json.dumps(b["messages"]) for b in bodies[:2]}
    assert {json.dumps(b["messages"][:1]) for b in bodies[2:]} == first_turns
    assert [[m["role"] for m in b["messages"]] for b in bodies[2:]] == [["user", "assistant", "user"]] * 2
    # usage (words + 3 per message here) wins over the dataset's token count: 5+3 and 5+3+5 + 3*3
    assert [r["input_tokens"] for r in res["requests"]] == [8, 8, 22, 22]
    # a second turn is sent only after its first turn finished
    first, second = res["requests"][0], res["requests"][2]
    assert second["send_s"] >= first["end_s"]


def test_failures_are_counted_not_fatal(fake_server, tmp_path):
    srv = fake_server.reset(fail_every=3)  # the probe is request 1; requests 3 and 6 fail
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "6", "--input-len", "4", "--output-len", "2")
    assert rc == 0 and res["completed"] == 4 and res["failed"] == 2
    errors = [r["error"] for r in res["requests"] if not r["success"]]
    assert errors == ["HTTP 500: injected failure"] * 2
    assert res["total_output_tokens"] == 8


def test_all_failed_is_an_error_after_the_report(fake_server, tmp_path, capsys):
    srv = fake_server.reset(fail_every=2)  # the probe passes, then every other request fails
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "1", "--input-len", "4", "--output-len", "2")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and res["failed"] == 1
    assert err[-1] == "k3serve: error: all 1 requests failed; first error: HTTP 500: injected failure"


def test_plots_are_written(fake_server, tmp_path):
    pytest.importorskip("matplotlib")
    srv = fake_server.reset()
    rc, _ = bench(tmp_path, srv.url, "--num-prompts", "3", "--input-len", "4", "--output-len", "3",
                  "--plot-dir", str(tmp_path / "plots"))
    assert rc == 0
    for name in ("latency_cdf.png", "throughput.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_text_prompts_and_poisson_arrivals(fake_server, tmp_path):
    srv = fake_server.reset(ttft_s=0.01, itl_s=0.005)
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "5", "--input-len", "9", "--output-len", "2",
                    "--prompt-format", "text", "--request-rate", "40", "--seed", "7")
    assert rc == 0 and res["request_rate"] == 40.0
    for b in srv.state.bodies[1:]:
        assert isinstance(b["prompt"], str) and len(b["prompt"].split()) == 9
    assert [r["input_tokens"] for r in res["requests"]] == [9] * 5  # the fake server counts words
    sched = [r["scheduled_s"] for r in res["requests"]]
    assert sched[0] == 0.0 and all(b > a for a, b in zip(sched, sched[1:]))
    assert all(r["send_s"] >= r["scheduled_s"] for r in res["requests"])
    rc, again = bench(tmp_path, srv.url, "--num-prompts", "5", "--input-len", "9", "--output-len", "2",
                      "--prompt-format", "text", "--request-rate", "40", "--seed", "7")
    assert [r["scheduled_s"] for r in again["requests"]] == sched  # --seed reproduces the arrivals


def test_trace_replay_keeps_timestamps_and_prefixes(fake_server, tmp_path):
    srv = fake_server.reset(ttft_s=0.01, itl_s=0.005)
    trace = tmp_path / "trace.jsonl"
    rows = [(0, [1, 2]), (150, [1, 3]), (300, [1, 2])]
    trace.write_text("".join(json.dumps({"timestamp": ts, "input_length": 1000, "output_length": 2,
                                         "hash_ids": ids}) + "\n" for ts, ids in rows))
    rc, res = bench(tmp_path, srv.url, "--dataset", f"trace:{trace}", "--trace-block-size", "8")
    assert rc == 0 and res["request_rate"] == "trace" and res["num_prompts"] == 3
    assert [r["scheduled_s"] for r in res["requests"]] == [0.0, 0.15, 0.3]
    assert all(r["send_s"] >= r["scheduled_s"] for r in res["requests"])
    prompts = [b["prompt"] for b in srv.state.bodies[1:]]  # arrival order = trace order here
    assert [len(p) for p in prompts] == [8 + 8] * 3  # 1000 tokens = 512 + 488 -> 8 + round(7.6)
    assert prompts[0] == prompts[2] and prompts[0][:8] == prompts[1][:8] and prompts[0][8:] != prompts[1][8:]


def test_ttft_is_the_first_token_even_without_text(fake_server, tmp_path, recompute):
    # the first 3 of 5 chunks hold tokens that decode to no text yet: TTFT is the first chunk, not the fourth
    # (0.05 + 3 * 0.3 s after the request), and every chunk is one ITL sample
    srv = fake_server.reset(ttft_s=0.05, itl_s=0.3, blank_chunks=3)
    rc, res = bench(tmp_path, srv.url, "--num-prompts", "2", "--input-len", "4", "--output-len", "5")
    assert rc == 0
    for r in res["requests"]:
        assert len(r["chunk_s"]) == 5 and r["output_tokens"] == 5
        assert 0.05 <= r["chunk_s"][0] - r["send_s"] < 0.05 + SLACK_S
    assert res["mean_ttft_ms"] == pytest.approx(recompute(res, {})["mean_ttft_ms"])


def test_output_len_overrides_a_traces_lengths(fake_server, tmp_path):
    srv = fake_server.reset(ttft_s=0.01, itl_s=0.005)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 20, "output_length": 2,
                                         "hash_ids": [i]}) + "\n" for i in range(2)))
    rc, res = bench(tmp_path, srv.url, "--dataset", f"trace:{trace}", "--output-len", "3")
    assert rc == 0 and [b["max_tokens"] for b in srv.state.bodies[1:]] == [3, 3]
    assert [r["output_tokens"] for r in res["requests"]] == [3, 3]
    srv.reset(ttft_s=0.01, itl_s=0.005)
    rc, res = bench(tmp_path, srv.url, "--dataset", f"trace:{trace}")  # without it: the trace's own lengths
    assert rc == 0 and [b["max_tokens"] for b in srv.state.bodies[1:]] == [2, 2]
