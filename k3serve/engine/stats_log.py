"""The periodic engine stats line, vLLM's "Avg prompt throughput ..." line for k3serve.

The engine-core process owns the counters, so it logs: every ``interval_s`` seconds, and only when the
engine did something since the last line (or its queues changed), so an idle server stays quiet.
Rates are over the interval; "prompt" tokens are the tokens fed to the model that were not generated
ones (prefill, after prefix-cache hits).
"""

from __future__ import annotations

from k3serve.engine.messages import Stats


def stats_line(prev: Stats, cur: Stats, elapsed_s: float) -> str:
    dt = max(elapsed_s, 1e-9)
    generated = cur.num_generated_tokens - prev.num_generated_tokens
    prompt = max(0, cur.num_computed_tokens - prev.num_computed_tokens - generated)
    admitted = cur.num_admitted_tokens - prev.num_admitted_tokens
    hits = cur.num_prefix_hit_tokens - prev.num_prefix_hit_tokens
    kv = cur.num_blocks_used / cur.num_blocks if cur.num_blocks else 0.0
    slots = (cur.num_slots - cur.num_free_slots) / cur.num_slots if cur.num_slots else 0.0
    line = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: "
            f"{generated / dt:.1f} tokens/s, Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs, "
            f"KV cache usage: {100 * kv:.1f}%, KDA slot usage: {100 * slots:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / admitted if admitted > 0 else 0.0:.1f}%")
    rows = cur.num_spec_rows - prev.num_spec_rows
    if rows > 0:  # speculative decoding: tokens per verify row and the share of drafts accepted
        drafts = cur.num_draft_tokens - prev.num_draft_tokens
        accepted = cur.num_accepted_tokens - prev.num_accepted_tokens
        line += (f", Mean acceptance length: {1 + accepted / rows:.2f}, "
                 f"Draft acceptance rate: {100 * accepted / drafts if drafts else 0.0:.1f}%")
    return line


class StatsLogger:
    """Feed it the engine's stats each loop; it returns a line when one is due, else None."""

    def __init__(self, interval_s: float, stats: Stats, now: float):
        self.interval_s = interval_s
        self._last, self._last_t = stats, now

    def update(self, stats: Stats, now: float) -> str | None:
        if self.interval_s <= 0 or now - self._last_t < self.interval_s:
            return None
        prev, elapsed = self._last, now - self._last_t
        self._last, self._last_t = stats, now
        active = (stats.num_steps != prev.num_steps
                  or (stats.num_running, stats.num_waiting) != (prev.num_running, prev.num_waiting))
        return stats_line(prev, stats, elapsed) if active else None
