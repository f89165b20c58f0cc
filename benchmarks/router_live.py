"""Live router: measured prefix-cache hit rate of `kv` vs `round_robin` (and `least_load`, `session`) over
real replicas on 127.0.0.1.

    python benchmarks/router_live.py [--replicas 3] [--conversations 12] [--turns 6] [--policies kv,round_robin]

Starts N replicas of `kimi-linear-tiny-random` (`k3serve serve --kv-events`) and one `k3serve route` per
policy over the same replicas. Each policy gets its own conversations (fresh random tokens, so no policy
hits another's cache). A conversation is `--turns` sequential requests; turn t's prompt is turn t-1's
prompt plus a simulated assistant reply and a new user message (random token ids; the tiny model's
vocabulary cannot hold a chat template). Conversations run concurrently.

Reported per policy: the replicas' own prefix-cache hit rate (`vllm:prefix_cache_hits_total /
queries_total` deltas over the run: the engine's truth, not the router's prediction), the ideal hit rate
(every turn finds its previous turn's prompt-end KDA snapshot), mean and p90 request latency, and
requests per replica max/mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

MODEL = "kimi-linear-tiny-random"
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: str) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "k3serve", *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_healthy(url: str, procs: list[subprocess.Popen], want: int | None = None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a replica or router exited while starting (see the logs)")
        try:
            r = httpx.get(url + "/health", timeout=2, trust_env=False)
            if r.status_code == 200 and (want is None or r.json()["healthy_replicas"] == want):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} not healthy after {timeout:.0f} s")


def conversations(n: int, turns: int, reply: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        prompt = [rng.randrange(2000) for _ in range(rng.randrange(64, 160))]
        conv = [prompt]
        for _ in range(turns - 1):
            prompt = prompt + [rng.randrange(2000) for _ in range(reply + rng.randrange(16, 64))]
            conv.append(prompt)
        convs.append(conv)
    return convs


def ideal_hit_rate(convs: list[list[list[int]]]) -> float:
    hit = sum(len(c[t - 1]) // BLOCK * BLOCK for c in convs for t in range(1, len(c)))
    return hit / sum(len(p) for c in convs for p in c)


def engine_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=10, trust_env=False).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def run_policy(router: str, convs: list[list[list[int]]], reply: int) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        async def one(i: int, conv: list[list[int]]) -> None:
            for prompt in conv:
                t0 = time.perf_counter()
                r = await client.post(router + "/v1/completions", headers={"x-session-id": f"conv-{i}"}, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": reply, "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
    return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--reply", type=int, default=16, help="output tokens per turn")
    ap.add_argument("--policies", default="kv,round_robin,least_load,session")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    policies = args.policies.split(",")
    logs = tempfile.mkdtemp(prefix="router-live-")
    ports = [free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen] = []
    rows = []
    try:
        from k3serve.models.registry import resolve_model_path

        ckpt = str(resolve_model_path(MODEL))
        procs += [start(["serve", ckpt, "--served-model-name", MODEL, "--port", str(p), "--kv-events",
                         "--max-model-len", "2048"], f"{logs}/replica-{p}.log") for p in ports]
        routers = {}
        for policy in policies:
            port = free_port()
            procs.append(start(["route", *[a for u in urls for a in ("--replica", u)], "--port", str(port),
                                "--policy", policy], f"{logs}/router-{policy}.log"))
            routers[policy] = f"http://127.0.0.1:{port}"
        for url in routers.values():
            wait_healthy(url, procs, want=args.replicas)
        for k, policy in enumerate(policies):
            convs = conversations(args.conversations, args.turns, args.reply, seed=100 + k)
            h0, q0 = engine_counters(urls)
            t0 = time.perf_counter()
            lat = asyncio.run(run_policy(routers[policy], convs, args.reply))
            wall = time.perf_counter() - t0
            h1, q1 = engine_counters(urls)
            view = httpx.get(routers[policy] + "/router/replicas", trust_env=False).json()["replicas"]
            routed = [r["routed_requests"] for r in view]
            lat.sort()
            rows.append({"policy": policy, "hit_rate": (h1 - h0) / max(1.0, q1 - q0),
                         "ideal_hit_rate": ideal_hit_rate(convs), "requests": len(lat),
                         "latency_mean_s": statistics.fmean(lat), "latency_p90_s": lat[int(0.9 * (len(lat) - 1))],
                         "load_max_over_mean": max(routed) / statistics.fmean(routed), "wall_s": wall})
    finally:
        stop(procs)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.replicas} replicas of {MODEL}, {args.conversations} conversations x {args.turns} turns, "
          f"{args.reply} output tokens per turn")
    keys = ["hit_rate", "ideal_hit_rate", "latency_mean_s", "latency_p90_s", "load_max_over_mean", "wall_s"]
    print(f"{'':22}" + "".join(f"{r['policy']:>13}" for r in rows))
    for key in keys:
        print(f"{key:22}" + "".join(f"{r[key]:13.3f}" for r in rows))


if __name__ == "__main__":
    main()
