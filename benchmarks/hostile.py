"""Hostile input against `k3serve serve` (issue 50): does one heavy request stall everyone else?

    python benchmarks/hostile.py                                   # every text kind, default limits, k3-default
    python benchmarks/hostile.py --kinds image --model k3-tiny-fullvocab-random   # needs a vision tower
    python benchmarks/hostile.py --raise-limits --kinds messages,tokenize  # processed, not refused (older rows)
    PYTHONPATH=<older checkout> python benchmarks/hostile.py --baseline ...   # a build without the limit flags

Starts one `k3serve serve` (default limits unless --raise-limits) and for each kind runs twice in that
server: 20 normal chat requests in parallel while `/health` is polled every 20 ms, once alone and once
with the kind's hostile request(s) in flight; a normal request answered 429 retries after its
Retry-After. The hostile requests are built and sent by a separate process, so that neither their
JSON encoding nor their answers stall the loop that measures /health.
Prints /health p50/p99/max and the number of polls, the normal requests completed and their wall time,
the hostile requests' outcomes and time, and the polls sent while they were out (count, slowest).
Kinds (the issue's findings):
  messages    a chat of 200,000 short messages
  tokenize    a 10 MB /tokenize prompt
  image       one 60,000,000-pixel PNG (--image-pixels; needs --model with a vision tower)
  bigint      integers beyond 64 bits: stop_token_ids, top_k, a logit_bias key (3 requests)
  deep        a JSON schema nested 900 deep, in response_format and in tool parameters (2 requests)
  logit_bias  160,000 logit_bias entries
  regex       ten fresh pathological regex patterns (json_schema `pattern`)
  overload    a burst of --burst concurrent streams (beyond the queue: 429, or an error frame then [DONE]);
              run it alone against an admission limit below the burst:
              python benchmarks/hostile.py --kinds overload --max-queued-requests 64
Timings on a shared CPU box are noisy; compare the two runs of one kind, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import httpx

from k3serve.router.launch import free_port, wait_healthy

JSON = {"content-type": "application/json"}
NORMAL = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
          "thinking": {"type": "disabled"}}
KINDS = ("messages", "tokenize", "bigint", "deep", "logit_bias", "regex", "overload")


def start_server(model: str, baseline: bool, raise_limits: bool, queue: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flags = [model, "--api-contract", "openai", "--disable-access-log"]
    if queue is not None:
        flags += ["--max-queued-requests", str(queue)]
    if baseline:  # a build from before issue 50 has no such flags (and no such limits)
        flags.remove("--disable-access-log")
    elif raise_limits:
        flags += ["--max-messages", "300000", "--max-prompt-chars", str(16 << 20), "--max-request-body-bytes",
                  str(64 << 20), "--max-image-pixels", "25000000"]
    proc = subprocess.Popen([sys.executable, "-m", "k3serve", "serve", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([proc], [url], timeout_s=300)
    except RuntimeError as e:
        proc.kill()
        raise SystemExit(f"the server did not start: {e}") from None
    return proc, url


def _png(pixels: int) -> str:
    from PIL import Image

    w = int(pixels ** 0.5)
    buf = io.BytesIO()
    Image.new("RGB", (w, pixels // w), (30, 60, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _deep_schema(depth: int) -> str:
    return '{"type":"object","properties":{"x":' * depth + '{"type":"integer"}' + "}}" * depth


def _json_schema(schema: dict) -> dict:
    return {**NORMAL, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}


REGEXES = [  # alternations, nested and counted repetitions: the shapes that blow up automaton construction
    *(f"^({'|'.join(f'w{k}x{i}' for i in range(300))})$" for k in range(4)),
    "^((a|b)*c){1,40}(a|b)*$", "^(([a-z]{1,9}\\d{0,3}){1,30})+$", "^(x+x+)+y$", "^([ab]{0,50}[cd]{0,50}){1,20}$",
    "^(.*a){25}$", "^(((\\w+\\s?)+,?)+){1,10}$",
]


def hostile(kind: str, image_pixels: int, burst: int) -> list[tuple[str, bytes]]:
    """The (path, serialized body) pairs of one hostile kind."""
    if kind == "messages":
        out = [("/v1/chat/completions", {**NORMAL, "messages": [{"role": "user", "content": "hi"}] * 200_000})]
    elif kind == "tokenize":
        out = [("/tokenize", {"prompt": "lorem ipsum dolor sit amet " * 370_000})]
    elif kind == "image":
        parts = [{"type": "text", "text": "what is it?"},
                 {"type": "image_url", "image_url": {"url": _png(image_pixels)}}]
        out = [("/v1/chat/completions", {**NORMAL, "messages": [{"role": "user", "content": parts}]})]
    elif kind == "bigint":
        out = [("/v1/chat/completions", {**NORMAL, field: value}) for field, value in
               (("stop_token_ids", [2**64 + 7]), ("top_k", 2**70), ("logit_bias", {str(2**80): 1.0}))]
    elif kind == "deep":
        schema = _deep_schema(900)  # as text: json.dumps of a 900-deep dict recurses past Python's limit
        fmt = json.dumps(_json_schema({})).replace('"schema": {}', f'"schema": {schema}')
        tool = {**NORMAL, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
        tools = json.dumps(tool).replace('"parameters": {}', f'"parameters": {schema}')
        return [("/v1/chat/completions", fmt.encode()), ("/v1/chat/completions", tools.encode())]
    elif kind == "logit_bias":
        out = [("/v1/chat/completions", {**NORMAL, "logit_bias": {str(t): -1.0 for t in range(160_000)}})]
    elif kind == "regex":
        nonce = os.getpid()  # fresh patterns on every run: nothing compiled before can be reused
        patterns = [p.replace("^", f"^(n{nonce}{k})?", 1) for k, p in enumerate(REGEXES)]
        out = [("/v1/chat/completions", _json_schema({"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string", "pattern": p}}})) for p in patterns]
    elif kind == "overload":
        out = [("/v1/chat/completions", {**NORMAL, "stream": True})] * burst
    else:
        raise SystemExit(f"--kinds: unknown kind {kind!r}")
    return [(path, json.dumps(body).encode()) for path, body in out]


# --- the hostile side: a separate process (ProcessPoolExecutor with one worker keeps these between calls)
_PREPARED: list[tuple[str, bytes]] = []
_BURST: list[bool] = [False]  # the overload kind: all at once, streamed


def prepare(kind: str, image_pixels: int, burst: int) -> int:
    _PREPARED[:] = hostile(kind, image_pixels, burst)
    _BURST[0] = kind == "overload"
    return len(_PREPARED)


async def _stream(c: httpx.AsyncClient, path: str, body: bytes) -> str:
    """One streamed request's outcome: its status, and for a 200 whether the stream ended with [DONE]
    (`200+error` when an error frame came first: the overload answer issue 50 asks for)."""
    async with c.stream("POST", path, content=body, headers=JSON) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        last, error = "", False
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line[6:]
                error = error or last.startswith('{"error"')
        return "200+error" if error and last == "[DONE]" else "200" if last == "[DONE]" else "200 cut"


def send(url: str) -> tuple[dict[str, int], float]:
    async def go():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
            if _BURST[0]:
                return await asyncio.gather(*(_stream(c, p, b) for p, b in _PREPARED))
            return [str((await c.post(p, content=b, headers=JSON)).status_code) for p, b in _PREPARED]

    t = time.perf_counter()
    outcomes = asyncio.run(go())
    return dict(Counter(outcomes)), time.perf_counter() - t


# --- the measuring side
async def normal(c: httpx.AsyncClient, max_tries: int = 600) -> tuple[int, int]:
    """One normal chat request, retried after a 429's Retry-After as OpenAI's SDKs do: (status, retries)."""
    for tries in range(max_tries):
        r = await c.post("/v1/chat/completions", json=NORMAL)
        if r.status_code != 429 or "retry-after" not in r.headers:
            return r.status_code, tries
        await asyncio.sleep(float(r.headers["retry-after"]))
    return r.status_code, max_tries


async def run_once(url: str, n: int, pool: ProcessPoolExecutor | None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        stop, lat, during = asyncio.Event(), [], []

        async def poll():
            while not stop.is_set():
                t, in_flight = time.perf_counter(), bad is not None and not bad.done()
                await c.get("/health")
                lat.append(time.perf_counter() - t)
                if in_flight:  # started while the hostile request was still out
                    during.append(lat[-1])
                await asyncio.sleep(0.02)

        bad = asyncio.get_running_loop().run_in_executor(pool, send, url) if pool else None
        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.05 if bad else 0)  # the hostile request first, as in the findings
        t = time.perf_counter()
        codes = await asyncio.gather(*(normal(c) for _ in range(n)))
        normal_s = time.perf_counter() - t
        outcomes, bad_s = await bad if bad else ({}, 0.0)
        stop.set()
        await poller
    lat.sort()
    return {"p50": 1e3 * statistics.median(lat), "p99": 1e3 * lat[int(0.99 * (len(lat) - 1))], "max": 1e3 * lat[-1],
            "polls": len(lat), "normal_s": normal_s, "normal": dict(Counter(code for code, _ in codes)),
            "retries": sum(tries for _, tries in codes), "hostile": outcomes,
            "during": f"{len(during)} polls max {1e3 * max(during):.0f} ms" if during else "no polls",
            "hostile_s": bad_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--normal", type=int, default=20, help="normal chat requests sent in parallel")
    p.add_argument("--kinds", default=",".join(KINDS), help="hostile kinds to run, comma-separated (also: image)")
    p.add_argument("--model", default="k3-default",
                   help="model to serve; the image kind needs one with a vision tower (e.g. k3-tiny-fullvocab-random)")
    p.add_argument("--image-pixels", type=int, default=60_000_000, help="pixels of the image kind's PNG")
    p.add_argument("--burst", type=int, default=200, help="concurrent streams of the overload kind")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="the server's admission limit (default: the server's, 1024); the overload kind wants it "
                        "below --burst, e.g. 64")
    p.add_argument("--raise-limits", action="store_true",
                   help="raise the request limits far enough that the messages/tokenize/image kinds are processed")
    p.add_argument("--baseline", action="store_true",
                   help="start the server without the issue-50 flags (for a build from before them)")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in (*KINDS, "image"):
            p.error(f"--kinds: unknown kind {kind!r}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that `finally` stops the server
    proc, url = start_server(args.model, args.baseline, args.raise_limits, args.max_queued_requests)
    print(f"# load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            asyncio.run(run_once(url, 4, None))  # warm-up
            print(f"{'kind':<11} {'run':<8} {'/health p50':>11} {'p99':>8} {'max':>8} {'polls':>5} "
                  f"{'normal':>16}  hostile", flush=True)
            for kind in kinds:
                pool.submit(prepare, kind, args.image_pixels, args.burst).result()
                for label, hostile_pool in (("alone", None), ("hostile", pool)):
                    r = asyncio.run(run_once(url, args.normal, hostile_pool))
                    extra = f"{r['hostile']} in {r['hostile_s']:.2f} s ({r['during']})" if hostile_pool else ""
                    normal = f"{r['normal'][200]:3d} ok" if set(r["normal"]) == {200} else str(r["normal"])
                    normal += f" ({r['retries']} retries after 429)" if r["retries"] else ""
                    print(f"{kind:<11} {label:<8} {r['p50']:9.1f}ms {r['p99']:6.1f}ms {r['max']:6.0f}ms "
                          f"{r['polls']:5d} {normal} in {r['normal_s']:5.2f} s  {extra}", flush=True)
                print(f"# load average after {kind}: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
