"""The deployment plan: smallest replica that fits, its layout, capacity, rooflines and launch commands.

Fit rule, per GPU and per pipeline stage: ``usable * gpu_memory_utilization`` must hold the stage's weights,
a runtime reserve (CUDA context, cuBLAS/NCCL workspaces, CUDA graphs: AIConfigurator's flat 3.5 GiB plus
0.4 GB of NCCL buffers when the replica has more than one GPU), the peak activations of one
``max_num_batched_tokens`` forward, and the KV cache + KDA state of at least one sequence at the context
length. The minimum replica is the smallest power of two for which some layout passes. Among passing layouts
of one size the plan takes the largest max concurrency at the context length, then the fastest roofline
decode, then the fewest pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3serve.core.config import ModelConfig
from k3serve.plan.gpus import GPU, NVL72_GPUS
from k3serve.plan.launch import LaunchSpec, commands, k3serve_command, k3serve_not_yet_supported, k3serve_runs
from k3serve.plan.layout import Layout, StageMemory, activation_bytes, layout_problem, stage_memory
from k3serve.plan.model_math import PRECISIONS, ParamSummary, components
from k3serve.plan.roofline import DecodeEstimate, PrefillEstimate, decode, prefill

GIB = 2**30
RUNTIME_RESERVE = 3.5 * GIB  # AIConfigurator "other_mem"
NCCL_RESERVE = 0.4e9  # AIConfigurator charges 342-392 MB per rank at TP >= 2
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}
MAX_REPLICA_GPUS = 1024
FUSED_KDA_HEADS_PER_RANK = (12, 24, 48, 96)  # vLLM's fused KDA decode kernel (model.md §1.6)


@dataclass(frozen=True)
class PlanInputs:
    gpu: GPU
    context_length: int
    num_gpus: int | None = None  # GPUs per replica; None = the smallest that serves the request
    concurrency: int | None = None
    precision: str = "mxfp4"
    kv_cache_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.90
    max_num_batched_tokens: int = 8192
    state_slots: int = 1
    layout: Layout | None = None  # forces tp/pp/dp

    def __post_init__(self) -> None:
        if self.context_length < 1:
            raise ValueError(f"context length must be >= 1, got {self.context_length}")
        if self.num_gpus is not None and not 1 <= self.num_gpus <= MAX_REPLICA_GPUS:
            raise ValueError(f"--num-gpus must be in 1..{MAX_REPLICA_GPUS}, got {self.num_gpus}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}")
        if self.kv_cache_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"unknown KV cache dtype {self.kv_cache_dtype!r}; known: {', '.join(KV_DTYPE_BYTES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < 1 or self.state_slots < 1:
            raise ValueError("--max-num-batched-tokens and --state-slots must be >= 1")

    @property
    def budget(self) -> float:
        return self.gpu.usable_bytes * self.gpu_memory_utilization


@dataclass(frozen=True)
class LayoutFit:
    """One layout's per-GPU memory (worst stage) and capacity at the context length."""

    layout: Layout
    stages: tuple[StageMemory, ...]
    weights_per_gpu: float
    reserve_per_gpu: float
    activations_per_gpu: float
    kv_pool_per_gpu: float
    seq_bytes_per_gpu: float  # one sequence at the context length: KV + state slots, worst stage
    max_concurrency: int
    kv_tokens: int  # replica KV capacity in tokens (every attention-DP group holds its own)

    @property
    def fits(self) -> bool:
        return self.max_concurrency >= 1


def fit_layout(cfg: ModelConfig, inp: PlanInputs, lay: Layout) -> LayoutFit:
    stages = stage_memory(cfg, lay, inp.precision, KV_DTYPE_BYTES[inp.kv_cache_dtype])
    reserve = RUNTIME_RESERVE + (NCCL_RESERVE if lay.gpus > 1 else 0)
    act = activation_bytes(cfg, lay, inp.max_num_batched_tokens)
    pools = [inp.budget - st.weights - reserve - act for st in stages]
    per_seq = [inp.context_length * st.kv_bytes_per_token + inp.state_slots * st.state_bytes_per_seq
               for st in stages]
    per_group = min(max(0, math.floor(p / s)) if s > 0 else 0 for p, s in zip(pools, per_seq))
    kv_stages = [(p, st.kv_bytes_per_token) for p, st in zip(pools, stages) if st.kv_bytes_per_token > 0]
    kv_tok = min((max(0, math.floor(p / b)) for p, b in kv_stages), default=0)
    return LayoutFit(lay, tuple(stages), max(st.weights for st in stages), reserve, act, min(pools),
                     max(per_seq), lay.dp * per_group, lay.dp * kv_tok)


