"""The load loop: requests arrive on a schedule (Poisson/gamma gaps or trace timestamps), wait for a
concurrency slot and for their session's previous turn, then stream; a tqdm bar counts finished requests."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from k3serve.bench.client import Endpoint, RequestRecord, send
from k3serve.bench.datasets import BenchRequest


@dataclass(frozen=True, slots=True)
class LoadConfig:
    request_rate: float | None = None  # req/s; inf = all at once; None = trace timestamps (else inf)
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None
    time_scale: float = 1.0  # multiplies trace timestamps (< 1 replays faster)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0 or not self.time_scale > 0:
            raise ValueError("--burstiness and --trace-time-scale must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


def arrival_schedule(requests: list[BenchRequest], cfg: LoadConfig) -> list[float]:
    """Send times in seconds from the start, as vLLM draws them: the first at 0, then gamma-distributed gaps
    with mean 1/rate and shape ``burstiness`` (exponential, i.e. Poisson arrivals, at 1)."""
    n = len(requests)
    if cfg.request_rate is None and all(r.arrival_s is not None for r in requests):
        return [r.arrival_s * cfg.time_scale for r in requests]
    rate = math.inf if cfg.request_rate is None else cfg.request_rate
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(cfg.seed)
    gaps = rng.gamma(cfg.burstiness, 1.0 / (rate * cfg.burstiness), size=max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


async def run_load(client: httpx.AsyncClient, ep: Endpoint, requests: list[BenchRequest],
                   schedule: list[float], cfg: LoadConfig) -> tuple[list[RequestRecord], float]:
    """Run every request; returns the records (in dataset order) and the run's duration in seconds."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    finished = [asyncio.Event() for _ in requests]
    bar = tqdm(total=len(requests), file=sys.stderr, disable=not cfg.progress, unit="req", dynamic_ncols=True)

    async def one(i: int, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(i, schedule[i], input_tokens=req.prompt_len)
        try:
            if (delay := schedule[i] - clock()) > 0:
                await asyncio.sleep(delay)
            if req.after is not None:
                await finished[req.after].wait()  # waiting for a reply holds no concurrency slot
            async with slots or contextlib.nullcontext():
                await send(client, ep, req, rec, clock)
        finally:
            finished[i].set()
            bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        bar.close()
    return list(records), clock()
