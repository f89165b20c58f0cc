"""K3 chat-format features (frontend.md §3.2 tests/k3_features): json_schema answers are compact JSON matching
the schema; tools declared inside a system message (dynamic tools) are accepted, and the malformed forms of
them refused; ``thinking.keep`` other than ``all`` is refused."""

from __future__ import annotations

import json

import jsonschema

from k3serve.verify.checks.base import Ctx, Fail, check
from k3serve.verify.checks.prompts import CAR, DECLINE_ASK, HOTEL, JSON_ASK, JSON_FORMAT, thinking


def json_request(ctx: Ctx, **extra) -> dict:
    return {**ctx.body(JSON_ASK, response_format=JSON_FORMAT, max_tokens=80, **thinking(False)), **extra}


@check("k3", "response_format_json_schema", "json_schema: the answer is compact JSON matching the schema, 'stop'")
async def response_format(ctx: Ctx) -> str:
    r = await ctx.ok(json_request(ctx), "json_schema answer", cache="json.plain")
    content = r.message.get("content") or ""
    try:
        value = json.loads(content)
    except ValueError:
        raise Fail(f"json_schema answer is not JSON: {content[:80]!r}") from None
    try:
        jsonschema.validate(value, JSON_FORMAT["json_schema"]["schema"])
    except jsonschema.ValidationError as e:
        raise Fail(f"json_schema answer does not match the schema: {e.message}") from None
    if "\n" in content or "\t" in content:
        raise Fail("json_schema answer contains a newline or tab (KVV wants compact JSON)")
    if r.finish_reason != "stop":
        raise Fail(f"json_schema answer finished with {r.finish_reason!r}, not 'stop'")
    return content


@check("k3", "dynamic_tools", "tools declared in a system message: accepted; malformed declarations refused")
async def dynamic_tools(ctx: Ctx) -> str:
    def sys(content, tools):
        return {"role": "system", "content": content, "tools": tools}

    await ctx.ok(ctx.body([sys("", [CAR]), *DECLINE_ASK], max_tokens=1, **thinking(False)), "dynamic tools")
    bad = {
        "system message with content and tools": [sys("be brief", [CAR]), *DECLINE_ASK],
        "tools in a user message": [{**DECLINE_ASK[0], "tools": [CAR]}],
        "tool name starting with a digit": [sys("", [{"type": "function", "function": {
            "name": "1car", "parameters": {"type": "object"}}}]), *DECLINE_ASK],
        "duplicate names across request and message": None,
    }
    for what, messages in bad.items():
        if messages is None:
            await ctx.refused(ctx.body([sys("", [HOTEL]), *DECLINE_ASK], tools=[HOTEL], max_tokens=1), what)
        else:
            await ctx.refused(ctx.body(messages, max_tokens=1), what)
    return f"accepted; {len(bad)} malformed forms refused"


@check("k3", "thinking_keep", "thinking.keep other than 'all' is refused (Moonshot accepts only 'all')")
async def thinking_keep(ctx: Ctx) -> str:
    if not ctx.kimi:
        return "not part of the openai contract"
    await ctx.refused(ctx.body(DECLINE_ASK, max_tokens=1, thinking={"type": "enabled", "keep": "none"}),
                      "thinking.keep='none'")
    await ctx.ok(ctx.body(DECLINE_ASK, max_tokens=1, thinking={"type": "enabled", "keep": "all"}),
                 "thinking.keep='all'")
    return "keep='none' refused, keep='all' accepted"


@check("stop", "stop_sequence", "a stop string cuts the content before it, finish 'stop'; >4 stop strings refused")
async def stop_sequence(ctx: Ctx) -> str:
    full = (await ctx.ok(json_request(ctx), "json_schema answer", cache="json.plain")).message.get("content") or ""
    if "," not in full:
        raise Fail(f"the unstopped answer {full!r} has no ',' to stop at")
    r = await ctx.ok(json_request(ctx, stop=[","]), "stop=[',']")
    got = r.message.get("content") or ""
    if got != full.split(",")[0]:
        raise Fail(f"stop=[','] gave {got!r}, expected {full.split(',')[0]!r} (the greedy answer up to the stop)")
    if r.finish_reason != "stop":
        raise Fail(f"a stop-string hit finished with {r.finish_reason!r}, not 'stop'")
    await ctx.refused(json_request(ctx, stop=["a", "b", "c", "d", "e"]), "5 stop strings")
    return f"{got!r}, finish 'stop'"


@check("stop", "finish_reasons", "finish_reason: 'stop' at the end of an answer, 'length' at max_tokens")
async def finish_reasons(ctx: Ctx) -> str:
    r = await ctx.ok(json_request(ctx), "json_schema answer", cache="json.plain")
    if r.finish_reason != "stop":
        raise Fail(f"a complete answer finished with {r.finish_reason!r}")
    cut = await ctx.ok(json_request(ctx, max_tokens=3), "max_tokens=3")
    if cut.finish_reason != "length":
        raise Fail(f"an answer cut at max_tokens finished with {cut.finish_reason!r}, not 'length'")
    return "'stop' and 'length' where due"
