"""Server overhead: output-token throughput through `k3serve serve` vs the offline engine on the same
workload, and the throughput cost of json_schema structured outputs.

    python benchmarks/server_overhead.py [--requests 32] [--max-tokens 32] [--prompt-len 64]

Workload A (overhead): N requests of the same token-id prompt, greedy, `ignore_eos`, fixed output
length; offline `LLM.generate` vs concurrent `/v1/completions` calls (token-id prompts, so both sides
feed the engine identical ids). Target: server / offline >= 0.9.
Workload B (structured outputs): N chat requests with a json_schema response_format vs the same
chat requests unconstrained, request i generating as many tokens as constrained request i did and
reading the schema as a plain system message (so both prompts are about as long); compared as output
tokens per second. Target: cost <= 10%.
The model is the packaged `k3-tiny-fullvocab` config with random weights (full Kimi vocabulary, so
grammars and chat prompts are real).

    python benchmarks/server_overhead.py --per-token [--requests 32 --max-tokens 256]

Per-token mode: the server's own CPU per generated token, without a model: a fake engine sends one
token per request per step (msgpack round trip) into the real completion / chat handlers (tokenizer,
parser, SSE); CPU time, best of 5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "where": {"type": "object", "properties": {"lat": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["lat", "ok"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3}},
    "required": ["city", "days", "where", "tags"], "additionalProperties": False}


def offline_runner(ckpt: str, max_num_seqs: int):
    from k3serve.engine.llm import LLM
    from k3serve.engine.sampling_params import SamplingParams

    llm = LLM(ckpt, tokenizer=None, max_num_seqs=max_num_seqs)

    def run(n: int, prompt: list[int], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        t0 = time.perf_counter()
        outs = llm.generate([prompt] * n, params)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    return run


def start_server(ckpt: str, max_num_seqs: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "k3serve", "serve", ckpt, "--port", str(port),
                             "--served-model-name", "tiny", "--api-contract", "openai",
                             "--max-num-seqs", str(max_num_seqs)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


async def fire(url: str, path: str, bodies: list[dict]) -> tuple[int, float]:
    tok, dt, _ = await fire_each(url, path, bodies)
    return tok, dt


async def fire_each(url: str, path: str, bodies: list[dict]) -> tuple[int, float, list[dict]]:
    """All bodies at once: (completion tokens in all, seconds, each response's usage)."""
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(bodies) + 4)) as c:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(c.post(url + path, json=b) for b in bodies))
        dt = time.perf_counter() - t0
    for r in rs:
        r.raise_for_status()
    usage = [r.json()["usage"] for r in rs]
    return sum(u["completion_tokens"] for u in usage), dt, usage


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json-max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-token", action="store_true", help="server CPU per token with a fake engine")
    args = ap.parse_args()
    if args.per_token:
        return per_token(args.requests, args.max_tokens)
    from k3serve.testing import write_random_checkpoint

    tmp = None if os.environ.get("K3SERVE_BENCH_CKPT") else tempfile.TemporaryDirectory(prefix="k3-bench-")
    ckpt = os.environ.get("K3SERVE_BENCH_CKPT") or str(write_random_checkpoint("k3-tiny-fullvocab", tmp.name, seed=0))
    try:
        return _run(args, ckpt)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args: argparse.Namespace, ckpt: str) -> int:
    prompt = [(7 * i + 11) % 150000 for i in range(args.prompt_len)]
    n, m = args.requests, args.max_tokens

    run_offline = offline_runner(ckpt, args.max_num_seqs)
    run_offline(1, prompt, m)  # warm-up
    proc, url = start_server(ckpt, args.max_num_seqs)
    offs, srvs, jts, pts, prompt_lens = [], [], [], [], []
    try:
        base = {"model": "tiny", "max_tokens": m, "temperature": 0, "ignore_eos": True}
        asyncio.run(fire(url, "/v1/completions", [{**base, "prompt": prompt}]))  # warm-up
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris as JSON?"}],
                "thinking": {"type": "disabled"}, "temperature": 1.0, "max_tokens": args.json_max_tokens}
        rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
        note = ("The system is invoked with `response_format=json_schema`. Your response must be raw JSON data "
                "without markdown code blocks (```json) or any additional formatting. The JSON data must match "
                "the following schema:\n```json\n" + json.dumps(SCHEMA, separators=(",", ":")) + "\n```")
        plain = {**chat, "messages": [{"role": "system", "content": note}, *chat["messages"]]}
        asyncio.run(fire(url, "/v1/chat/completions", [{**chat, "response_format": rf}]))  # warm-up (grammar)
        # rounds alternate the two sides so a shared, busy machine slows both alike; medians are reported
        for r in range(args.rounds):
            offs.append(run_offline(n, prompt, m))
            tok, dt = asyncio.run(fire(url, "/v1/completions", [{**base, "prompt": prompt}] * n))
            srvs.append(tok / dt)
            jt, jdt, ju = asyncio.run(fire_each(url, "/v1/chat/completions",
                                                [{**chat, "response_format": rf, "seed": r * n + i} for i in range(n)]))
            # request i unconstrained generates exactly as many tokens as request i constrained did, so both
            # runs have the same batch occupancy over time (a mean length would keep the unconstrained
            # batch full to the end while the constrained one thins out as short answers finish)
            # ... and reads a prompt of about the same length: the K3 format renders the schema into a system
            # message (188 prompt ids instead of 27 here), so the unconstrained side gets the same schema as a
            # plain system message; what is left is the cost of the constraint itself (the prompt lengths
            # are printed)
            pt, pdt, pu = asyncio.run(fire_each(url, "/v1/chat/completions",
                                                [{**plain, "max_tokens": max(1, u["completion_tokens"]),
                                                  "ignore_eos": True, "seed": r * n + i}
                                                 for i, u in enumerate(ju)]))
            prompt_lens.append((statistics.mean(u["prompt_tokens"] for u in ju),
                                statistics.mean(u["prompt_tokens"] for u in pu)))
            jts.append(jt / jdt)
            pts.append(pt / pdt)
    finally:
        proc.terminate()
        proc.wait(30)
    off, srv = statistics.median(offs), statistics.median(srvs)
    ratio = statistics.median(s / o for s, o in zip(srvs, offs))
    json_tps, plain_tps = statistics.median(jts), statistics.median(pts)
    cost = statistics.median(1 - j / p for j, p in zip(jts, pts))
    print(f"workload A: {n} requests x {m} tokens, prompt {args.prompt_len} ids, max_num_seqs {args.max_num_seqs}, "
          f"{args.rounds} rounds (medians)")
    print(f"  offline engine : {off:8.1f} tok/s   rounds {[round(x) for x in offs]}")
    print(f"  through server : {srv:8.1f} tok/s   rounds {[round(x) for x in srvs]}")
    print(f"  ratio          : {ratio:.3f} (target >= 0.9)")
    print(f"workload B: {n} chat requests, json_schema vs unconstrained with the same tokens per request")
    print(f"  mean prompt    : {prompt_lens[0][0]:.0f} ids constrained, {prompt_lens[0][1]:.0f} unconstrained "
          f"(the schema as a plain system message)")
    print(f"  unconstrained  : {plain_tps:8.1f} tok/s   rounds {[round(x, 1) for x in pts]}")
    print(f"  json_schema    : {json_tps:8.1f} tok/s   rounds {[round(x, 1) for x in jts]}")
    print(f"  cost           : {100 * cost:.1f}% (target <= 10%)")
    return 0


