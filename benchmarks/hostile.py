"""Hostile input against `k3serve serve` (issue 50): does one heavy request stall everyone else?

    python benchmarks/hostile.py [--normal 20] [--kinds messages,tokenize,logit_bias,regex] [--model k3-default]
    python benchmarks/hostile.py --kinds image --model k3-tiny-fullvocab-random     # a model with a vision tower
    PYTHONPATH=<older checkout> python benchmarks/hostile.py --baseline ...   # a build without the limit flags

Starts `k3serve serve` (the default model) with limits raised far enough that each hostile request is
processed rather than refused, then for each kind runs twice in the same server: 20 normal chat requests
in parallel while `/health` is polled, once alone and once with one hostile request in flight. Prints
/health p50/p99 latency, the wall time of the 20 normal requests, and the hostile request's status
and time. Kinds: a chat of 200,000 short messages; a 10 MB `/tokenize` prompt; one 24,000,000-pixel PNG (--image-pixels);
a 300-entry `logit_bias` (the most allowed); ten fresh pathological regex patterns (json_schema pattern).
Timings on a shared CPU box are noisy; compare the two runs of one kind, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import subprocess
import sys
import time

import httpx

from k3serve.router.launch import free_port, wait_healthy

JSON = {"content-type": "application/json"}
NORMAL = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
          "thinking": {"type": "disabled"}}


def start_server(model: str, baseline: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flags = [model, "--api-contract", "openai"]
    if not baseline:  # a build from before issue 50 has no such flags (and no such limits)
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


def hostile(kind: str, image_pixels: int) -> list[tuple[str, dict]]:
    """The (path, body) pairs of one hostile kind (sent one after another)."""
    if kind == "messages":
        return [("/v1/chat/completions", {**NORMAL, "messages": [{"role": "user", "content": "hi"}] * 200_000})]
    if kind == "tokenize":
        return [("/tokenize", {"prompt": "lorem ipsum dolor sit amet " * 370_000})]
    if kind == "image":
        parts = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": _png(image_pixels)}}]
        return [("/v1/chat/completions", {**NORMAL, "messages": [{"role": "user", "content": parts}]})]
    if kind == "logit_bias":
        return [("/v1/chat/completions", {**NORMAL, "max_tokens": 64,
                                          "logit_bias": {str(t): -1.0 for t in range(1000, 1300)}})]
    if kind == "regex":
        out = []
        for k in range(10):
            words = "|".join(f"w{k}x{i}" for i in range(300))  # short enough for the prompt to fit
            schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": f"^({words})$"}},
                      "required": ["a"]}
            out.append(("/v1/chat/completions", {**NORMAL, "response_format": {
                "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}))
        return out
    raise SystemExit(f"--kinds: unknown kind {kind!r}")


async def run_once(url: str, n: int, bad: list[tuple[str, bytes]] | None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        stop, lat = asyncio.Event(), []

        async def poll():
            while not stop.is_set():
                t = time.perf_counter()
                await c.get("/health")
                lat.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        async def send_bad():
            t, codes = time.perf_counter(), []
            for path, body in bad or []:  # serialized beforehand: json.dumps here would stall this loop
                codes.append((await c.post(path, content=body, headers=JSON)).status_code)
            return codes, time.perf_counter() - t

        poller = asyncio.create_task(poll())
        bad_task = asyncio.create_task(send_bad())
        await asyncio.sleep(0.05 if bad else 0)  # the hostile request first, as in the finding
        t = time.perf_counter()
        codes = [r.status_code for r in await asyncio.gather(*(c.post("/v1/chat/completions", json=NORMAL)
                                                                for _ in range(n)))]
        normal_s = time.perf_counter() - t
        bad_codes, bad_s = await bad_task
        stop.set()
        await poller
    lat.sort()
    return {"health_p50_ms": 1e3 * statistics.median(lat), "health_p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))],
            "health_max_ms": 1e3 * lat[-1], "normal_s": normal_s, "normal_ok": codes.count(200),
            "hostile": bad_codes, "hostile_s": bad_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--normal", type=int, default=20, help="normal chat requests sent in parallel")
    p.add_argument("--kinds", default="messages,tokenize,logit_bias,regex", help="hostile kinds to run")
    p.add_argument("--model", default="k3-default",
                   help="model to serve; the image kind needs one with a vision tower (e.g. k3-tiny-fullvocab-random)")
    p.add_argument("--image-pixels", type=int, default=24_000_000, help="pixels of the image kind's PNG")
    p.add_argument("--baseline", action="store_true",
                   help="start the server without the issue-50 limit flags (for a build from before them)")
    args = p.parse_args()
    proc, url = start_server(args.model, args.baseline)
    try:
        asyncio.run(run_once(url, 4, None))  # warm-up
        print(f"{'kind':<11} {'run':<8} {'/health p50':>11} {'p99':>8} {'max':>8} {'20 normal':>10} hostile")
        for kind in args.kinds.split(","):
            bad = [(path, json.dumps(body).encode()) for path, body in hostile(kind, args.image_pixels)]
            for label, b in (("alone", None), ("hostile", bad)):
                r = asyncio.run(run_once(url, args.normal, b))
                extra = f"{r['hostile']} in {r['hostile_s']:.2f} s" if b else ""
                print(f"{kind:<11} {label:<8} {r['health_p50_ms']:9.1f}ms {r['health_p99_ms']:6.1f}ms "
                      f"{r['health_max_ms']:6.0f}ms {r['normal_s']:8.2f} s ({r['normal_ok']} ok) {extra}",
                      flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
