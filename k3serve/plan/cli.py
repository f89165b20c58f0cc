"""``k3serve plan``: deployment plan of a model on a GPU type (memory, layout, capacity, rooflines, launch).

Without ``--gpu`` it reports the model figures and, for every GPU of the sourced table, the minimum GPUs per
replica and replicas per node / NVL72 rack. With ``--gpu`` it plans one replica in full.
"""

from __future__ import annotations

import argparse
import json
import re

from k3serve.plan.gpus import GPU, GPUS, lookup
from k3serve.plan.layout import Layout
from k3serve.plan.model_source import load_model_config
from k3serve.plan.planner import KV_DTYPE_BYTES, Planner, PlanInputs
from k3serve.plan.model_math import PRECISIONS
from k3serve.plan.report import GIB, model_figures, model_text, plan_dict, plan_text, summary_text

HF_NAMES = {"kimi-k3": "moonshotai/Kimi-K3", "kimi-linear-48b": "moonshotai/Kimi-Linear-48B-A3B-Instruct"}
_UNITS = {"": 1e9, "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40, "mb": 1e6, "mib": 2**20}
CONSISTENT = 0.03  # a stated memory size within 3% of the table's nominal or usable figure agrees with it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("Without --gpu: model figures plus the minimum replica of every GPU in the table "
                f"({', '.join(GPUS)}).\n"
                "Minimum replica: the smallest power of two whose GPUs (x --gpu-memory-utilization) hold the weights, "
                "a runtime reserve,\nthe activations and one sequence at the context length; the layout maximises "
                "concurrency at that length.\nSizes: --context-length accepts 131072, 128k or 1M (k = 1024); "
                "--gpu-memory accepts 192GB, 180GiB (plain numbers are GB).\n"
                "A --gpu-memory that contradicts the table is reported as a warning.\n"
                "Bad input (unknown GPU, a plan that cannot fit) prints one line and exits 1.")
    p.add_argument("--model", default="kimi-k3", help="packaged config name (kimi-k3, kimi-linear-48b, k3-tiny, ...), "
                   "a config.json or a checkpoint directory (default: kimi-k3)")
    p.add_argument("--gpu", help="GPU type from the table; omit to summarise every GPU")
    p.add_argument("--num-gpus", type=int, help="GPUs per replica (default: the smallest that fits, grown to "
                   "reach --concurrency)")
    p.add_argument("--context-length", help="tokens per sequence to size KV for (default: the model's maximum)")
    p.add_argument("--concurrency", type=int, help="running sequences to plan for (default: the maximum that fits)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="mxfp4",
                   help="routed-expert storage; the rest stays BF16 with small F32 tensors (default: mxfp4)")
    p.add_argument("--kv-cache-dtype", choices=list(KV_DTYPE_BYTES), default="bf16")
    p.add_argument("--gpu-memory", help="the memory per GPU you expect, checked against the table (the plan "
                   "always uses the table's usable figure)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="fraction of usable memory the engine may take (default: 0.90)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per forward, sizes the activation reserve (default: 8192)")
    p.add_argument("--state-slots", type=int, default=1, help="KDA state slots per running request (default 1; "
                   "SGLang's extra_buffer prefix-cache strategy keeps 5)")
    p.add_argument("--tp", type=int, help="force attention tensor parallelism (with --pp/--attn-dp)")
    p.add_argument("--pp", type=int, default=None, help="force pipeline stages (default 1 when --tp is given)")
    p.add_argument("--attn-dp", type=int, default=None, help="force attention data parallelism (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def parse_tokens(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", s)
    if not m:
        raise ValueError(f"--context-length {s!r}: expected a token count such as 131072, 128k or 1M")
    scale = {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_bytes(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", s)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu-memory {s!r}: expected a size such as 192GB or 180GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def check_memory(gpu: GPU, stated: int) -> list[str]:
    """Warnings where a stated memory size contradicts the table (the plan always uses the table)."""
    nominal = gpu.nominal_gb * 1e9
    if min(abs(stated - nominal) / nominal, abs(stated - gpu.usable_bytes) / gpu.usable_bytes) <= CONSISTENT:
        return []
    same = [g.name for g in GPUS.values() if g is not gpu and abs(stated - g.nominal_gb * 1e9) <= CONSISTENT * stated]
    hint = f"; {stated / 1e9:.0f} GB is the {'/'.join(same)} figure" if same else ""
    table = (f"{gpu.name} has {gpu.nominal_gb:.0f} GB ({gpu.usable_bytes / GIB:.1f} GiB usable) per the sourced "
             f"table [{gpu.source.split(';')[0]}]")
    return [f"--gpu-memory {stated / 1e9:.1f} GB contradicts the table: {table}{hint}; planning with the "
            "table's figure (lower --gpu-memory-utilization to hold memory back)"]


def _forced_layout(args: argparse.Namespace) -> Layout | None:
    if args.tp is None:
        if args.pp is not None or args.attn_dp is not None:
            raise ValueError("--pp/--attn-dp need --tp")
        return None
    return Layout(args.tp, args.pp or 1, args.attn_dp or 1)


def run(args: argparse.Namespace) -> int:
    name, cfg = load_model_config(args.model)
    planner = Planner(cfg, name, HF_NAMES.get(name, args.model))
    context = parse_tokens(args.context_length) if args.context_length else cfg.text.max_position_embeddings
    figures = model_figures(cfg, planner.params, context)
    common = dict(context_length=context, precision=args.precision, kv_cache_dtype=args.kv_cache_dtype,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  max_num_batched_tokens=args.max_num_batched_tokens, state_slots=args.state_slots)
    if args.gpu is None:
        for flag in ("num_gpus", "concurrency", "gpu_memory", "tp"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --gpu")
        rows = {}
        for gpu in GPUS.values():
            p = planner.plan(PlanInputs(gpu, **common))
            rows[gpu.name] = {"min_gpus_per_replica": p.min_gpus_per_replica, "layout": str(p.layout),
                              "replicas_per_node": p.replicas_per_node, "nodes_per_replica": p.nodes_per_replica,
                              "replicas_per_rack": p.replicas_per_rack, "max_concurrency": p.fit.max_concurrency}
        out = {"model": name, "figures": figures, "gpus": rows}
        lines = model_text(name, figures) + summary_text(rows)
    else:
        gpu = lookup(args.gpu)
        warnings = [] if args.gpu_memory is None else check_memory(gpu, parse_bytes(args.gpu_memory))
        inp = PlanInputs(gpu, num_gpus=args.num_gpus, concurrency=args.concurrency,
                         layout=_forced_layout(args), **common)
        plan = plan_dict(planner.plan(inp, tuple(warnings)))
        out = {"model": name, "figures": figures, "plan": plan}
        lines = model_text(name, figures) + plan_text(plan)
    print(json.dumps(out, indent=2) if args.json else "\n".join(lines))
    return 0
