"""Engine configuration: one frozen dataclass, validated at construction; components get only their fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.engine.spec.config import SpeculativeConfig


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # running requests (= KDA running slots)
    max_num_batched_tokens: int = 2048  # token budget of one step, prefill chunks and decodes together
    block_size: int = 16  # MLA tokens per block; also the prefix-cache and snapshot granularity
    kv_cache_memory: float = 256 * 2**20  # bytes (> 1) or a fraction (<= 1) of available memory
    enable_prefix_caching: bool = True
    state_cache_interval: int = 0  # extra KDA snapshots every N prefill tokens (0: prompt ends only)
    snapshot_memory_fraction: float = 0.25  # share of the cache budget for KDA snapshots
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    retain_freed_memory: bool = True  # CPU: glibc keeps freed memory for reuse (memory.keep_freed_memory)
    # BLAKE2b key of the prefix-cache block hashes (core.hashing); b"": unkeyed. Set from the KV events secret
    # (core.kv_auth) so published hashes reveal nothing without it; a router must hash with the same key.
    hash_key: bytes = field(default=b"", repr=False)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    eplb_interval: int = 0  # expert parallel: re-place the experts every N forward steps (0: never)
    eplb_redundant_experts: int = 0  # extra expert slots per MoE layer for the hottest experts' replicas
    # decode steps through captured graphs (engine/graph_runner.py): "off" (eager), "on" (CUDA graphs, a CUDA
    # device only) or "standin" (the CPU stand-in: the same static-buffer forward, re-run under a host-sync
    # check; for tests and checks, not a speedup); buckets up to max_batch rows, contexts up to max_context
    cuda_graphs: str = "off"
    cuda_graph_max_batch: int = 32
    cuda_graph_max_context: int = 8192

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _check(self.kv_cache_memory > 0, "kv_cache_memory",
               f"must be a byte count or a fraction in (0, 1], got {self.kv_cache_memory}")
        _check(self.state_cache_interval >= 0 and self.state_cache_interval % self.block_size == 0,
               "state_cache_interval", f"must be a non-negative multiple of block_size ({self.block_size}), "
               f"got {self.state_cache_interval}")
        _check(0 <= self.snapshot_memory_fraction < 1, "snapshot_memory_fraction",
               f"must be in [0, 1), got {self.snapshot_memory_fraction}")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               f"must be >= 2, got {self.max_model_len}")
        _check(isinstance(self.hash_key, bytes) and len(self.hash_key) <= 64, "hash_key",
               "must be at most 64 bytes")
        _check(self.eplb_interval >= 0 and self.eplb_redundant_experts >= 0, "eplb_interval",
               "eplb_interval and eplb_redundant_experts must be >= 0")
        _check(self.cuda_graphs in ("off", "on", "standin"), "cuda_graphs",
               f"must be 'off', 'on' or 'standin', got {self.cuda_graphs!r}")
        _check(self.cuda_graph_max_batch >= 1, "cuda_graph_max_batch", f"must be >= 1, got {self.cuda_graph_max_batch}")
        _check(self.cuda_graph_max_context >= 2, "cuda_graph_max_context",
               f"must be >= 2, got {self.cuda_graph_max_context}")
        _check(self.cuda_graphs == "off" or self.speculative_config is None, "cuda_graphs",
               "not supported with speculative decoding yet (its verify rows are not static decode rows): "
               "run eager (--enforce-eager)")
        _check(self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig),
               "speculative_config", "must be a SpeculativeConfig (SpeculativeConfig.parse reads the JSON form)")


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, in one line (torch would say it deep in allocation)."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device: {device!r} is not a torch device (try 'cpu' or 'cuda')") from None
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device: {device!r} asked for, but no CUDA GPU is available here (use --device cpu)")
        if d.index is not None and d.index >= count:
            raise ValueError(f"device: {device!r} asked for, but only {count} CUDA GPU(s) are visible")
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device: {device!r} asked for, but MPS is not available here")
