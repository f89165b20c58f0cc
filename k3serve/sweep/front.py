"""SLOs and the Pareto front of throughput (higher is better) against one latency metric (lower is better).

A point is a result dict as points.jsonl stores it: ``status`` ("ok" or "failed"), ``modelled`` and the bench
summary keys (``output_throughput``, ``p99_ttft_ms``, ...). A point is *eligible* when it ran, none of its
requests failed and it meets every SLO; the front is the eligible points no other eligible point dominates
(at least as good on both axes, better on one). Equal points do not dominate each other: ties all stay.
Measured and modelled points get separate fronts (a roofline is no measurement).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

THROUGHPUTS = ("output_throughput", "total_token_throughput", "request_throughput")
LATENCY_RE = re.compile(r"p(\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms")


def check_latency_key(key: str) -> str:
    if not LATENCY_RE.fullmatch(key) or not 0 < float(LATENCY_RE.fullmatch(key).group(1)) <= 100:
        raise ValueError(f"--latency {key!r}: expected pNN_METRIC_ms with METRIC in ttft, tpot, itl, e2el "
                         "(e.g. p99_tpot_ms)")
    return key


@dataclass(frozen=True)
class SLO:
    """Upper limits in milliseconds on bench summary keys, e.g. {"p99_ttft_ms": 2000}."""

    limits: tuple[tuple[str, float], ...] = field(default=())

    def __post_init__(self) -> None:
        for key, ms in self.limits:
            check_latency_key(key)
            if not ms > 0:
                raise ValueError(f"SLO on {key}: the limit must be > 0 ms, got {ms}")

    def met(self, point: dict[str, Any]) -> bool:
        return all(point.get(key) is not None and point[key] <= ms for key, ms in self.limits)

    def percentiles(self) -> list[float]:
        return [float(LATENCY_RE.fullmatch(k).group(1)) for k, _ in self.limits]


def eligible(point: dict[str, Any], slo: SLO, throughput: str, latency: str) -> bool:
    return (point.get("status") == "ok" and not point.get("failed") and point.get(throughput) is not None
            and point.get(latency) is not None and slo.met(point))


def pareto_front(points: Sequence[dict[str, Any]], throughput: str, latency: str) -> list[dict[str, Any]]:
    """The points no other point dominates, by latency ascending (then throughput descending)."""
    def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
        ta, la, tb, lb = a[throughput], a[latency], b[throughput], b[latency]
        return ta >= tb and la <= lb and (ta > tb or la < lb)

    front = [p for p in points if not any(dominates(q, p) for q in points)]
    return sorted(front, key=lambda p: (p[latency], -p[throughput]))


def fronts(points: Sequence[dict[str, Any]], slo: SLO, throughput: str,
           latency: str) -> dict[str, list[dict[str, Any]]]:
    """{"measured": front, "modelled": front} over the eligible points of each kind."""
    out = {}
    for kind, modelled in (("measured", False), ("modelled", True)):
        ok = [p for p in points if bool(p.get("modelled")) == modelled and eligible(p, slo, throughput, latency)]
        out[kind] = pareto_front(ok, throughput, latency)
    return out
