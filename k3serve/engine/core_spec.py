"""``CoreSpec``: what an engine-core process (and each of its tensor-parallel ranks) is started with, as JSON
on its command line; ``build_engine`` makes a rank's ``LLMEngine`` from it, the same way on every rank."""

from __future__ import annotations

import os

import msgspec


class CoreSpec(msgspec.Struct, frozen=True):
    model: str
    input_addr: str
    output_addr: str
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: float = 256 * 2**20
    enable_prefix_caching: bool = True
    state_cache_interval: int = 0  # extra KDA snapshots every N prompt tokens (EngineConfig)
    device: str = "cpu"
    seed: int = 0
    kv_events_host: str | None = None  # publish KV cache events (engine/kv_events.py) on this host; None: off
    # keyed events: the secret (core.kv_auth) comes in the environment, never in this spec (it is argv)
    kv_events_keyed: bool = False
    log_stats_interval: float = 10.0  # seconds between engine stats lines (engine/stats_log.py); 0: none
    role: str = "both"  # prefill | decode | both (engine/pd/role.py)
    handoff_host: str = "127.0.0.1"  # prefill role: where its hand-off sender listens (a random port)
    handoff_timeout_s: float = 30.0  # a hand-off not acked (prefill) or not answered (decode) by then is dropped
    speculative_config: str | None = None  # JSON of spec.config.SpeculativeConfig; None: no speculation
    tensor_parallel_size: int = 1  # ranks of this engine replica; rank 0 is this process (engine/ranks.py)
    expert_parallel: bool = False
    nnodes: int = 1  # hosts the ranks span; host 0 runs rank 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free local port (one host only)
    dp_rank: int = 0  # which data-parallel replica this is (picks its GPUs on a shared host)
    eplb_interval: int = 0  # expert parallel: re-place the experts every N forward steps (0: never)
    eplb_redundant_experts: int = 0  # extra expert slots per MoE layer, for the hottest experts' replicas
    local_replicas: int = 1  # engine replicas on this host (each with its tp ranks): they share its cores
    # > 1 only when the experts span the replicas: one world of tp * dp ranks, engine cores in lockstep
    # (engine/dp_sync.py); plain data parallelism keeps 1 (each replica its own world)
    data_parallel_size: int = 1
    tp_reduce: str = "fast"  # "ordered": tp partials added in rank order (core.distributed reduction modes)
    tp_pieces: int = 1  # > 1: tp dimensions computed in this many pieces (one process reproduces -tp N exactly)
    # data parallel across hosts (engine/dp_hosts.py): dp_replicas over dp_nnodes hosts, tp within each host
    dp_replicas: int = 1
    dp_nnodes: int = 1
    dp_address: str = "127.0.0.1"  # host 0's data-parallel RPC address (it listens there, the others connect)
    dp_rpc_port: int = 29550
    client_timeout_s: float = 0.0  # > 0: exit after this long without a message from the client (remote cores)
    cuda_graphs: str = "off"  # decode steps from captured graphs: off | on | standin (EngineConfig)
    cuda_graph_max_batch: int = 32
    cuda_graph_max_context: int = 8192

    def layout(self):
        from k3serve.core.distributed import ParallelLayout

        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        reduce = {"reduce_mode": self.tp_reduce, "pieces": self.tp_pieces}
        if dp > 1:
            return ParallelLayout(tp=tp, ep=tp * dp, dp=dp, **reduce)
        return ParallelLayout(tp=tp, ep=tp if self.expert_parallel else 1, **reduce)

    def rank_device(self, rank: int) -> str:
        """``cuda`` becomes this rank's GPU: replica ``dp_rank`` uses the host's GPUs after the earlier ones'."""
        if self.device != "cuda" or self.tensor_parallel_size == 1 and self.dp_rank == 0:
            return self.device
        per_node = self.tensor_parallel_size // self.nnodes
        local = int(os.environ.get("LOCAL_RANK", rank % per_node))
        return f"cuda:{self.dp_rank % self.local_replicas * per_node + local}"  # the replica's slot on its host


def rank_threads(spec: CoreSpec, cores: int | None = None) -> int:
    """torch intra-op threads for one rank: this host's cores split over the processes of every replica on it,
    unless OMP_NUM_THREADS says otherwise (then torch's own count). N processes taking all cores each
    oversubscribe them N-fold, and their GEMMs then wait on threads that are not running."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    procs = spec.tensor_parallel_size // spec.nnodes * spec.local_replicas
    return max(1, cores // procs)


def build_engine(spec: CoreSpec, par=None, group=None, hash_key: bytes = b""):
    """The ``LLMEngine`` of ``spec`` on this rank; every rank of a replica builds it the same way (``hash_key``,
    the keyed KV events' block hash key, matters only on rank 0, whose scheduler keeps the prefix cache)."""
    import torch

    from k3serve.core.distributed import SINGLE, Parallel
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.engine.llm import parse_dtype
    from k3serve.engine.spec.config import SpeculativeConfig

    torch.manual_seed(spec.seed)
    torch.set_num_threads(rank_threads(spec))
    config = EngineConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                          kv_cache_memory=spec.kv_cache_memory, enable_prefix_caching=spec.enable_prefix_caching,
                          state_cache_interval=spec.state_cache_interval,
                          max_model_len=spec.max_model_len, hash_key=hash_key, eplb_interval=spec.eplb_interval,
                          eplb_redundant_experts=spec.eplb_redundant_experts, cuda_graphs=spec.cuda_graphs,
                          cuda_graph_max_batch=spec.cuda_graph_max_batch,
                          cuda_graph_max_context=spec.cuda_graph_max_context,
                          speculative_config=None if spec.speculative_config is None
                          else SpeculativeConfig.parse(spec.speculative_config))
    # one process runs SINGLE unless it is asked to compute in pieces (the arithmetic of -tp N)
    par = par or (Parallel(spec.layout()) if spec.tp_pieces > 1 else SINGLE)
    device = spec.rank_device(par.rank)
    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))
    # token ids only: text and stop strings are the client's job (engine/detokenizer.py)
    return LLMEngine(spec.model, config=config, dtype=parse_dtype(spec.dtype), device=device, par=par, group=group)
