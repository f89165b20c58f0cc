"""Request metrics and their aggregates, as ``vllm bench serve`` defines them (same JSON keys).

Per successful request, from client timestamps:
  * TTFT = first output chunk - send;  E2EL = end of stream - send.
  * TPOT = (E2EL - TTFT) / (output_tokens - 1); requests with one output token have none (and count as
    TPOT 0 against a goodput SLO, as in vLLM).
  * ITL  = the gaps between consecutive output chunks, pooled over requests (with several tokens per
    chunk, e.g. speculative decoding, ITL is not TPOT). Unlike vLLM we skip chunks without output (a
    finish-reason or usage frame follows the last token by microseconds and would fake a tiny gap); a
    completions chunk of tokens without text is output (client.py).
Throughputs divide by the run's duration (first send scheduled to last response); input tokens count only
successful requests. Goodput = requests meeting every given SLO / duration. Percentiles are numpy's linear.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from k3serve.bench.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
_SLO_KEYS = ("ttft", "tpot", "e2el")


def ttft_s(r: RequestRecord) -> float:
    return r.chunk_s[0] - r.send_s


def e2el_s(r: RequestRecord) -> float:
    return r.end_s - r.send_s


def tpot_s(r: RequestRecord) -> float | None:
    return (e2el_s(r) - ttft_s(r)) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def itl_s(r: RequestRecord) -> list[float]:
    return np.diff(r.chunk_s).tolist()


@dataclass(frozen=True, slots=True)
class Goodput:
    """SLOs in milliseconds; a request is good when it meets every one that is set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str] | None) -> Goodput | None:
        """``["ttft:500", "tpot:50"]`` -> Goodput; None when no SLO is given."""
        if not items:
            return None
        slo: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition(":")
            try:
                ms = float(value)
            except ValueError:
                ms = math.nan
            if not sep or key not in _SLO_KEYS or not ms > 0 or math.isinf(ms):
                raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY in ttft, tpot, e2el and MS > 0")
            slo[f"{key}_ms"] = ms
        return cls(**slo)

    def met(self, r: RequestRecord) -> bool:
        tpot = tpot_s(r) or 0.0
        return all(limit is None or value * 1000 <= limit for value, limit in
                   ((ttft_s(r), self.ttft_ms), (tpot, self.tpot_ms), (e2el_s(r), self.e2el_ms)))


def percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_percentiles(spec: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        ps = ()
    if not ps or not all(0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles {spec!r}: expected comma-separated numbers in (0, 100]")
    return ps


def summarize(records: Sequence[RequestRecord], duration_s: float, percentiles: Sequence[float] = (99,),
              goodput: Goodput | None = None) -> dict[str, float | int | None]:
    ok = [r for r in records if r.success]
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, float | int | None] = {
        "duration": duration_s, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": sum(goodput.met(r) for r in ok) / duration_s if goodput else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": max(timeline(ok, 1.0)["output_tokens_per_s"], default=0.0),
        "max_concurrent_requests": peak_concurrency(ok),
    }
    values = {"ttft": [ttft_s(r) for r in ok], "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
              "itl": [g for r in ok for g in itl_s(r)], "e2el": [e2el_s(r) for r in ok]}
    for name in METRICS:
        ms = np.asarray(values[name] or [0.0]) * 1000  # vLLM reports 0 for an empty set
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (sweep over send/end events; an end at the same instant as a send
    frees its slot first)."""
    events = sorted([(r.send_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def timeline(records: Sequence[RequestRecord], bucket_s: float) -> dict[str, list[float]]:
    """Per ``bucket_s`` window from t=0: output tokens/s (a request's tokens spread evenly over its output
    chunks, since a chunk may hold several), completed requests/s and requests in flight at the window start."""
    end = max((r.end_s for r in records), default=0.0)
    n = max(1, math.ceil(end / bucket_s))
    tokens, done = np.zeros(n), np.zeros(n)
    for r in records:
        idx = np.minimum((np.asarray(r.chunk_s) / bucket_s).astype(int), n - 1)
        np.add.at(tokens, idx, r.output_tokens / len(r.chunk_s))
        done[min(int(r.end_s / bucket_s), n - 1)] += 1
    starts = np.arange(n) * bucket_s
    sends, ends = np.sort([r.send_s for r in records]), np.sort([r.end_s for r in records])
    in_flight = np.searchsorted(sends, starts, "right") - np.searchsorted(ends, starts, "right")
    return {"t_s": starts.tolist(), "output_tokens_per_s": (tokens / bucket_s).tolist(),
            "requests_per_s": (done / bucket_s).tolist(), "in_flight": in_flight.astype(float).tolist()}
