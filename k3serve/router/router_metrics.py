"""Prometheus metrics of the live router (``/metrics``): requests per replica and outcome, retries,
replica health, and the prefix hit the index predicted at routing time (prompt tokens vs predicted
cached tokens, so ``predicted_hit_tokens / prompt_tokens`` is the router's own hit-rate estimate)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily


class _ReplicaGauges:
    def __init__(self, proxy: Any) -> None:
        self._proxy = proxy

    def collect(self):
        reps, r = self._proxy.replicas.replicas, self._proxy.router
        rows = (("k3serve_router_replica_healthy", "1 when the replica is routable", lambda x: x.healthy),
                ("k3serve_router_replica_cached_blocks", "Prefix blocks the index holds for the replica",
                 lambda x: r.index.num_blocks(x.id)),
                ("k3serve_router_replica_active_requests", "Requests in flight on the replica",
                 lambda x: r.load.active_requests[x.id]),
                ("k3serve_router_replica_resyncs", "Full-state resyncs of the replica's index", lambda x: x.resyncs))
        for name, doc, value in rows:
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            for x in reps:
                g.add_metric([x.url], float(value(x)))
            yield g


class RouterMetrics:
    def __init__(self, proxy: Any) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("k3serve_router_requests", "Requests answered, by replica and HTTP status",
                                ["replica", "status"], registry=reg)
        self.retries = Counter("k3serve_router_retries", "Requests moved to another replica before any byte "
                               "was sent", registry=reg)
        self.failed = Counter("k3serve_router_unserved", "Requests no replica could take", registry=reg)
        self.prompt_tokens = Counter("k3serve_router_prompt_tokens", "Prompt tokens routed", registry=reg)
        self.predicted_hit = Counter("k3serve_router_predicted_hit_tokens",
                                     "Prompt tokens the index expected to be cached where routed", registry=reg)
        self._urls = proxy.config.replicas
        self._block_size = proxy.config.block_size
        reg.register(_ReplicaGauges(proxy))

    def routed(self, decision: Any, hashed_blocks: int, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted_hit.inc(min(decision.overlap_blocks, hashed_blocks) * self._block_size)

    def done(self, replica: int, status: int) -> None:
        self.requests.labels(self._urls[replica], str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
