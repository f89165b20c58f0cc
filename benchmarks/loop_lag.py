"""How long each hostile request (issue 50) holds the frontend's event loop, without an engine process.

    python benchmarks/loop_lag.py [--kinds messages,tokenize,...] [--raise-limits]

Builds the app in-process with a stand-in engine client (ready, admits everything, generates nothing) and
sends each kind of `benchmarks/hostile.py` to `/tokenize` (chat kinds become a tokenize of the same
messages and response_format: the same parsing, limits, rendering, grammar check and encoding, minus
generation), while a task that sleeps 1 ms records how late it wakes. Prints the hostile request's statuses
and time and the loop lag p99 / max. Unlike hostile.py this needs no model and is little moved by the other
processes on the box: a lag near the request's own time means the work ran on the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from types import SimpleNamespace

import httpx

from benchmarks.hostile import KINDS, hostile
from k3serve.chat import K3
from k3serve.server.app import build_app
from k3serve.server.limits import RequestLimits
from k3serve.server.media import MediaLimits
from k3serve.server.state import ServerConfig

RAISED = dict(limits=RequestLimits(max_messages=300_000, max_prompt_chars=16 << 20, max_body_bytes=64 << 20),
              media=MediaLimits(max_pixels=25_000_000))


def app_with_stand_in(raised: bool):
    from k3serve.tokenizer import Tokenizer

    app = build_app(ServerConfig(model="m", access_log=False, **(RAISED if raised else {})))
    state = app.state.k3
    ready = SimpleNamespace(supports_images=True, max_model_len=1 << 20, vocab_size=163840)
    state.client = SimpleNamespace(ready=ready, alive=True, dead_reason=None, state="ready", restarts=0,
                                   check_admission=lambda n=1: None)
    state.fmt, state.contract, state.tokenizer = K3, "openai", Tokenizer.kimi("k3")
    return app


async def measure(app, requests: list[tuple[str, bytes]]) -> dict:
    lags, done = [], False

    async def monitor():
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    task = asyncio.create_task(monitor())
    await asyncio.sleep(0.01)
    t = time.perf_counter()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://in-process",
                                 timeout=600) as c:
        codes = [(await c.post("/tokenize", content=body, headers={"content-type": "application/json"})).status_code
                 for _, body in requests]
    seconds = time.perf_counter() - t
    done = True
    await task
    lags.sort()
    return {"codes": codes, "s": seconds, "p99": 1e3 * lags[int(0.99 * (len(lags) - 1))], "max": 1e3 * lags[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="messages,tokenize,image,bigint,deep,logit_bias,regex",
                   help="hostile kinds (those of benchmarks/hostile.py but overload), comma-separated")
    p.add_argument("--raise-limits", action="store_true", help="the raised limits of hostile.py --raise-limits")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in (*KINDS, "image") or kind == "overload":
            p.error(f"--kinds: unknown kind {kind!r} (overload needs a real engine: hostile.py)")
    app = app_with_stand_in(args.raise_limits)
    print(f"# load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs); "
          f"{'raised' if args.raise_limits else 'default'} limits")
    print(f"{'kind':<11} {'statuses':<16} {'time':>8} {'loop lag p99':>13} {'max':>8}")
    for kind in kinds:
        r = asyncio.run(measure(app, hostile(kind, 60_000_000, 0)))
        codes = ", ".join(f"{n} x {code}" for code, n in Counter(r["codes"]).items())
        print(f"{kind:<11} {codes:<16} {r['s']:7.2f}s {r['p99']:11.1f}ms {r['max']:6.0f}ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