class _FakeEngine:
    """Stands in for `EngineClient`: `step()` sends every open request its next token."""

    def __init__(self, tokens: int, requests: int):
        from k3serve.engine.messages import Ready, Stats

        self.ready = Ready(model_type="kimi_k3", vocab_size=163840, max_model_len=4096, eos_token_ids=[163586],
                           media_placeholder_token_id=None, stats=Stats())
        self.tokens, self.requests, self.streams, self.started = tokens, requests, {}, 0

    async def run(self) -> None:
        from k3serve.engine.messages import Output, Outputs, Stats, encode, from_engine_decoder

        while self.started < self.requests:  # every request is in before the first step
            await asyncio.sleep(0)
        step = 0
        while self.streams:
            fin = step == self.tokens - 1
            items = [Output(rid, [(7919 * (k + 1) * (step + 1)) % 150000 + 1000], finished=fin,
                            finish_reason="length" if fin else None, num_prompt_tokens=64)
                     for rid, (_, k) in self.streams.items()]
            for out in from_engine_decoder.decode(encode(Outputs(items, Stats()))).items:
                self.streams[out.request_id][0].put_nowait(out)
                if out.finished:
                    del self.streams[out.request_id]
            step += 1
            await asyncio.sleep(0)

    async def generate(self, rid, prompt_ids, sampling, **_):
        q: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = (q, self.started)
        self.started += 1
        while True:
            out = await q.get()
            yield out
            if out.finished:
                return


def per_token(n: int, tokens: int) -> int:
    from k3serve.chat import chat_format_for
    from k3serve.server.chat_request import prepare_chat
    from k3serve.server.chat_serving import chat_response, chat_stream
    from k3serve.server.completion_serving import CompletionJob, completion_response
    from k3serve.engine.sampling_params import SamplingParams
    from k3serve.server.metrics import Metrics
    from k3serve.server.protocol import ChatCompletionRequest
    from k3serve.server.state import ServerConfig, ServerState
    from k3serve.tokenizer import Tokenizer

    st = ServerState(ServerConfig(model="fake"), tokenizer=Tokenizer.kimi("k3"), fmt=chat_format_for("kimi_k3"),
                     metrics=Metrics("fake", lambda: None, lambda: 0))

    async def drain(agen) -> None:
        async for _ in agen:
            pass

    async def one_round(mode: str) -> None:
        st.client = engine = _FakeEngine(tokens, n)
        if mode == "completions":
            job = CompletionJob([[1] * 64], [""], [SamplingParams(max_tokens=tokens)], None, False, False, True, {})
            work = [completion_response(st, job, "m") for _ in range(n)]
        else:
            req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=tokens,
                                        stream=mode == "chat SSE", thinking={"type": "disabled"})
            jobs = [await prepare_chat(st, req) for _ in range(n)]
            work = [drain(chat_stream(st, j, "m")) if req.stream else chat_response(st, j, "m") for j in jobs]
        await asyncio.gather(engine.run(), *work)

    print(f"server CPU per token, fake engine, {n} requests x {tokens} tokens (best of 5)")
    for mode in ("completions", "chat", "chat SSE"):
        times = []
        for _ in range(6):
            t0 = time.process_time()
            asyncio.run(one_round(mode))
            times.append(time.process_time() - t0)
        print(f"  {mode:12s}: {1e6 * min(times[1:]) / (n * tokens):6.1f} us/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
