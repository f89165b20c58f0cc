"""Interference: long prompts arriving while short requests decode, with prefill/decode disaggregation off
(one `both` server) and on (`route --prefill --decode` over one prefill and one decode worker), same run.

    python benchmarks/pd_interference.py [--model k3-default] [--rounds 2] [--long-len 1536] [--short 4]

After `--warmup` unrecorded rounds, each round runs the same workload shape once per mode, with fresh random token ids (no prefix hits):
`--short` streaming requests (32-token prompts, `--short-tokens` outputs) start together; 0.5 s later
`--long` requests of `--long-len` tokens (1 output token) arrive `--long-gap` s apart. Reported per mode:
p50 / p99 inter-token latency of the short streams (gaps between their chunks after the first), their TTFT,
and the long requests' TTFT (first streamed chunk). Both modes' engines are up for the whole run; only one
mode's workload runs at a time. On a CPU box the prefill and decode workers share the same cores, so
disaggregation removes the scheduling interference (no prefill chunk in a decode step) but not the compute
contention; the number to read is the short requests' p99 ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from k3serve.router.launch import free_port


def start(args: list[str], log: str) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "k3serve", *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def wait_up(urls: list[str], procs: list[subprocess.Popen], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a server exited while starting; see the log")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not start")
            time.sleep(0.5)


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                 delay: float) -> list[float]:
    """Arrival-relative times of each streamed chunk that carried text or a token."""
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times, finished = [], False
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {await r.aread()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                frame = json.loads(line[6:])
                if "error" in frame:
                    raise SystemExit(f"{url}: {frame}")
                if frame["choices"] and frame["choices"][0].get("finish_reason") is None:
                    times.append(time.perf_counter() - t0)
                elif frame["choices"]:
                    finished = True
    if not finished or not times:  # a stream cut short would skew the figures: fail the run, say which
        raise SystemExit(f"{url}: a stream ended without its finish_reason ({len(times)} tokens)")
    return times


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def workload(url: str, args, rng: random.Random) -> dict:
    ids = lambda n: [rng.randrange(min(1000, args.vocab // 2), args.vocab) for _ in range(n)]  # noqa: E731
    async with httpx.AsyncClient(timeout=1800, trust_env=False) as client:
        shorts = [stream(client, url, args.model, ids(32), args.short_tokens, 0.0) for _ in range(args.short)]
        longs = [stream(client, url, args.model, ids(args.long_len), 1, 0.5 + i * args.long_gap)
                 for i in range(args.long)]
        res = await asyncio.gather(*shorts, *longs)
    short, long = res[:args.short], res[args.short:]
    itl = [b - a for ts in short for a, b in zip(ts, ts[1:])]
    return {"itl": itl, "short_ttft": [ts[0] for ts in short], "long_ttft": [ts[0] for ts in long]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="k3-default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded rounds first")
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--short-tokens", type=int, default=48)
    ap.add_argument("--long", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--long-gap", type=float, default=1.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--handoff-timeout", type=float, default=120.0,
                    help="the workers' --handoff-timeout: on a loaded CPU box a prefill step can outlast the default 30 s")
    ap.add_argument("--vocab", type=int, default=100_000, help="prompt token ids are drawn below this "
                    "(2048 for the k3-tiny-random models)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # `timeout` or a kill: still stop the servers
    log = tempfile.mktemp(prefix="pd_interference-", suffix=".log")
    engine = ["--max-model-len", "4096", "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--gpu-memory-utilization", "0.03", "--disable-log-stats"]
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for port, role in zip(ports, ("both", "prefill", "decode")):
            procs.append(start(["serve", args.model, "--port", str(port), "--role", role, *engine,
                                *(["--handoff-timeout", str(args.handoff_timeout)] if role != "both" else [])], log))
        wait_up(urls[:3], procs)
        procs.append(start(["route", "--port", str(ports[3]), "--prefill", urls[1], "--decode", urls[2]], log))
        wait_up(urls[3:], procs)  # the router answers /health once it listens; nothing is sent before
        modes = {"colocated (1 both)": urls[0], "disaggregated (1P+1D)": urls[3]}
        out = {m: {"itl": [], "short_ttft": [], "long_ttft": []} for m in modes}
        rng = random.Random(0)
        for rnd in range(args.warmup + args.rounds):  # warm-up rounds: first-use costs of every engine, unrecorded
            for mode, url in modes.items():
                r = asyncio.run(workload(url, args, rng))
                for k, v in r.items():
                    out[mode][k] += v if rnd >= args.warmup else []
        print(f"model {args.model}, {args.rounds} rounds after {args.warmup} warm-up: {args.short} short (32 -> {args.short_tokens} tokens) + "
              f"{args.long} long ({args.long_len} tokens, {args.long_gap:g} s apart), "
              f"max_num_batched_tokens {args.max_num_batched_tokens}; log {log}")
        print(f"{'mode':<24}{'ITL p50':>10}{'ITL p99':>10}{'short TTFT':>12}{'long TTFT mean':>16}{'long max':>10}")
        for mode, r in out.items():
            print(f"{mode:<24}{pct(r['itl'], .5) * 1e3:>8.0f}ms{pct(r['itl'], .99) * 1e3:>8.0f}ms"
                  f"{statistics.mean(r['short_ttft']):>11.2f}s{statistics.mean(r['long_ttft']):>15.2f}s"
                  f"{max(r['long_ttft']):>9.2f}s")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
