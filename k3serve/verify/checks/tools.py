"""Tool calls (frontend.md §3.1 K2VV schema check, §4.2-4.3 stream rules): a call must name a declared tool,
its ``arguments`` must be a JSON object valid against that tool's ``parameters`` schema, ids must be unique
non-empty strings (``functions.<name>:<n>`` naming the called function when in the Kimi form), the finish reason
is ``tool_calls``; streamed, the first fragment of a call carries id, type and name and later fragments only
arguments, indices start at 0 and never go back."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jsonschema

from k3serve.verify.checks.base import Ctx, Fail, check, leaked
from k3serve.verify.checks.prompts import HOTEL, TOOL_ASK, thinking

_KIMI_ID = re.compile(r"^functions\.(?P<name>[\w.\-]+):(?P<idx>\d+)$")


def check_calls(calls: Sequence[dict[str, Any]] | None, tools: Sequence[dict[str, Any]]) -> str:
    """Raise Fail unless every call is valid against its declared tool; return a summary."""
    if not calls:
        raise Fail("no tool call was made")
    declared = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    ids = [c.get("id") for c in calls]
    if any(not isinstance(i, str) or not i for i in ids) or len(set(ids)) != len(ids):
        raise Fail(f"tool call ids must be unique non-empty strings, got {ids}")
    for c in calls:
        fn = c.get("function") or {}
        name, args = fn.get("name"), fn.get("arguments")
        if name not in declared:
            raise Fail(f"tool call names {name!r}, which is not declared")
        if c.get("type") != "function":
            raise Fail(f"tool call type is {c.get('type')!r}, not 'function'")
        m = _KIMI_ID.match(c["id"])
        if m and m["name"] != name:
            raise Fail(f"tool call id {c['id']!r} names another function than {name!r}")
        if not isinstance(args, str):
            raise Fail(f"arguments of {name} must be a JSON string, got {type(args).__name__}")
        try:
            value = json.loads(args)
        except ValueError:
            raise Fail(f"arguments of {name} are not valid JSON: {args[:80]!r}") from None
        if not isinstance(value, dict):
            raise Fail(f"arguments of {name} are not a JSON object: {args[:80]!r}")
        try:
            jsonschema.validate(value, declared[name])
        except jsonschema.ValidationError as e:
            raise Fail(f"arguments of {name} do not match its schema: {e.message}") from None
    return ", ".join(f"{c['function']['name']}({c['function']['arguments']}) id={c['id']}" for c in calls)


def tool_request(ctx: Ctx, *, stream: bool, think: bool) -> dict[str, Any]:
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    return ctx.body(TOOL_ASK, tools=[HOTEL], max_tokens=160, **extra, **thinking(think))


@check("tools", "call", "a tool call (thinking on): declared name, schema-valid JSON arguments, ids, finish")
async def call(ctx: Ctx) -> str:
    r = await ctx.ok(tool_request(ctx, stream=False, think=True), "tool call", cache="tool.think")
    summary = check_calls(r.message.get("tool_calls"), [HOTEL])
    if r.finish_reason != "tool_calls":
        raise Fail(f"a response with tool calls finished with {r.finish_reason!r}, not 'tool_calls'")
    if r.message.get("content") not in (None, "") and leaked(r.message["content"]):
        raise Fail(f"tool markup in content: {r.message['content'][:80]!r}")
    return summary


@check("tools", "call_streamed", "a streamed tool call (thinking off): fragments, indices, arguments, finish")
async def call_streamed(ctx: Ctx) -> str:
    r = await ctx.ok(tool_request(ctx, stream=True, think=False), "streamed tool call", cache="tool.stream")
    summary = check_calls(r.message.get("tool_calls"), [HOTEL])
    seen: dict[int, int] = {}
    last = -1
    for d in r.deltas:
        for tc in d.get("tool_calls") or []:
            i = tc.get("index")
            if not isinstance(i, int) or i < last or (i > last and i != last + 1):
                raise Fail(f"tool-call indices must start at 0 and rise by 1, got {i} after {last}")
            last = i
            fn = tc.get("function") or {}
            if i not in seen:
                if not (tc.get("id") and tc.get("type") == "function" and fn.get("name")):
                    raise Fail(f"the first fragment of call {i} lacks id, type or name: {tc}")
            elif tc.get("id") or fn.get("name"):
                raise Fail(f"a later fragment of call {i} repeats its id or name: {tc}")
            seen[i] = seen.get(i, 0) + 1
    if r.finish_reason != "tool_calls":
        raise Fail(f"the stream finished with {r.finish_reason!r}, not 'tool_calls'")
    return f"{summary}; {sum(seen.values())} fragments"
