"""A fake OpenAI-compatible streaming server with known timing, on 127.0.0.1 and a free port.

Each streamed request gets its first output chunk ``ttft_s`` after the request arrived and the next ones
``itl_s`` apart, ``tokens_per_chunk`` tokens each (2 mimics speculative decoding), then an empty
finish-reason chunk, the usage chunk (when asked for and ``usage`` is on) and ``[DONE]``; the first
``blank_chunks`` chunks hold tokens without text; with ``stream_error`` an error event follows the first
chunk instead. Chat streams start with a role-only chunk at once, as OpenAI's do. Every ``fail_every``-th
request gets an HTTP 500.

``recompute`` re-derives vLLM's aggregates from a result file's raw timestamps, independently of
k3serve.bench.metrics, for the fake-server and live-server tests.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest


@dataclass
class FakeConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    usage: bool = True
    fail_every: int = 0  # 0: never
    stream_error: bool = False  # an error event after the first chunk, as servers report mid-stream failures
    blank_chunks: int = 0  # the first chunks hold tokens without text (special tokens, split UTF-8), as vLLM sends
    models: tuple[str, ...] = ("fake-model",)


@dataclass
class FakeState:
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


class FakeServer:
    def __init__(self) -> None:
        self.config = FakeConfig()
        self.state = FakeState()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        fut = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop)
        self.server = fut.result(timeout=10)
        self.port = self.server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def reset(self, **config) -> FakeServer:
        self.config = FakeConfig(**config)
        self.state = FakeState()
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in
                       (line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "GET" and path == "/v1/models":
                data = {"object": "list", "data": [{"id": m, "object": "model"} for m in self.config.models]}
                await self._send_json(writer, 200, data)
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await self._stream(writer, path.endswith("chat/completions"), json.loads(body))
            else:
                await self._send_json(writer, 404, {"error": {"message": f"no route {path}"}})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
                     "connection: close\r\n\r\n".encode() + payload)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, chat: bool, body: dict) -> None:
        arrived = time.perf_counter()
        cfg, st = self.config, self.state
        st.bodies.append(body)
        if cfg.fail_every and len(st.bodies) % cfg.fail_every == 0:
            await self._send_json(writer, 500, {"error": {"message": "injected failure"}})
            return
        st.in_flight += 1
        st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")

            async def event(obj: dict | str) -> None:
                writer.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())
                await writer.drain()

            def choice(text: str, finish: str | None = None) -> dict:
                if chat:
                    return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
                return {"index": 0, "text": text, "finish_reason": finish}

            if chat:
                await event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                await writer.drain()
            n = body["max_tokens"]
            chunks = -(-n // cfg.tokens_per_chunk)
            for k in range(chunks):
                due = arrived + cfg.ttft_s + k * cfg.itl_s
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                text = "" if k < cfg.blank_chunks else " tok" * min(cfg.tokens_per_chunk, n - k * cfg.tokens_per_chunk)
                await event({"choices": [choice(text)]})
                if cfg.stream_error:
                    await event({"error": {"message": "engine died", "type": "internal_error"}})
                    await event("[DONE]")
                    return
            await event({"choices": [choice("", "length")]})
            if cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
                # ids count as themselves, text as one token per word, chat adds 3 template tokens per message
                prompt = body.get("prompt")
                if isinstance(prompt, list):
                    n_in = len(prompt)
                elif prompt is not None:
                    n_in = len(prompt.split())
                else:
                    n_in = sum(len(m["content"].split()) + 3 for m in body["messages"])
                await event({"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n,
                                                      "total_tokens": n_in + n}})
            await event("[DONE]")
        finally:
            st.in_flight -= 1


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def recompute():
    return _recompute


def _recompute(result: dict, slo_ms: dict[str, float]) -> dict[str, float]:
    """The vLLM definitions, written independently of k3serve.bench.metrics, from the raw per-request fields."""
    ok = [r for r in result["requests"] if r["success"]]
    ttft = [r["chunk_s"][0] - r["send_s"] for r in ok]
    e2el = [r["end_s"] - r["send_s"] for r in ok]
    tpot_all = [(e - t) / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else 0.0
                for r, t, e in zip(ok, ttft, e2el)]
    tpot = [x for r, x in zip(ok, tpot_all) if r["output_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunk_s"], r["chunk_s"][1:])]
    dur = result["duration"]
    n_out = sum(r["output_tokens"] for r in ok)
    n_in = sum(r["input_tokens"] for r in ok)
    good = sum(all(v * 1000 <= slo_ms[k] for k, v in (("ttft", a), ("tpot", b), ("e2el", c)) if k in slo_ms)
               for a, b, c in zip(ttft, tpot_all, e2el))
    out = {"completed": len(ok), "request_throughput": len(ok) / dur, "output_throughput": n_out / dur,
           "total_token_throughput": (n_in + n_out) / dur, "request_goodput": good / dur if slo_ms else None}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = [1000 * x for x in xs] or [0.0]
        out[f"mean_{name}_ms"] = sum(ms) / len(ms)
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
        out[f"p50_{name}_ms"] = float(np.percentile(ms, 50))
    return out
