"""Metric definitions on hand-made records with hand-computed answers."""

from __future__ import annotations

import pytest

from k3serve.bench.client import RequestRecord
from k3serve.bench.metrics import Goodput, parse_percentiles, peak_concurrency, summarize, timeline


def rec(i, send, chunks, end, out, inp=10, ok=True):
    return RequestRecord(i, send, inp, send_s=send, chunk_s=list(chunks), end_s=end, output_tokens=out,
                         output_tokens_from="usage", success=ok, error="" if ok else "x")


# a: ttft 0.1, e2el 0.5, 5 tokens in 3 chunks -> tpot 0.1, itl [0.2, 0.2]
# b: ttft 0.3, e2el 0.4, 1 token -> no tpot (0 for goodput), no itl
# c: failed, ignored everywhere but "failed"
RECORDS = [rec(0, 0.0, [0.1, 0.3, 0.5], 0.5, 5), rec(1, 0.2, [0.5], 0.6, 1, inp=20),
           rec(2, 0.1, [], 0.2, 0, inp=99, ok=False)]


def test_summary_follows_vllm_definitions():
    s = summarize(RECORDS, duration_s=2.0, percentiles=(50, 99.9))
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 6)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(18.0)
    assert s["request_goodput"] is None
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(100)
    assert s["p99.9_ttft_ms"] == pytest.approx(100 + 200 * 0.999)  # numpy linear interpolation
    assert s["mean_tpot_ms"] == pytest.approx(100) and s["p50_tpot_ms"] == pytest.approx(100)
    assert s["mean_itl_ms"] == pytest.approx(200) and s["std_itl_ms"] == pytest.approx(0, abs=1e-9)
    assert s["mean_e2el_ms"] == pytest.approx(450)
    assert s["max_concurrent_requests"] == 2  # a: 0-0.5 and b: 0.2-0.6 overlap
    assert s["max_output_tokens_per_s"] == pytest.approx(6.0)  # all 6 tokens in the first second


def test_empty_metric_sets_report_zero_like_vllm():
    s = summarize([RECORDS[1]], duration_s=1.0)
    assert s["mean_tpot_ms"] == 0.0 and s["p99_itl_ms"] == 0.0 and s["mean_ttft_ms"] == pytest.approx(300)


@pytest.mark.parametrize("slo, good", [
    (["ttft:100"], 1),  # a meets it exactly (inclusive), b does not
    (["ttft:300"], 2),
    (["tpot:99"], 1),  # b has one token: TPOT 0 for goodput
    (["ttft:300", "e2el:450"], 1),  # b's e2el is 400, a's 500
    (["ttft:300", "tpot:100", "e2el:500"], 2),
])
def test_goodput_counts_requests_meeting_every_slo(slo, good):
    s = summarize(RECORDS, duration_s=4.0, goodput=Goodput.parse(slo))
    assert s["request_goodput"] == pytest.approx(good / 4.0)


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "ttft:x", "ttft:-1", "ttft:0", "itl:5", "ttft:inf"])
def test_goodput_rejects_bad_slos(bad):
    with pytest.raises(ValueError, match="--goodput"):
        Goodput.parse([bad])


def test_percentile_parsing():
    assert parse_percentiles("50, 90,99.9") == (50.0, 90.0, 99.9)
    for bad in ("", "0", "101", "fifty"):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            parse_percentiles(bad)


def test_peak_concurrency_frees_before_it_takes_at_the_same_instant():
    rs = [rec(0, 0.0, [0.5], 1.0, 1), rec(1, 1.0, [1.5], 2.0, 1), rec(2, 1.5, [1.8], 3.0, 1)]
    assert peak_concurrency(rs) == 2


def test_timeline_spreads_tokens_over_chunks():
    rs = [rec(0, 0.0, [0.2, 1.2], 1.3, 6), rec(1, 0.5, [0.7], 2.5, 2)]
    tl = timeline(rs, bucket_s=1.0)
    assert tl["t_s"] == [0.0, 1.0, 2.0]
    assert tl["output_tokens_per_s"] == [5.0, 3.0, 0.0]
    assert tl["requests_per_s"] == [0.0, 1.0, 1.0]
    assert tl["in_flight"] == [1.0, 2.0, 1.0]
