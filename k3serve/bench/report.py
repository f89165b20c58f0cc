"""The human summary table (vLLM's layout) and the result JSON (vLLM's aggregate keys plus every request's raw
timestamps, so any metric can be recomputed)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3serve.bench.client import RequestRecord
from k3serve.bench.metrics import percentile_key

_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
WIDTH = 50


def _row(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>10}"


def summary_text(summary: dict[str, Any], header: dict[str, Any]) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    rows = [("Successful requests:", summary["completed"]), ("Failed requests:", summary["failed"]),
            ("Maximum request concurrency:", header.get("max_concurrency")),
            ("Request rate (req/s):", header.get("request_rate")),
            ("Benchmark duration (s):", summary["duration"]),
            ("Total input tokens:", summary["total_input_tokens"]),
            ("Total generated tokens:", summary["total_output_tokens"]),
            ("Request throughput (req/s):", summary["request_throughput"]),
            ("Request goodput (req/s):", summary["request_goodput"]),
            ("Output token throughput (tok/s):", summary["output_throughput"]),
            ("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"]),
            ("Peak concurrent requests:", summary["max_concurrent_requests"]),
            ("Total token throughput (tok/s):", summary["total_token_throughput"])]
    lines += [_row(label, value) for label, value in rows if value is not None]
    for name, (title, short) in _TITLES.items():
        lines.append(f" {title} ".center(WIDTH, "-"))
        lines.append(_row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", summary[f"median_{name}_ms"]))
        for p in header["metric_percentiles"]:
            lines.append(_row(f"P{percentile_key(p)} {short} (ms):", summary[f"p{percentile_key(p)}_{name}_ms"]))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def result_dict(header: dict[str, Any], summary: dict[str, Any], records: Sequence[RequestRecord]) -> dict[str, Any]:
    return {**header, **summary, "requests": [dataclasses.asdict(r) for r in records]}


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