def candidate_layouts(cfg: ModelConfig, gpu: GPU, n: int) -> list[Layout]:
    """Every ``tp x pp x dp = n`` the model allows with TP inside one NVLink domain and no more pipeline
    stages than NVLink domains: inside a domain TP/EP/attention-DP are faster than PP, which multiplies the
    time per output token by ``pp`` (vLLM's rule: TP = GPUs per node, PP = nodes)."""
    out = []
    max_pp = -(-n // gpu.nvlink_domain)
    for tp in (d for d in range(1, min(n, gpu.nvlink_domain) + 1) if n % d == 0):
        for pp in (d for d in range(1, min(n // tp, max_pp) + 1) if (n // tp) % d == 0):
            lay = Layout(tp, pp, n // (tp * pp))
            if layout_problem(cfg, lay) is None:
                out.append(lay)
    return out


@dataclass(frozen=True)
class Plan:
    gpu: str
    replica_gpus: int
    min_gpus_per_replica: int
    layout: Layout
    fit: LayoutFit
    context_length: int
    concurrency: int
    gpus_per_node: int
    nodes_per_replica: int
    replicas_per_node: int  # 0 when one replica spans several nodes
    replicas_per_rack: int | None
    decode_batch1: DecodeEstimate
    decode_at_concurrency: DecodeEstimate
    prefill: PrefillEstimate
    commands: dict[str, str]
    alternatives: tuple[tuple[str, int, float], ...]  # (layout, max concurrency, decode tokens/s)
    warnings: tuple[str, ...] = ()
    k3serve_not_yet_supported: tuple[str, ...] = ()  # flags the replica needs that k3serve refuses today
    # when k3serve cannot run the planned layout: the best one it runs, at this context or the longest that fits
    k3serve_today: dict | None = None


class Planner:
    """Plans one model on one GPU type; stateless apart from the model figures it computes once."""

    def __init__(self, cfg: ModelConfig, model_name: str = "kimi-k3", hf_model: str = "moonshotai/Kimi-K3"):
        self.cfg, self.model_name, self.hf_model = cfg, model_name, hf_model
        self.params = ParamSummary.of(cfg)

    def _ranked(self, inp: PlanInputs, n: int) -> list[tuple[LayoutFit, DecodeEstimate]]:
        lays = [inp.layout] if inp.layout else candidate_layouts(self.cfg, inp.gpu, n)
        fits = [f for f in (fit_layout(self.cfg, inp, lay) for lay in lays) if f.fits]
        scored = [(f, self._decode(inp, f, f.max_concurrency)) for f in fits]
        scored.sort(key=lambda fd: (-fd[0].max_concurrency, -fd[1].tokens_per_s, fd[0].layout.pp))
        return scored

    def _decode(self, inp: PlanInputs, f: LayoutFit, concurrency: int) -> DecodeEstimate:
        expert_each = next(c for c in components(self.cfg) if c.name == "routed_experts").bytes_each(
            PRECISIONS[inp.precision])
        return decode(self.cfg, self.params, inp.gpu, f.layout, list(f.stages), expert_each, concurrency,
                      inp.context_length)

    def min_gpus(self, inp: PlanInputs) -> int:
        n = 1
        while n <= MAX_REPLICA_GPUS:
            if any(fit_layout(self.cfg, inp, lay).fits for lay in candidate_layouts(self.cfg, inp.gpu, n)):
                return n
            n *= 2
        raise ValueError(f"impossible plan: {self.model_name} does not fit on {MAX_REPLICA_GPUS} {inp.gpu.name}s "
                         f"at context {inp.context_length}")

    def plan(self, inp: PlanInputs, warnings: tuple[str, ...] = ()) -> Plan:
        t, gpu = self.cfg.text, inp.gpu
        if inp.context_length > t.max_position_embeddings:
            raise ValueError(f"impossible plan: context length {inp.context_length} exceeds the model's "
                             f"max_position_embeddings {t.max_position_embeddings}")
        if inp.layout is not None and inp.num_gpus is not None and inp.layout.gpus != inp.num_gpus:
            raise ValueError(f"layout {inp.layout} uses {inp.layout.gpus} GPUs, --num-gpus says {inp.num_gpus}")
        if inp.layout is not None and (why := layout_problem(self.cfg, inp.layout)):
            raise ValueError(f"impossible plan: {why}")
        minimum = self.min_gpus(inp)
        n = inp.num_gpus or (inp.layout.gpus if inp.layout else minimum)
        ranked = self._ranked(inp, n)
        while not inp.num_gpus and not inp.layout and inp.concurrency and n < MAX_REPLICA_GPUS and (
                not ranked or ranked[0][0].max_concurrency < inp.concurrency):
            n *= 2
            ranked = self._ranked(inp, n)
        if not ranked:
            raise ValueError(f"impossible plan: {self.model_name} on {n} {gpu.name} at context "
                             f"{inp.context_length:,} does not fit: {self._why_not(inp, n, minimum)}")
        best, _ = ranked[0]
        if inp.concurrency and best.max_concurrency < inp.concurrency:
            raise ValueError(f"impossible plan: {n} {gpu.name} hold at most {best.max_concurrency} sequences of "
                             f"{inp.context_length} tokens, --concurrency asks for {inp.concurrency}")
        conc = inp.concurrency or best.max_concurrency
        launch = LaunchSpec(best.layout, gpu.gpus_per_node, inp.context_length, conc,
                            inp.gpu_memory_utilization, inp.kv_cache_dtype, inp.max_num_batched_tokens)
        return Plan(
            gpu=gpu.name, replica_gpus=n, min_gpus_per_replica=minimum, layout=best.layout, fit=best,
            context_length=inp.context_length, concurrency=conc, gpus_per_node=gpu.gpus_per_node,
            nodes_per_replica=-(-n // gpu.gpus_per_node), replicas_per_node=gpu.gpus_per_node // n,
            replicas_per_rack=NVL72_GPUS // n if gpu.is_rack_scale else None,
            decode_batch1=self._decode(inp, best, 1), decode_at_concurrency=self._decode(inp, best, conc),
            prefill=prefill(self.cfg, self.params, gpu, best.layout, inp.context_length),
            commands=commands(launch, self.hf_model),
            alternatives=tuple((str(f.layout), f.max_concurrency, round(d.tokens_per_s, 1)) for f, d in ranked[:6]),
            warnings=warnings + self._layout_warnings(inp, best.layout, n),
            k3serve_not_yet_supported=k3serve_not_yet_supported(launch),
            k3serve_today=None if k3serve_runs(launch) else self._k3serve_today(inp, n, conc),
        )

    def _k3serve_today(self, inp: PlanInputs, n: int, concurrency: int) -> dict | None:
        """The best layout of ``n`` GPUs ``k3serve serve`` runs today, with its command: at the asked context
        if one fits (concurrency up to the plan's), else at the longest context one holds (a multiple of 1,024
        tokens); None when no such layout holds even that. Same ranking as the plan's."""
        gpu = inp.gpu

        def spec(lay: Layout, context: int, conc: int) -> LaunchSpec:
            return LaunchSpec(lay, gpu.gpus_per_node, context, conc, inp.gpu_memory_utilization,
                              inp.kv_cache_dtype, inp.max_num_batched_tokens)

        lays = [lay for lay in candidate_layouts(self.cfg, gpu, n) if k3serve_runs(spec(lay, 1, 1))]
        context, reason = inp.context_length, "fits"
        if not any(fit_layout(self.cfg, inp, lay).fits for lay in lays):
            longest = max((self._longest_context(inp, lay) for lay in lays), default=0) // 1024 * 1024
            if longest < 1024:
                return None
            context, reason = min(longest, inp.context_length), "longest"
        at = PlanInputs(**{**inp.__dict__, "context_length": context, "layout": None, "concurrency": None})
        fits = [f for f in (fit_layout(self.cfg, at, lay) for lay in lays) if f.fits]
        scored = sorted(((f, self._decode(at, f, f.max_concurrency)) for f in fits),
                        key=lambda fd: (-fd[0].max_concurrency, -fd[1].tokens_per_s))
        best, dec = scored[0]
        conc = min(concurrency, best.max_concurrency) if reason == "fits" else best.max_concurrency
        return {"layout": str(best.layout), "context_length": context, "reason": reason,
                "max_concurrency": best.max_concurrency, "decode_tokens_per_s": round(dec.tokens_per_s, 1),
                "command": k3serve_command(spec(best.layout, context, conc), self.hf_model)}

    def _longest_context(self, inp: PlanInputs, lay: Layout) -> int:
        """The longest sequence one attention-DP group of ``lay`` holds (KV + KDA state of one sequence)."""
        f = fit_layout(self.cfg, inp, lay)
        out = []
        for st in f.stages:
            pool = inp.budget - st.weights - f.reserve_per_gpu - f.activations_per_gpu
            room = pool - inp.state_slots * st.state_bytes_per_seq
            out.append(int(room / st.kv_bytes_per_token) if st.kv_bytes_per_token else 1 << 62)
        return max(0, min(out))

    def _why_not(self, inp: PlanInputs, n: int, minimum: int) -> str:
        """Which memory term fails for the closest layout of ``n`` GPUs, and what would fit instead."""
        lays = [inp.layout] if inp.layout else candidate_layouts(self.cfg, inp.gpu, n)
        if not lays:
            return f"no tp x pp x dp layout of {n} GPUs suits the model's head and expert counts"
        f = max((fit_layout(self.cfg, inp, lay) for lay in lays),
                key=lambda f: f.kv_pool_per_gpu - f.seq_bytes_per_gpu)
        gb = 1e9
        fixed = (f"{f.layout} per GPU: weights {f.weights_per_gpu / gb:.1f} GB + runtime reserve "
                 f"{f.reserve_per_gpu / gb:.1f} GB + activations {f.activations_per_gpu / gb:.1f} GB")
        budget = f"the budget of {inp.budget / gb:.1f} GB (--gpu-memory-utilization {inp.gpu_memory_utilization} of an {inp.gpu.name})"
        if f.kv_pool_per_gpu <= 0:
            out = f"{fixed} exceed {budget} by {-f.kv_pool_per_gpu / gb:.1f} GB before any KV cache"
        else:
            st = max(f.stages, key=lambda st: inp.context_length * st.kv_bytes_per_token)
            kv, state = inp.context_length * st.kv_bytes_per_token, inp.state_slots * st.state_bytes_per_seq
            out = (f"{fixed} leave {f.kv_pool_per_gpu / gb:.1f} GB of {budget} for KV cache and KDA state, and one "
                   f"{inp.context_length:,}-token sequence needs {f.seq_bytes_per_gpu / gb:.1f} GB (MLA latent KV "
                   f"{kv / gb:.1f} GB, whole on every TP rank, + KDA state {state / gb:.2f} GB)")
            longest = int((f.kv_pool_per_gpu - state) / st.kv_bytes_per_token) if st.kv_bytes_per_token else 0
            if longest > 0:
                out += f"; this layout holds a context of up to {longest:,} tokens"
        lay = f.layout
        deeper = Layout(lay.tp, lay.pp * 2, lay.dp)  # pipeline stages split the layers: weights and KV per GPU
        if layout_problem(self.cfg, deeper) is None and fit_layout(self.cfg, inp, deeper).fits:
            out += (f"; it needs pipeline parallelism: {deeper.pp} stages ({deeper}, {deeper.gpus} GPUs) fit "
                    "(k3serve has no PP yet: use the vllm or sglang line)")
        if not inp.layout and minimum > n:
            out += f"; the smallest replica that fits is {minimum} GPUs"
        elif inp.layout and minimum <= n:
            out += f"; without --tp/--pp/--attn-dp, {n} GPUs fit with another layout (drop the forced layout)"
        return out

    def _layout_warnings(self, inp: PlanInputs, lay: Layout, n: int) -> tuple[str, ...]:
        gpu, out = inp.gpu, []
        total_heads = self.cfg.text.linear_attn.num_heads
        heads = total_heads // lay.tp
        if total_heads in FUSED_KDA_HEADS_PER_RANK and heads not in FUSED_KDA_HEADS_PER_RANK:
            out.append(f"{heads} KDA heads per TP rank: vLLM's fused KDA decode kernel needs one of "
                       f"{FUSED_KDA_HEADS_PER_RANK}")
        if lay.tp > gpu.nvlink_domain:
            out.append(f"TP {lay.tp} spans beyond the {gpu.nvlink_domain}-GPU NVLink domain: its all-reduces "
                       "cross the scale-out network")
        if n > gpu.gpus_per_node and n % gpu.gpus_per_node:
            out.append(f"a {n}-GPU replica leaves part of a {gpu.gpus_per_node}-GPU node idle")
        if gpu.is_rack_scale and NVL72_GPUS % n and n <= NVL72_GPUS:
            out.append(f"{NVL72_GPUS // n} replicas of {n} leave {NVL72_GPUS % n} GPUs of a {gpu.rack} rack idle")
        if gpu.is_rack_scale and n > NVL72_GPUS:
            out.append(f"a {n}-GPU replica spans {-(-n // NVL72_GPUS)} {gpu.rack} racks (off-rack traffic "
                       "leaves NVLink)")
        return tuple(out)
