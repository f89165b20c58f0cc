"""``k3serve params``: total and active parameters of a model config, and its weight bytes per precision.

The issue-2 parameter-count script: every figure comes from ``k3serve.plan.model_math`` walking the
config's checkpoint tensor list (embedding excluded from "active", as the published K3 figure does).
"""

from __future__ import annotations

import argparse
import json

from k3serve.plan.model_math import ParamSummary
from k3serve.plan.model_source import load_model_config
from k3serve.plan.units import count, nbytes, nbytes_binary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="kimi-k3", help="packaged config name (kimi-k3, kimi-linear-48b, "
                        "k3-tiny, ...), a config.json or a checkpoint directory (default: kimi-k3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    name, cfg = load_model_config(args.model)
    s = ParamSummary.of(cfg)
    if args.json:
        print(json.dumps({"model": name, "total": s.total, "active": s.active,
                          "active_with_input_embedding": s.active_with_embedding,
                          "by_component": s.by_component, "weight_bytes": s.weight_bytes}, indent=2))
        return 0
    print(f"{name}: {s.total:,} params ({count(s.total)}), {s.active:,} active per token "
          f"({count(s.active)}; {count(s.active_with_embedding)} counting the input embedding)")
    for comp, n in s.by_component.items():
        print(f"  {comp:16s} {n:>18,}")
    for prec, b in s.weight_bytes.items():
        label = {"mxfp4": "MXFP4 experts + BF16 rest", "mxfp8": "MXFP8 experts + BF16 rest"}.get(prec, "all BF16")
        print(f"  weights {label:26s} {nbytes(b):>12} ({nbytes_binary(b)})")
    return 0
