"""Thinking on/off and reasoning placement (frontend.md §2.4 B1/B2, §4.3): with thinking on the reasoning comes
back in ``reasoning_content``, never inside ``content``; with thinking off there is none; streamed, reasoning
deltas come before content deltas; no chat-format control text reaches either field."""

from __future__ import annotations

from k3serve.verify.checks.base import Ctx, Fail, check, leaked
from k3serve.verify.checks.prompts import JSON_ASK, JSON_FORMAT, thinking
from k3serve.verify.checks.tools import tool_request


def _placement(msg: dict) -> None:
    content, reasoning = msg.get("content") or "", msg.get("reasoning_content") or ""
    for field, text in (("content", content), ("reasoning_content", reasoning)):
        if leaked(text):
            raise Fail(f"{leaked(text)!r} leaked into {field}: {text[:80]!r}")
    if reasoning and content and reasoning.strip() in content:
        raise Fail(f"the reasoning is repeated inside content: {content[:80]!r}")


@check("thinking", "on", "thinking on: reasoning in reasoning_content, not in content")
async def on(ctx: Ctx) -> str:
    r = await ctx.ok(tool_request(ctx, stream=False, think=True), "tool call", cache="tool.think")
    if not (r.message.get("reasoning_content") or "").strip():
        raise Fail("thinking on (the default) returned no reasoning_content")
    _placement(r.message)
    return f"reasoning: {r.message['reasoning_content'][:60]!r}"


@check("thinking", "off", "thinking off (chat_template_kwargs.thinking=false): no reasoning_content")
async def off(ctx: Ctx) -> str:
    r = await ctx.ok(tool_request(ctx, stream=True, think=False), "streamed tool call", cache="tool.stream")
    if (r.message.get("reasoning_content") or "").strip():
        raise Fail(f"thinking off still returned reasoning_content {r.message['reasoning_content'][:60]!r}")
    _placement(r.message)
    return "no reasoning with thinking off"


@check("thinking", "streamed_order", "streamed thinking: reasoning deltas before content deltas, nothing leaked")
async def streamed_order(ctx: Ctx) -> str:
    body = ctx.body(JSON_ASK, response_format=JSON_FORMAT, max_tokens=120, stream=True, **thinking(True))
    r = await ctx.ok(body, "streamed JSON answer with thinking", cache="json.think.stream")
    kinds = [k for d in r.deltas for k in ("reasoning_content", "content") if d.get(k)]
    if "reasoning_content" not in kinds:
        raise Fail("a streamed thinking answer had no reasoning deltas")
    if "content" in kinds and kinds.index("content") < max(i for i, k in enumerate(kinds) if k == "reasoning_content"):
        raise Fail("content deltas arrived before the reasoning ended")
    _placement(r.message)
    return f"{kinds.count('reasoning_content')} reasoning then {kinds.count('content')} content deltas"
