"""Prometheus metrics (`/metrics`), vLLM's names where the meaning matches. One registry per app.

Gauges come from the engine's latest stats message; counters and histograms from finished
requests in this server process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from k3serve.engine.messages import Stats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineGauges:
    def __init__(self, stats: Callable[[], Stats | None], model: str, in_flight: Callable[[], int]):
        self._stats, self._model, self._in_flight = stats, model, in_flight

    def collect(self):
        s = self._stats()
        if s is None:
            return
        label = ["model_name"]
        values = {
            ("vllm:num_requests_running", "Requests running in the engine"): s.num_running,
            ("vllm:num_requests_waiting", "Requests waiting in the engine"): s.num_waiting,
            ("vllm:kv_cache_usage_perc", "Fraction of MLA KV blocks in use (1 = 100%)"):
                s.num_blocks_used / max(1, s.num_blocks),
            ("k3serve:kda_state_slots_free", "Free KDA running-state slots"): s.num_free_slots,
            ("k3serve:kda_state_slots", "KDA running-state slots"): s.num_slots,
            ("k3serve:requests_in_flight", "Requests the HTTP server is serving"): self._in_flight(),
            ("k3serve:handoffs_held", "Requests holding caches for a P/D hand-off"): s.num_held,
        }
        for (name, doc), v in values.items():
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self._model], float(v))
            yield g
        for name, doc, v in (("k3serve:handoff_transfers", "P/D hand-offs sent (prefill) or imported (decode)",
                              s.handoff_transfers),
                             ("k3serve:handoff_failures", "P/D hand-offs refused, corrupt or timed out",
                              s.handoff_failures),
                             ("k3serve:handoff_bytes", "P/D hand-off bytes sent (prefill) or received (decode)",
                              s.handoff_bytes),
                             ("k3serve:handoff_transfer_seconds", "P/D hand-off time: prefill export+send, decode "
                              "fetch->imported", s.handoff_transfer_s),
                             ("k3serve:handoff_queue_seconds", "P/D queue time: prefill holds until acked, decode "
                              "waits for room before fetching", s.handoff_queue_s),
                             ("k3serve:handoff_cached_tokens", "P/D prompt positions not transferred: the decode "
                              "side's prefix cache held them", s.handoff_cached_tokens),
                             ("vllm:num_preemptions", "Preemptions by recompute", s.num_preemptions),
                             ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                              s.num_prefix_hit_tokens),
                             ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                              s.num_admitted_tokens),
                             ("vllm:spec_decode_num_drafts", "Decode rows verified under speculative decoding",
                              s.num_spec_rows),
                             ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens),
                             ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                              s.num_accepted_tokens)):
            g = GaugeMetricFamily(name + "_total", doc + " (engine counter)", labels=label)
            g.add_metric([self._model], float(v))
            yield g


class Metrics:
    def __init__(self, model: str, stats: Callable[[], Stats | None], in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.model = model
        lab = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", lab, registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", lab, registry=self.registry)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.http_errors = Counter("k3serve:http_errors", "Error responses by status", ["status"],
                                   registry=self.registry)
        self.registry.register(_EngineGauges(stats, model, in_flight))

    def finished(self, timer, prompt_tokens: int, decoders: Sequence) -> None:
        m = self.model
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        for d in decoders:
            self.generation_tokens.labels(m).inc(d.num_tokens)
            self.request_success.labels(m, d.final_finish_reason()).inc()
        if timer.first is not None:
            self.ttft.labels(m).observe(timer.first - timer.start)
        self.e2e.labels(m).observe(time.perf_counter() - timer.start)

    def render(self) -> bytes:
        return generate_latest(self.registry)
