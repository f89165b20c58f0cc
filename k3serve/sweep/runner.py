"""One measured point: start ``k3serve serve`` with the point's flags on 127.0.0.1 (a free port), warm it up,
run the bench workload through the bench's own load loop, summarise with the bench's metrics, stop the server.

The server always stops (SIGINT, then SIGKILL of its process group after a grace period), also when the
point times out, fails or the sweep is interrupted. A point that cannot start is a result with ``status``
"failed" and the server's last error line; the sweep goes on. The server's log is kept in ``log_dir``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from k3serve.bench.client import Endpoint, ServerUnavailable, make_client, served_model
from k3serve.bench.datasets import DatasetConfig, build_dataset
from k3serve.bench.metrics import summarize
from k3serve.bench.runner import LoadConfig, arrival_schedule, run_load
from k3serve.core.process import child_env, free_port
from k3serve.sweep.space import Point

STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class Workload:
    """A ``k3serve bench`` random-dataset run (token-id prompts, exact output lengths, fixed seed)."""

    num_prompts: int = 8
    input_len: int = 128
    output_len: int = 16
    prefix_len: int = 64  # shared by every prompt, so prefix caching has something to find
    max_concurrency: int | None = 4
    request_rate: float | None = None  # None: all at once (capped by max_concurrency)
    warmup: int = 2  # requests of the same shape (another seed, so another prefix) before the measured run
    seed: int = 0

    def __post_init__(self) -> None:
        self.dataset()  # the bench's own checks (one-line ValueErrors)
        LoadConfig(self.request_rate, max_concurrency=self.max_concurrency)
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")

    def dataset(self, seed: int | None = None, n: int | None = None) -> DatasetConfig:
        return DatasetConfig("random", n or self.num_prompts, self.input_len, self.output_len, 0.0,
                             self.prefix_len, seed=self.seed if seed is None else seed)

    def load(self) -> LoadConfig:
        return LoadConfig(self.request_rate, max_concurrency=self.max_concurrency, seed=self.seed, progress=False)


class PointFailed(Exception):
    """The point did not produce a measurement; the message is one line."""


class ServerProcess:
    """``k3serve serve`` in its own session, so stopping it reaches every process it started."""

    def __init__(self, point: Point, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "k3serve", "serve", *point.serve_args(), "--host", "127.0.0.1",
                "--port", str(self.port), "--disable-log-stats", "--disable-access-log"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=child_env())

    def wait_healthy(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise PointFailed(f"server exited with {self.proc.returncode}: {self.last_error()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise PointFailed("timed out waiting for the server to become healthy")
            time.sleep(0.3)

    def last_error(self) -> str:
        """The server's one-line error ('k3serve: error: ...') when it printed one, else its last line."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if "error" in ln.lower()]
        return (errors or lines or ["no output"])[-1][:300]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # graceful: the server stops its engine processes
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its session
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


async def _measure(url: str, workload: Workload, percentiles: tuple[float, ...]) -> dict[str, Any]:
    requests = build_dataset(workload.dataset())
    load = workload.load()
    async with make_client(600.0, None) as client:
        ep = Endpoint(url, "completions", await served_model(client, url, None))
        if workload.warmup:
            warm = build_dataset(workload.dataset(seed=workload.seed + 1, n=workload.warmup))
            warm_records, _ = await run_load(client, ep, warm, arrival_schedule(warm, load), load)
            if not any(r.success for r in warm_records):
                raise PointFailed(f"warm-up requests failed: {warm_records[0].error}")
        records, duration = await run_load(client, ep, requests, arrival_schedule(requests, load), load)
    summary = summarize(records, duration, percentiles)
    if summary["failed"]:
        summary["error"] = next(r.error for r in records if not r.success)[:300]
    return summary


def run_point(point: Point, workload: Workload, log_dir: Path, timeout_s: float,
              percentiles: tuple[float, ...] = (50, 90, 99)) -> dict[str, Any]:
    """The point's result dict (``status`` "ok" with the bench summary, or "failed" with ``error``)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    result: dict[str, Any] = {"status": "failed", "error": None}
    server = ServerProcess(point, log_dir / f"{_slug(point.key)}.log")
    try:
        server.wait_healthy(deadline)
        result["startup_s"] = round(time.monotonic() - t0, 2)
        summary = asyncio.run(asyncio.wait_for(_measure(server.url, workload, percentiles),
                                               max(1.0, deadline - time.monotonic())))
        result.update(summary, status="ok")
    except (PointFailed, ServerUnavailable) as e:
        result["error"] = str(e)
    except (TimeoutError, asyncio.TimeoutError):
        result["error"] = f"timed out after {timeout_s:.0f} s (--point-timeout)"
    except httpx.HTTPError as e:
        result["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        server.stop()
    result["wall_s"] = round(time.monotonic() - t0, 2)
    result["log"], result["port"] = str(server.log_path), server.port
    return result


def _slug(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:150]

