"""Modelled points: GPU layouts this machine cannot run, from the deployment planner (``k3serve plan``).

``--modelled GPU:N`` (e.g. ``GB300:8``, ``H200:16``) plans Kimi K3 on N GPUs of that type for every layout the
planner allows there (``candidate_layouts``) at a few decode concurrencies up to what the layout holds. Each
becomes a point with ``"modelled": true``: output tokens/s and TPOT from the planner's roofline decode at the
context length, TTFT from its roofline prefill of one prompt of that length. A roofline has no distribution,
so every percentile key carries the one modelled value (ITL = TPOT); these are upper bounds on throughput
(see plan/roofline.py for what is not modelled). The launch command is the planner's k3serve line; flags
k3serve cannot honour yet are listed beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k3serve.plan.gpus import GPU, lookup
from k3serve.plan.model_source import load_model_config
from k3serve.plan.planner import Planner, PlanInputs, candidate_layouts, fit_layout

DEFAULT_MODELLED = ("GB300:8", "H200:16")
CONCURRENCIES = (1, 16, 64, 256)
MODEL = "kimi-k3"


def parse_modelled(items: Sequence[str]) -> list[tuple[GPU, int]]:
    out = []
    for item in items:
        name, sep, n = item.partition(":")
        try:
            gpus = int(n)
        except ValueError:
            gpus = 0
        if not sep or gpus < 1:
            raise ValueError(f"--modelled {item!r}: expected GPU:N, e.g. GB300:8")
        out.append((lookup(name), gpus))  # lookup: one line naming the known GPUs
    return out


def modelled_points(specs: Sequence[tuple[GPU, int]], context: int,
                    percentiles: Sequence[float]) -> list[dict[str, Any]]:
    if context < 1:
        raise ValueError(f"--modelled-context must be >= 1, got {context}")
    name, cfg = load_model_config(MODEL)
    planner = Planner(cfg, name)
    out = []
    for gpu, n in specs:
        base = PlanInputs(gpu, context_length=context, num_gpus=n)
        layouts = [lay for lay in candidate_layouts(cfg, gpu, n) if fit_layout(cfg, base, lay).fits]
        if not layouts:
            raise ValueError(f"--modelled {gpu.name}:{n}: Kimi K3 does not fit on {n} {gpu.name} at context "
                             f"{context} (k3serve plan --gpu {gpu.name} says how many it needs)")
        for lay in layouts:
            most = fit_layout(cfg, base, lay).max_concurrency
            for conc in sorted({c for c in CONCURRENCIES if c <= most} | {most}):
                plan = planner.plan(PlanInputs(gpu, context_length=context, num_gpus=n, concurrency=conc,
                                               layout=lay))
                d, ttft_ms = plan.decode_at_concurrency, plan.prefill.seconds * 1e3
                point: dict[str, Any] = {
                    "key": f"{name} {gpu.name}x{n} {lay} context={context} concurrency={conc}", "model": name, "modelled": True,
                    "status": "ok", "gpu": gpu.name, "gpus": n, "layout": str(lay), "concurrency": conc,
                    "context": context, "bound": d.bound, "output_throughput": d.tokens_per_s,
                    "command": plan.commands["k3serve"],
                    "k3serve_not_yet_supported": list(plan.k3serve_not_yet_supported),
                }
                for p in percentiles:
                    tag = f"p{int(p) if float(p).is_integer() else p}"
                    point |= {f"{tag}_ttft_ms": ttft_ms, f"{tag}_tpot_ms": d.step_ms, f"{tag}_itl_ms": d.step_ms}
                out.append(point)
    return out
