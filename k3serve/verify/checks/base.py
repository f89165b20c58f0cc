"""What a check is, what it may conclude, and the context it runs in.

A check is an async function ``(ctx) -> str`` registered with ``@check(group, name, what)``: it returns a one-line
detail when the endpoint passes, raises ``Fail`` when it breaks the contract and ``Unsupported`` when the endpoint
does not offer the feature (404 route, 501, or a 400 saying the parameter is not supported). Anything else it
raises is reported as ``error``; the runner's timeout as ``fail`` (a slow or looping model fails the check).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from k3serve.verify.client import Client, Reply

MARKUP = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<think>", "</think>", "<|im_end|>",
          "<|tool_calls_section_begin|>", "<|tool_call_begin|>")
_UNSUPPORTED = re.compile(r"not supported|unsupported|not implemented|unknown (field|parameter)|unrecognized", re.I)


class Fail(Exception):
    """The endpoint breaks the contract; the message says how."""


class Unsupported(Exception):
    """The endpoint does not offer what the check needs."""


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str | None = None  # None: the first of /v1/models
    api_key: str | None = None
    contract: str = "kimi"  # "kimi": Moonshot's fixed sampling parameters; "openai": the OpenAI ranges
    timeout_s: float = 120.0  # per check
    reference: str | None = None  # a URL, a local checkpoint path or a built-in model name

    def __post_init__(self) -> None:
        if self.contract not in ("kimi", "openai"):
            raise ValueError(f"contract: must be kimi or openai, got {self.contract!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {self.timeout_s}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base-url: must start with http:// or https://, got {self.base_url!r}")


@dataclass(frozen=True)
class Check:
    group: str
    name: str
    what: str
    fn: Callable[[Ctx], Awaitable[str]]
    needs_reference: bool = False

    @property
    def id(self) -> str:
        return f"{self.group}.{self.name}"


@dataclass
class Result:
    id: str
    group: str
    what: str
    status: str  # pass | fail | unsupported | error | skipped
    detail: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "group": self.group, "what": self.what, "status": self.status,
                "detail": self.detail, "seconds": round(self.seconds, 2)}


CHECKS: list[Check] = []


def check(group: str, name: str, what: str, *, needs_reference: bool = False):
    def register(fn: Callable[[Ctx], Awaitable[str]]) -> Callable[[Ctx], Awaitable[str]]:
        CHECKS.append(Check(group, name, what, fn, needs_reference))
        return fn
    return register


@dataclass
class Ctx:
    target: Target
    client: Client
    model: str
    reference: Any = None  # verify.reference.Reference when --reference is given
    _cache: dict[str, Reply] = field(default_factory=dict)

    @property
    def kimi(self) -> bool:
        return self.target.contract == "kimi"

    def body(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A request body: greedy (temperature 0 is allowed by both contracts), the model, ``extra`` fields."""
        return {"model": self.model, "messages": messages, "temperature": 0, **extra}

    async def chat(self, body: dict[str, Any]) -> Reply:
        return await self.client.chat(body)

    async def ok(self, body: dict[str, Any], what: str, *, cache: str | None = None) -> Reply:
        """A request that must succeed; ``cache`` names it so several checks share one generation."""
        if cache is not None and cache in self._cache:
            return self._cache[cache]
        reply = await self.chat(body)
        if reply.status in (404, 405, 501) or (reply.status == 400 and _UNSUPPORTED.search(reply.error)):
            raise Unsupported(f"{what}: HTTP {reply.status}: {reply.error}")
        if not reply.ok:
            raise Fail(f"{what}: HTTP {reply.status}: {reply.error}")
        if cache is not None:
            self._cache[cache] = reply
        return reply

    async def refused(self, body: dict[str, Any], what: str) -> None:
        """A request the contract refuses: 400 (or 422) with an OpenAI error object."""
        reply = await self.chat(body)
        if reply.status == 404:
            raise Unsupported(f"{what}: HTTP 404: {reply.error}")
        if reply.status not in (400, 422):
            raise Fail(f"{what}: expected HTTP 400, got {reply.status}")
        if not (isinstance(reply.body, dict) and isinstance(reply.body.get("error"), dict)
                and reply.body["error"].get("message")):
            raise Fail(f"{what}: HTTP {reply.status} without an OpenAI error object ({str(reply.body)[:120]})")


def leaked(text: str | None) -> str | None:
    """The first chat-format control text found in ``text``, or None."""
    return next((m for m in MARKUP if text and m in text), None)
