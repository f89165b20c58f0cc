"""Mooncake-format request traces (FAST'25 release): reading and scaling.

One JSON object per line: ``timestamp`` (ms from trace start), ``input_length`` and ``output_length``
(tokens), ``hash_ids`` (one id per 512-token prompt block, the last usually partial; ids are prefix-chain
identities, so equal leading ids mean equal leading tokens). See shared/traces/README.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake jsonl trace, sorted by arrival; raises ValueError naming the bad line and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    requests: list[TraceRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(_parse(json.loads(line)))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: bad trace record: {e}") from None
    if not requests:
        raise ValueError(f"{path}: trace is empty")
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _parse(rec: object) -> TraceRequest:
    if not isinstance(rec, dict):
        raise ValueError("expected a JSON object")
    for key in ("timestamp", "input_length", "output_length"):
        v = rec.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"'{key}' must be a non-negative number, got {v!r}")
    ids = rec.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise ValueError("'hash_ids' must be a list of non-negative ints")
    n_in = int(rec["input_length"])
    if n_in <= 0 or len(ids) != math.ceil(n_in / TRACE_BLOCK_TOKENS):
        raise ValueError(f"'hash_ids' has {len(ids)} ids for input_length {n_in} (need ceil(n/512) >= 1)")
    return TraceRequest(rec["timestamp"] / 1000.0, n_in, int(rec["output_length"]), tuple(ids))


def scale_trace(requests: list[TraceRequest], repeat: int = 1, time_scale: float = 1.0) -> list[TraceRequest]:
    """``repeat`` back-to-back copies, each with its own block ids (no reuse across copies), arrival times
    multiplied by ``time_scale`` (< 1 compresses: a higher request rate for a larger fleet)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if repeat == 1 and time_scale == 1.0:
        return list(requests)
    id_stride = 1 + max(max(r.block_ids) for r in requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    # one mean inter-arrival gap between copies, so the copies do not overlap
    period = span + span / max(1, len(requests) - 1)
    out: list[TraceRequest] = []
    for k in range(repeat):
        shift = k * id_stride
        for r in requests:
            out.append(TraceRequest(
                (r.arrival_s + k * period) * time_scale,
                r.input_tokens,
                r.output_tokens,
                tuple(h + shift for h in r.block_ids) if shift else r.block_ids,
            ))
    return out
