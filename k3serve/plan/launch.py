"""Launch commands for a planned replica: k3serve, and the equivalent vLLM and SGLang flags.

Multi-node replicas use shell placeholders (``$NODE_RANK``, ``$HEAD_ADDR``) so one line serves every node.
The k3serve command holds only flags ``k3serve serve`` accepts and honours today (tensor parallel, experts over
the same ranks, across hosts; attention-DP groups sharing the experts, on one host or one group set per host);
what the replica needs beyond that (pipeline stages, a tp group spanning hosts beside data parallelism, an FP8
KV cache) is listed apart by
``k3serve_not_yet_supported`` instead of being printed as a command that would refuse to start.
Flag spellings follow vLLM's and SGLang's documented server arguments (docs.vllm.ai "Parallelism and
Scaling", docs.sglang.io "Server Arguments"); re-check them against the pinned engine version.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.plan.layout import Layout


@dataclass(frozen=True)
class LaunchSpec:
    layout: Layout
    gpus_per_node: int
    context_length: int
    max_num_seqs: int
    gpu_memory_utilization: float
    kv_cache_dtype: str  # "bf16" or "fp8"
    max_num_batched_tokens: int

    @property
    def nodes(self) -> int:
        return -(-self.layout.gpus // self.gpus_per_node)


def k3serve_command(s: LaunchSpec, checkpoint: str) -> str:
    # --device/--dtype: k3serve defaults to float32 on the CPU; the plan sizes BF16 weights on a GPU.
    # --max-num-seqs is per engine core: each attention-DP group has its own scheduler
    per_core = -(-s.max_num_seqs // s.layout.dp)
    return " ".join([f"k3serve serve {checkpoint}", "--device cuda", "--dtype bfloat16",
                     f"--max-model-len {s.context_length}", f"--max-num-seqs {per_core}",
                     f"--max-num-batched-tokens {s.max_num_batched_tokens}",
                     f"--gpu-memory-utilization {s.gpu_memory_utilization}", *_k3serve_parallel(s)[0]])


def k3serve_not_yet_supported(s: LaunchSpec) -> tuple[str, ...]:
    """The flags this replica needs that ``k3serve serve`` refuses today (vLLM spellings)."""
    out = list(_k3serve_parallel(s)[1])
    if s.kv_cache_dtype != "bf16":
        out.append(f"--kv-cache-dtype {s.kv_cache_dtype}")
    return tuple(out)


def k3serve_runs(s: LaunchSpec) -> bool:
    """Whether ``k3serve serve`` runs this replica's layout today (the KV cache dtype aside)."""
    return not _k3serve_parallel(s)[1]


def _k3serve_parallel(s: LaunchSpec) -> tuple[list[str], list[str]]:
    """(flags k3serve serve honours, flags it cannot yet) for the replica's layout. k3serve splits one replica
    over tp ranks (experts over the same ranks with --enable-expert-parallel) across hosts, and attention-DP
    groups with the experts over all tp x dp ranks, on one host or the same number of whole groups on each host;
    pipeline stages, and a tp group spanning hosts beside data parallelism, are not there yet."""
    lay, ok, no = s.layout, [], []
    # attention-DP groups across hosts: each group's tp ranks inside one host, the same number of groups on each
    dp_hosts = (s.nodes > 1 and lay.dp > 1 and lay.pp == 1 and lay.dp % s.nodes == 0
                and lay.tp * (lay.dp // s.nodes) <= s.gpus_per_node)
    if lay.tp > 1:
        ok.append(f"--tensor-parallel-size {lay.tp}")
    if lay.pp > 1:
        no.append(f"--pipeline-parallel-size {lay.pp}")
    if lay.dp > 1:  # the plan's dp groups share experts (ep = tp x dp): k3serve's -dp D --enable-expert-parallel
        (ok if s.nodes == 1 or dp_hosts else no).append(f"--data-parallel-size {lay.dp}")
    if lay.ep > 1:
        (ok if lay.dp == 1 or s.nodes == 1 or dp_hosts else no).append("--enable-expert-parallel")
    if s.nodes > 1:
        (ok if lay.pp == 1 and (lay.dp == 1 or dp_hosts) else no).extend(
            [f"--nnodes {s.nodes}", "--node-rank $NODE_RANK", "--master-addr $HEAD_ADDR"])
    if dp_hosts:  # host 0 serves HTTP and reaches the other hosts' engine cores there (engine/dp_hosts.py)
        ok.append("--data-parallel-address $HEAD_ADDR")
    return ok, no


def vllm_command(s: LaunchSpec, hf_model: str) -> str:
    lay = s.layout
    parts = [f"vllm serve {hf_model} --trust-remote-code", f"--tensor-parallel-size {lay.tp}",
             f"--pipeline-parallel-size {lay.pp}"]
    if lay.dp > 1:
        parts.append(f"--data-parallel-size {lay.dp}")
    parts += ["--enable-expert-parallel", f"--max-model-len {s.context_length}", f"--max-num-seqs {s.max_num_seqs}",
              f"--max-num-batched-tokens {s.max_num_batched_tokens}",
              f"--gpu-memory-utilization {s.gpu_memory_utilization}"]
    if s.kv_cache_dtype == "fp8":
        parts.append("--kv-cache-dtype fp8")
    engine_gpus = lay.tp * lay.pp
    if s.nodes > 1 and lay.dp > 1 and engine_gpus <= s.gpus_per_node:
        # one engine per DP rank: vLLM's multi-node data parallel (head node API server + headless workers)
        local = s.gpus_per_node // engine_gpus
        parts += [f"--data-parallel-size-local {local}", "--data-parallel-address $HEAD_ADDR",
                  "--data-parallel-rpc-port 13345", f"--data-parallel-start-rank $((NODE_RANK * {local}))",
                  "$([ $NODE_RANK -gt 0 ] && echo --headless)"]
    elif s.nodes > 1:
        parts.append("--distributed-executor-backend ray  # after `ray start` on every node")
    return " ".join(parts)


def sglang_command(s: LaunchSpec, hf_model: str) -> str:
    lay = s.layout
    stage = lay.tp * lay.dp  # SGLang's --tp counts every GPU of a stage; dp attention subdivides it
    parts = [f"python -m sglang.launch_server --model-path {hf_model} --trust-remote-code", f"--tp {stage}"]
    if lay.pp > 1:
        parts.append(f"--pp-size {lay.pp}")
    if lay.dp > 1:
        parts += [f"--dp {lay.dp}", "--enable-dp-attention", "--enable-dp-lm-head"]
    parts += [f"--ep-size {lay.ep}", f"--context-length {s.context_length}",
              f"--max-running-requests {s.max_num_seqs}", f"--chunked-prefill-size {s.max_num_batched_tokens}",
              f"--mem-fraction-static {s.gpu_memory_utilization}"]
    if s.kv_cache_dtype == "fp8":
        parts.append("--kv-cache-dtype fp8_e4m3")
    if s.nodes > 1:
        parts += [f"--nnodes {s.nodes}", "--node-rank $NODE_RANK", "--dist-init-addr $HEAD_ADDR:5000"]
    return " ".join(parts)


def commands(s: LaunchSpec, hf_model: str) -> dict[str, str]:
    return {"k3serve": k3serve_command(s, hf_model), "vllm": vllm_command(s, hf_model),
            "sglang": sglang_command(s, hf_model)}
