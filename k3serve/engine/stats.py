"""Engine statistics for metrics: queue sizes, cache usage, prefix hit rate, preemptions, token counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_blocks_used: int  # held by running requests
    num_blocks_cached: int  # blocks with a prefix hash (in use or evictable)
    num_snapshot_slots: int
    num_snapshots: int  # published KDA snapshots
    num_admitted_tokens: int  # tokens of admitted requests, the denominator of the hit rate
    num_prefix_hit_tokens: int
    num_computed_tokens: int  # tokens fed to the model
    num_generated_tokens: int
    num_preemptions: int
    num_steps: int
    num_spec_rows: int = 0  # speculative decoding: decode rows verified (k = 0 included)
    num_draft_tokens: int = 0  # drafts proposed (and verified)
    num_accepted_tokens: int = 0  # drafts accepted
    num_expert_replicas: int = 0  # EPLB: expert copies beyond the first, over every MoE layer
    num_dummy_steps: int = 0  # forwards for no request, in step with other data-parallel cores (dp_sync.py)

    @property
    def cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_admitted_tokens if self.num_admitted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify row (1 + accepted drafts; 1.0 means speculation gained nothing)."""
        return 1 + self.num_accepted_tokens / self.num_spec_rows if self.num_spec_rows else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "cache_usage": self.cache_usage, "prefix_hit_rate": self.prefix_hit_rate,
                "mean_acceptance_length": self.mean_acceptance_length}
