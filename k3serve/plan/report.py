"""Plan and model figures as a JSON-ready dict and as human-readable text."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from k3serve.core.config import ModelConfig
from k3serve.plan.model_math import ParamSummary, kda_state_bytes_per_sequence, mla_kv_bytes_per_token
from k3serve.plan.layout import SPLIT_RULES
from k3serve.plan.planner import Plan
from k3serve.plan.units import count, nbytes, nbytes_binary

GB, GIB, MIB, KIB = 1e9, 2**30, 2**20, 2**10


def model_figures(cfg: ModelConfig, params: ParamSummary, context_length: int) -> dict[str, Any]:
    t = cfg.text
    kv_tok = {"bf16": mla_kv_bytes_per_token(t, 2), "fp8": mla_kv_bytes_per_token(t, 1)}
    state = kda_state_bytes_per_sequence(t)
    return {
        "params": {"total": params.total, "active": params.active,
                   "active_with_input_embedding": params.active_with_embedding,
                   "by_component": params.by_component},
        "weight_bytes": params.weight_bytes,
        "weight_gb": {k: round(v / GB, 1) for k, v in params.weight_bytes.items()},
        "mla_kv_bytes_per_token": kv_tok,
        "mla_kv_kib_per_token": {k: v / KIB for k, v in kv_tok.items()},
        "kda_state_bytes_per_sequence": state,
        "kda_state_mib_per_sequence": round(state / MIB, 1),
        "context_length": context_length,
        "max_position_embeddings": t.max_position_embeddings,
        "kv_bytes_per_sequence": {k: v * context_length for k, v in kv_tok.items()},
        "kv_gib_per_sequence": {k: round(v * context_length / GIB, 2) for k, v in kv_tok.items()},
    }


def plan_dict(p: Plan) -> dict[str, Any]:
    f = p.fit
    worst = max(f.stages, key=lambda s: s.weights)
    return {
        "gpu": p.gpu,
        "min_gpus_per_replica": p.min_gpus_per_replica,
        "replica_gpus": p.replica_gpus,
        "layout": {"tp": p.layout.tp, "pp": p.layout.pp, "attn_dp": p.layout.dp, "ep": p.layout.ep,
                   "name": str(p.layout)},
        "split_rules": SPLIT_RULES,
        "gpus_per_node": p.gpus_per_node,
        "nodes_per_replica": p.nodes_per_replica,
        "replicas_per_node": p.replicas_per_node,
        "replicas_per_rack": p.replicas_per_rack,
        "memory_per_gpu_bytes": {
            "weights": f.weights_per_gpu, "routed_experts": worst.experts, "attention": worst.attention,
            "shared_experts_dense_mlp": worst.shared_dense, "replicated_router_latent_norms": worst.replicated,
            "embedding": worst.embedding, "lm_head": worst.lm_head, "vision": worst.vision,
            "runtime_reserve": f.reserve_per_gpu, "activations": f.activations_per_gpu,
            "kv_and_state_pool": f.kv_pool_per_gpu, "one_sequence_at_context": f.seq_bytes_per_gpu,
        },
        "stages": [{"layers": list(s.layers), "weights_bytes": s.weights,
                    "kv_bytes_per_token_per_gpu": s.kv_bytes_per_token,
                    "kda_state_bytes_per_sequence_per_gpu": s.state_bytes_per_seq} for s in f.stages],
        "context_length": p.context_length,
        "max_concurrency": f.max_concurrency,
        "kv_tokens_per_replica": f.kv_tokens,
        "concurrency": p.concurrency,
        "decode_batch1": asdict(p.decode_batch1),
        "decode_at_concurrency": asdict(p.decode_at_concurrency),
        "prefill": asdict(p.prefill),
        "commands": p.commands,
        "k3serve_not_yet_supported": list(p.k3serve_not_yet_supported),
        "k3serve_today": p.k3serve_today,
        "alternatives": [{"layout": n, "max_concurrency": c, "decode_tokens_per_s": d} for n, c, d in p.alternatives],
        "warnings": list(p.warnings),
    }


_b = nbytes


def model_text(name: str, m: dict[str, Any]) -> list[str]:
    p, w, kv = m["params"], m["weight_bytes"], m["mla_kv_bytes_per_token"]
    return [
        f"model {name}: {count(p['total'])} params, {count(p['active'])} active per token "
        f"({count(p['active_with_input_embedding'])} counting the input embedding)",
        f"  weights: {nbytes(w['mxfp4'])} MXFP4 experts + BF16 rest | {nbytes(w['mxfp8'])} MXFP8 | "
        f"{nbytes(w['bf16'])} BF16",
        f"  MLA KV: {nbytes_binary(kv['bf16'])}/token BF16, {nbytes_binary(kv['fp8'])} FP8; at "
        f"{m['context_length']:,} tokens {nbytes_binary(m['kv_bytes_per_sequence']['bf16'])} per sequence (BF16)",
        f"  KDA state: {nbytes_binary(m['kda_state_bytes_per_sequence'])} per sequence "
        "(fp32 recurrent + bf16 conv)",
    ]


def _placement(d: dict[str, Any]) -> str:
    """Where one replica sits: several per node, one node, or several nodes (then "per node" is not a count
    of replicas, which would be 0)."""
    n, per_node, nodes = d["replica_gpus"], d["gpus_per_node"], d["nodes_per_replica"]
    if nodes > 1:
        return f"{nodes} nodes of {per_node} GPUs per replica"
    if d["replicas_per_node"] > 1:
        return f"{d['replicas_per_node']} replicas per {per_node}-GPU node"
    return f"one {per_node}-GPU node" + (f", {per_node - n} GPUs of it idle" if n < per_node else "")


def plan_text(d: dict[str, Any]) -> list[str]:
    lay, mem = d["layout"], d["memory_per_gpu_bytes"]
    rack = f", {d['replicas_per_rack']} replicas per NVL72 rack" if d["replicas_per_rack"] is not None else ""
    dec1, dec, pre = d["decode_batch1"], d["decode_at_concurrency"], d["prefill"]
    out = [
        f"plan on {d['gpu']}: minimum {d['min_gpus_per_replica']} GPUs per replica; planned replica "
        f"{d['replica_gpus']} GPUs ({_placement(d)}{rack})",
        f"  layout {lay['name']}: TP {lay['tp']} x PP {lay['pp']} x attention-DP {lay['attn_dp']}, EP {lay['ep']}",
        f"  per GPU: weights {_b(mem['weights'])} (experts {_b(mem['routed_experts'])}, attention "
        f"{_b(mem['attention'])}, shared+dense {_b(mem['shared_experts_dense_mlp'])}, replicated "
        f"{_b(mem['replicated_router_latent_norms'])}), reserve {_b(mem['runtime_reserve'])}, activations "
        f"{_b(mem['activations'])}, KV+state pool {_b(mem['kv_and_state_pool'])}",
        f"  capacity at {d['context_length']:,} tokens: max concurrency {d['max_concurrency']}, "
        f"{d['kv_tokens_per_replica']:,} KV tokens per replica; planned concurrency {d['concurrency']}",
        f"  roofline decode: batch 1 {dec1['step_ms']:.2f} ms/token; at {dec['concurrency']} sequences "
        f"{dec['step_ms']:.1f} ms/token, {dec['tokens_per_s']:,.0f} tok/s ({dec['tokens_per_s_per_gpu']:,.0f} per GPU, "
        f"{dec['bound']}-bound)",
        f"  roofline prefill of {pre['prompt_tokens']:,} tokens: {pre['seconds']:.2f} s, "
        f"{pre['tokens_per_s']:,.0f} tok/s (attention {pre['attention_share']:.0%} of FLOPs)",
        "  alternatives: " + (", ".join(f"{a['layout']} (conc {a['max_concurrency']}, "
                                        f"{a['decode_tokens_per_s']:,.0f} tok/s)" for a in d["alternatives"][1:])
                              or "none"),
        "  launch:",
    ]
    for k, v in d["commands"].items():
        out.append(f"    {k}: {v}")
        if k == "k3serve" and d["k3serve_not_yet_supported"]:
            out.append(f"      not yet supported by k3serve, needed by this {d['replica_gpus']}-GPU replica: "
                       f"{' '.join(d['k3serve_not_yet_supported'])}; until then use the vllm or sglang line")
            out += _k3serve_today(d)
    out += [f"  warning: {w}" for w in d["warnings"]]
    return out


def summary_text(rows: dict[str, dict[str, Any]]) -> list[str]:
    out = ["minimum GPUs per replica (weights + reserves + one sequence at the context length):"]
    for gpu, r in rows.items():
        rack = f", {r['replicas_per_rack']} per NVL72 rack" if r["replicas_per_rack"] is not None else ""
        k = r["replicas_per_node"]
        per = (f"{k} replica{'s' if k > 1 else ''} per node" if k
               else f"{r['nodes_per_replica']} nodes per replica")
        out.append(f"  {gpu:7s} {r['min_gpus_per_replica']:4d} GPUs ({r['layout']}), {per}{rack}, "
                   f"max concurrency {r['max_concurrency']}")
    return out


def _k3serve_today(d: dict[str, Any]) -> list[str]:
    """The best layout k3serve runs today when the plan's needs more (planner ``_k3serve_today``)."""
    t = d.get("k3serve_today")
    if t is None:
        return ["      k3serve today: no layout of these GPUs without pipeline stages holds even a short context"]
    if t["reason"] == "fits":
        head = f"{t['layout']} (max concurrency {t['max_concurrency']}, {t['decode_tokens_per_s']:,.0f} tok/s)"
    else:
        head = (f"no layout without pipeline stages holds {d['context_length']:,} tokens; the longest context one "
                f"holds is {t['context_length']:,} tokens ({t['layout']}, max concurrency {t['max_concurrency']}, "
                f"{t['decode_tokens_per_s']:,.0f} tok/s)")
    return [f"      k3serve today: {head}:", f"        {t['command']}"]
