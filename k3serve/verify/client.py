"""The verifier's HTTP side: one chat request (JSON or SSE) with a deadline, the stream reassembled into the
message a non-streamed response would carry, and the frames kept for the stream rules.

``Reply.message`` is ``{"content", "reasoning_content", "tool_calls"}`` either way; ``Reply.deltas`` lists the
streamed deltas in order (``[]`` for JSON replies).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Reply:
    status: int
    body: Any = None  # the JSON body (non-stream), or the error body of a refused request
    message: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat `logprobs.content` entries
    deltas: list[dict[str, Any]] = field(default_factory=list)
    frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error(self) -> str:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return str(self.body["error"].get("message", ""))
        return str(self.body)[:300]


class Client:
    """Chat completions against ``base_url`` (scheme://host:port, with or without ``/v1``)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 request_timeout: float = 600.0):
        base = base_url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.base, headers=headers, transport=transport,
                                      timeout=httpx.Timeout(request_timeout, connect=10.0))

    async def close(self) -> None:
        await self.http.aclose()

    async def get(self, path: str) -> tuple[int, Any]:
        r = await self.http.get(path)
        return r.status_code, _json(r.text)

    async def post_raw(self, path: str, content: bytes, content_type: str = "application/json") -> Reply:
        r = await self.http.post(path, content=content, headers={"Content-Type": content_type})
        return Reply(r.status_code, _json(r.text))

    async def chat(self, body: dict[str, Any]) -> Reply:
        if not body.get("stream"):
            r = await self.http.post("/v1/chat/completions", json=body)
            data = _json(r.text)
            reply = Reply(r.status_code, data)
            if r.status_code == 200 and isinstance(data, dict) and data.get("choices"):
                choice = data["choices"][0]
                reply.message = dict(choice.get("message") or {})
                reply.finish_reason = choice.get("finish_reason")
                reply.usage = data.get("usage")
                reply.logprobs = list((choice.get("logprobs") or {}).get("content") or [])
            return reply
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Reply(r.status_code, _json((await r.aread()).decode("utf-8", "replace")))
            reply = Reply(200)
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                frame = _json(data)
                if isinstance(frame, dict):
                    _absorb(reply, frame)
            return reply


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _absorb(reply: Reply, frame: dict[str, Any]) -> None:
    """One SSE frame into the reassembled reply (content and reasoning concatenated, tool-call fragments joined
    by index, the last finish reason, usage from the frame or its choice as Moonshot puts it)."""
    reply.frames.append(frame)
    if frame.get("usage"):
        reply.usage = frame["usage"]
    for choice in frame.get("choices") or []:
        if choice.get("index", 0) != 0:
            continue
        if choice.get("usage"):
            reply.usage = choice["usage"]
        if choice.get("finish_reason"):
            reply.finish_reason = choice["finish_reason"]
        reply.logprobs += list((choice.get("logprobs") or {}).get("content") or [])
        delta = choice.get("delta") or {}
        reply.deltas.append(delta)
        msg = reply.message
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                msg[key] = (msg.get(key) or "") + delta[key]
        for tc in delta.get("tool_calls") or []:
            calls = msg.setdefault("tool_calls", [])
            i = tc.get("index", len(calls))
            while len(calls) <= i:
                calls.append({"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            call, fn = calls[i], tc.get("function") or {}
            call["id"] = tc.get("id") or call["id"]
            call["function"]["name"] = fn.get("name") or call["function"]["name"]
            call["function"]["arguments"] += fn.get("arguments") or ""
