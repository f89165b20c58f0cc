"""One streamed request to an OpenAI-compatible server, timed on the client, and the server preflight.

Timestamps are seconds on the run's clock (``time.perf_counter()`` minus the run start). A request records
when it was sent, when each chunk carrying output arrived and when its stream ended. A completions chunk carries
tokens unless it only ends the choice (a finish reason, no text): servers that stream a chunk per engine step,
as vLLM and k3serve do, send one even for tokens that decode to no text yet, so TTFT is the first token, not
the first visible character. A chat chunk carries output when it has text, reasoning or tool-call deltas (chat
servers hide tokens their parsers swallow); one with only a role, a finish reason or usage carries none.
Token counts come from the final ``usage`` chunk (asked for with ``stream_options.include_usage``) when the
server sends one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from k3serve.bench.datasets import BenchRequest, render_text

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ServerUnavailable(Exception):
    """The server cannot be reached or rejected the preflight; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str  # scheme://host:port, no trailing /v1
    kind: str  # "completions" | "chat"
    model: str
    prompt_format: str = "ids"  # "ids" (completions only) | "text"
    ignore_eos: bool = True
    temperature: float | None = None
    extra_body: tuple[tuple[str, Any], ...] = ()

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.kind]

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.kind == "chat":
            body["messages"] = [{"role": role, "content": render_text(ids)} for role, ids in req.turns]
        else:
            body["prompt"] = req.prompt_ids if self.prompt_format == "ids" else render_text(req.prompt_ids)
        if self.ignore_eos:
            body["ignore_eos"] = True  # exact output lengths, as vLLM's random dataset asks
        if self.temperature is not None:
            body["temperature"] = self.temperature
        body.update(self.extra_body)
        return body


@dataclass(slots=True)
class RequestRecord:
    index: int
    scheduled_s: float  # arrival time from the schedule
    input_tokens: int  # from usage when sent, else the dataset's prompt length
    send_s: float = 0.0  # after any wait for a concurrency slot or a previous turn
    chunk_s: list[float] = field(default_factory=list)  # arrival of every chunk carrying output
    end_s: float = 0.0  # end of the response stream ([DONE] or close)
    output_tokens: int = 0
    output_tokens_from: str = "stream"  # "usage" when the server reported completion_tokens
    output_chars: int = 0
    success: bool = False
    error: str = ""


def _has_output(choice: dict[str, Any]) -> tuple[bool, int]:
    if "delta" in choice:  # chat
        d = choice.get("delta") or {}
        text = (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")
        return bool(text or d.get("tool_calls")), len(text)
    text = choice.get("text") or ""
    return bool(text or choice.get("logprobs") or choice.get("finish_reason") is None), len(text)


def _error_text(payload: str) -> str:
    try:
        body = json.loads(payload)
        err = body.get("error") or body.get("message") or payload
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return payload.strip()[:200]


async def send(client: httpx.AsyncClient, ep: Endpoint, req: BenchRequest, rec: RequestRecord,
               clock: Callable[[], float]) -> None:
    """Stream one request and fill ``rec``; failures go to ``rec.error``, never raise (except cancellation)."""
    first_event: float | None = None  # first chunk with choices, the TTFT fallback when none carries output
    rec.send_s = clock()
    try:
        async with client.stream("POST", ep.url, json=ep.body(req)) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {_error_text((await resp.aread()).decode(errors='replace'))}"
                return
            async for line in resp.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (pings), event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error") or event.get("object") == "error":
                    rec.error = f"stream error: {_error_text(data)}"
                    return
                if usage := event.get("usage"):
                    if usage.get("completion_tokens") is not None:
                        rec.output_tokens, rec.output_tokens_from = int(usage["completion_tokens"]), "usage"
                    if usage.get("prompt_tokens") is not None:
                        rec.input_tokens = int(usage["prompt_tokens"])
                for choice in event.get("choices") or ():
                    first_event = now if first_event is None else first_event
                    has, chars = _has_output(choice)
                    if has:
                        rec.chunk_s.append(now)
                        rec.output_chars += chars
            rec.end_s = clock()  # before closing the connection
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as e:  # transport errors, malformed events
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return
    if not rec.chunk_s and first_event is not None and rec.output_tokens > 0:
        rec.chunk_s.append(first_event)  # output the server did not show as text (special tokens)
    if rec.output_tokens_from == "stream":
        rec.output_tokens = len(rec.chunk_s)
    rec.success = bool(rec.chunk_s)
    if not rec.success:
        rec.error = "the stream ended without output"


def make_client(timeout_s: float, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # trust_env=False: a benchmark talks to the server directly, never through an environment proxy
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers, trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def served_model(client: httpx.AsyncClient, base_url: str, model: str | None) -> str:
    """GET /v1/models: check the server answers and return the model to ask for (the first one by default)."""
    url = base_url + "/v1/models"
    try:
        resp = await client.get(url, timeout=10.0)
    except httpx.HTTPError as e:
        raise ServerUnavailable(f"cannot reach {base_url}: {type(e).__name__}: {e or 'no response'}") from None
    if resp.status_code != 200:
        raise ServerUnavailable(f"{url}: HTTP {resp.status_code}: {_error_text(resp.text)}")
    try:
        names = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerUnavailable(f"{url}: not an OpenAI model list") from None
    if model is not None:
        if names and model not in names:
            raise ServerUnavailable(f"model {model!r} is not served at {base_url} (served: {', '.join(names)})")
        return model
    if not names:
        raise ServerUnavailable(f"{url}: the server lists no models; pass --model")
    return names[0]
