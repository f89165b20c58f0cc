"""Bounds on the work one request may cause in the frontend, checked cheaply before the costly steps.

`BodyLimit` refuses a body over `--max-request-body-bytes` before it is parsed (from Content-Length
at once, or while a chunked body arrives); `check_chat_size` counts messages and text characters
before rendering (a large body's message count is checked from its raw JSON first: `server/body.py`).
Both answer 413 naming the limit and its flag. `FrontendPool` is the bounded set of worker threads
that parse large bodies and run rendering, tokenizing and image decoding, so the event loop keeps
answering `/health` and other requests while one heavy request is prepared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 32 << 20  # a 20 MiB image is ~27 MiB in base64
    max_messages: int = 10_000
    max_prompt_chars: int = 4 << 20  # ~1M tokens of English text, beyond any context we serve
    frontend_workers: int = 2

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_prompt_chars", "frontend_workers"):
            if getattr(self, name) < 1:
                flag = "--max-request-body-bytes" if name == "max_body_bytes" else "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")


def too_large(message: str, param: str | None):
    """The 413 a request beyond one of the frontend's limits gets (an OpenAI-style error object)."""
    from k3serve.server.errors import APIError

    return APIError(413, message, code="request_too_large", param=param)


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def check_chat_size(messages: Sequence[Any], limits: RequestLimits) -> None:
    """Message count and text characters, counted in one pass before anything is rendered."""
    check_message_count(len(messages), limits)
    chars = 0
    for m in messages:
        if isinstance(m, dict):
            chars += _text_chars(m.get("content")) + _text_chars(m.get("reasoning_content"))
    check_prompt_chars(chars, limits, "messages")


def check_message_count(count: int, limits: RequestLimits) -> None:
    if count > limits.max_messages:
        raise too_large(f"messages: {count} messages exceed this server's limit of {limits.max_messages} "
                       "(--max-messages)", "messages")


def check_prompt_chars(chars: int, limits: RequestLimits, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise too_large(f"{param}: {chars} characters of text exceed this server's limit of "
                       f"{limits.max_prompt_chars} (--max-prompt-chars)", param)


class FrontendPool:
    """A fixed number of worker threads for the frontend's CPU work. The tokenizer and Pillow release
    the GIL; the Python renderer does not, but the interpreter switches threads every few
    milliseconds, so the event loop still runs between its steps."""

    def __init__(self, workers: int):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3serve-frontend")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class BodyLimit:
    """Pure ASGI middleware: 413 for a request body over `limit` bytes, before anything parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)  # the server enforces the declared length
        # no (usable) Content-Length, e.g. chunked: take the body here, counting, then hand it on
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        from k3serve.server.errors import error_response

        await error_response(413, f"request body: larger than this server's limit of {self.limit} bytes "
                                  "(--max-request-body-bytes)", code="request_too_large",
                             param="body")(scope, receive, send)
