"""Output tokens/s through the HTTP app for one engine in 1, 2 and 4 CPU processes: tp=1, tp=2, tp=4, dp=2.

Until the tensor-parallel layers land every tp rank runs the whole model (replicated), so tp=N measures the
cost of the rank plumbing (one broadcast of the step's ids per step, N processes on the same cores), not a
speed-up; dp=2 runs two independent engines. Workload (fixed seed): ``--requests`` completions sent at once,
random prompts of 16..64 tokens, ``--max-tokens`` greedy outputs each (ignore_eos). Output tokens/s = all
output tokens / wall time from the first request sent to the last response. The greedy outputs of each layout
are compared with tp=1's (``same`` column).

    python benchmarks/parallel_tokens.py --model k3-tiny-random --requests 16 --max-tokens 32

A layout ending in ``e`` adds ``--enable-expert-parallel``: ``2x1e`` is tp2 + ep2, ``1x2e`` is dp2 + ep2 (the
experts over both replicas, their cores in lockstep: engine/dp_sync.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx


async def measure(model: str, tp: int, dp: int, prompts: list[list[int]], max_tokens: int, ep: bool = False):
    from k3serve.server.app import build_app, start_state
    from k3serve.server.state import ServerConfig

    engine = {"tensor_parallel_size": tp, "log_stats_interval": 0.0, "max_model_len": 256, "expert_parallel": ep}
    if ep and dp > 1:  # one world of tp x dp ranks (parallel_cli.check_parallel)
        engine["data_parallel_size"] = dp
    app = build_app(ServerConfig(model=model, engine=engine, data_parallel_size=dp, access_log=False))
    state = app.state.k3
    try:
        await start_state(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://k3",
                                     timeout=3600) as http:
            async def one(p):
                r = await http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                              "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(p) for p in prompts))
            wall = time.perf_counter() - t0
        return [g[0] for g in got], sum(g[1] for g in got) / wall
    finally:
        if state.client is not None:
            await state.client.shutdown()
        state.pool.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3-tiny-random")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--layouts", default="1x1,2x1,4x1,1x2", help="comma-separated TPxDP, e.g. 1x2e (e: experts "
                                                                 "parallel over all tp x dp ranks)")
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2000) for _ in range(rng.randint(16, 64))] for _ in range(a.requests)]
    ref = None
    print("| layout | processes | output tok/s | same as tp=1 |\n|---|---|---|---|")
    for lay in a.layouts.split(","):
        ep = lay.endswith("e")
        tp, dp = map(int, lay.rstrip("e").split("x"))
        texts, tps = asyncio.run(measure(a.model, tp, dp, prompts, a.max_tokens, ep))
        ref = texts if ref is None else ref
        name = f"tp={tp} dp={dp}" + (f" ep={tp * dp}" if ep else "")
        print(f"| {name} | {tp * dp} | {tps:.1f} | {texts == ref} |", flush=True)


if __name__ == "__main__":
    main()
