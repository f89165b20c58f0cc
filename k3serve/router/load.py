"""Router-side load counters per replica, updated the moment a request is routed.

Hot-spotting reports (vllm-project/router#179, AMD-AGI/Infera#103) share one cause: the load a
prefix-affine router sees lags the requests it has just sent, so every pick lands on the same replica.
These counters therefore move at routing time, from the router's own bookkeeping, and only request
lifecycle calls (first token, finish) bring them back down; nothing else (health checks) resets them.

Units are KV blocks: ``pending_prefill_blocks`` = blocks routed but not yet prefilled (the router's
estimate, prompt blocks minus predicted overlap), ``decode_blocks`` = KV blocks held by requests that
are decoding (prompt + requested output).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class _InFlight:
    replica: int
    prefill_blocks: int
    decode_blocks: int
    decoding: bool = False


class LoadTracker:
    """Per-replica in-flight work; arrays are indexed by replica id."""

    def __init__(self, num_replicas: int) -> None:
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        self.pending_prefill_blocks = np.zeros(num_replicas, dtype=np.int64)
        self.decode_blocks = np.zeros(num_replicas, dtype=np.int64)
        self.active_requests = np.zeros(num_replicas, dtype=np.int64)
        self.routed_requests = np.zeros(num_replicas, dtype=np.int64)
        self._inflight: dict[object, _InFlight] = {}

    @property
    def num_replicas(self) -> int:
        return len(self.active_requests)

    def is_inflight(self, request_id: object) -> bool:
        return request_id in self._inflight

    def on_routed(self, request_id: object, replica: int, prefill_blocks: int, decode_blocks: int) -> None:
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} is already in flight")
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica must be in [0, {self.num_replicas}), got {replica}")
        self._inflight[request_id] = _InFlight(replica, prefill_blocks, decode_blocks)
        self.pending_prefill_blocks[replica] += prefill_blocks
        self.active_requests[replica] += 1
        self.routed_requests[replica] += 1

    def on_first_token(self, request_id: object) -> None:
        """Prefill is done: its blocks leave the prefill queue and the request starts holding decode KV."""
        r = self._inflight.get(request_id)
        if r is None or r.decoding:
            return
        r.decoding = True
        self.pending_prefill_blocks[r.replica] -= r.prefill_blocks
        self.decode_blocks[r.replica] += r.decode_blocks

    def on_finished(self, request_id: object) -> None:
        """The request ended (normally, cancelled or failed): release whatever it still counts for."""
        r = self._inflight.pop(request_id, None)
        if r is None:
            return
        if r.decoding:
            self.decode_blocks[r.replica] -= r.decode_blocks
        else:
            self.pending_prefill_blocks[r.replica] -= r.prefill_blocks
        self.active_requests[r.replica] -= 1
