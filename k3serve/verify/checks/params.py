"""Request-parameter rules (frontend.md §3.2 tests/params, §4.4): the kimi contract fixes sampling (temperature
0, 0.6 or 1.0; top_p 0.95; penalties 0; n 1) and refuses other values with 400; both contracts refuse malformed
fields, bad ``n``/``logprobs``/``max_tokens`` and answer with an OpenAI error object."""

from __future__ import annotations

from k3serve.verify.checks.base import Ctx, Fail, check
from k3serve.verify.checks.prompts import DECLINE_ASK, HOTEL, THINK_OFF

ASK = DECLINE_ASK  # any valid chat; these requests generate at most one token


@check("params", "fixed_sampling_accepted", "the contract's fixed sampling values are accepted")
async def fixed_sampling_accepted(ctx: Ctx) -> str:
    values = [{"temperature": 0.6, "top_p": 0.95, "presence_penalty": 0, "frequency_penalty": 0, "n": 1},
              {"temperature": 1.0}, {"temperature": 0.0}]
    for v in values:
        await ctx.ok({**ctx.body(ASK, max_tokens=1), **v}, f"{v}")
    return f"{len(values)} requests with contract values accepted"


@check("params", "sampling_out_of_contract_refused", "sampling values outside the contract get 400")
async def sampling_refused(ctx: Ctx) -> str:
    if ctx.kimi:
        bad = [{"temperature": 1.1}, {"temperature": 2.0}, {"temperature": -0.1}, {"top_p": 0.8},
               {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}]
    else:
        bad = [{"temperature": 2.5}, {"temperature": -0.1}, {"top_p": 1.5}, {"presence_penalty": 3.0}]
    for v in bad:
        await ctx.refused({**ctx.body(ASK, max_tokens=1), **v}, f"{v}")
    return f"{len(bad)} out-of-contract values refused with 400"


@check("params", "n", "n: 1 accepted; 2 refused (kimi) or 2 choices (openai); 0 refused")
async def n_rule(ctx: Ctx) -> str:
    await ctx.refused({**ctx.body(ASK, max_tokens=1), "n": 0}, "n=0")
    if ctx.kimi:
        await ctx.refused({**ctx.body(ASK, max_tokens=1), "n": 2}, "n=2 under the kimi contract")
        return "n=0 and n=2 refused"
    r = await ctx.ok({**ctx.body(ASK, max_tokens=1), "n": 2}, "n=2")
    if len(r.body.get("choices") or []) != 2:
        raise Fail(f"n=2 returned {len(r.body.get('choices') or [])} choices")
    return "n=0 refused, n=2 gives 2 choices"


@check("params", "logprobs", "logprobs/top_logprobs: entries with token, logprob, bytes, top_logprobs; bounds")
async def logprobs_rule(ctx: Ctx) -> str:
    r = await ctx.ok({**ctx.body(ASK, max_tokens=2, logprobs=True, top_logprobs=3), **THINK_OFF}, "logprobs=true")
    if not r.logprobs:
        raise Fail("logprobs=true returned no choices[0].logprobs.content")
    for e in r.logprobs:
        if not isinstance(e.get("token"), str) or not isinstance(e.get("logprob"), (int, float)) or e["logprob"] > 1e-6:
            raise Fail(f"logprobs entry malformed: {e}")
        tops = e.get("top_logprobs")
        if not isinstance(tops, list) or not 1 <= len(tops) <= 3:
            raise Fail(f"top_logprobs=3 gave {tops!r}")
    await ctx.refused(ctx.body(ASK, max_tokens=1, logprobs=True, top_logprobs=21), "top_logprobs=21")
    return f"{len(r.logprobs)} logprob entries well-formed; top_logprobs=21 refused"


@check("params", "max_tokens", "max_tokens 0, -1 and a non-integer get 400; 1 gives one token and 'length'")
async def max_tokens_rule(ctx: Ctx) -> str:
    for v in (0, -1, "ten"):
        await ctx.refused(ctx.body(ASK, max_tokens=v), f"max_tokens={v!r}")
    r = await ctx.ok({**ctx.body(ASK, max_tokens=1), **THINK_OFF}, "max_tokens=1")
    if r.finish_reason != "length":
        raise Fail(f"max_tokens=1 finished with {r.finish_reason!r}, not 'length'")
    got = (r.usage or {}).get("completion_tokens")
    if got != 1:
        raise Fail(f"max_tokens=1 reported completion_tokens={got}")
    return "bounds refused; max_tokens=1 -> 1 token, finish 'length'"


@check("params", "malformed_refused", "malformed requests get 400 with an OpenAI error object")
async def malformed_refused(ctx: Ctx) -> str:
    cases = {
        "no messages": {"model": ctx.model},
        "empty messages": ctx.body([]),
        "unknown role": ctx.body([{"role": "wizard", "content": "hi"}]),
        "tool message without tool_call_id": ctx.body([*ASK, {"role": "tool", "content": "x"}]),
        "tool_choice 'bogus'": ctx.body(ASK, tools=[HOTEL], tool_choice="bogus"),
        "tool_choice 'required' without tools": ctx.body(ASK, tool_choice="required"),
        "tools not an array": ctx.body(ASK, tools={"type": "function"}),
        "response_format type 'bogus'": ctx.body(ASK, response_format={"type": "bogus"}),
        "json_schema without schema": ctx.body(ASK, response_format={"type": "json_schema",
                                                                     "json_schema": {"name": "x"}}),
        "json_schema strict not a boolean": ctx.body(ASK, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "strict": "yes", "schema": {"type": "object"}}}),
        "stream_options without stream": ctx.body(ASK, stream_options={"include_usage": True}),
    }
    if ctx.kimi:
        cases["logit_bias under the kimi contract"] = ctx.body(ASK, logit_bias={"1": 5})
    for what, body in cases.items():
        await ctx.refused(body, what)
    r = await ctx.client.post_raw("/v1/chat/completions", b"{not json")
    if r.status not in (400, 422):
        raise Fail(f"a body that is not JSON got HTTP {r.status}, not 400")
    return f"{len(cases) + 1} malformed requests refused"


@check("params", "unknown_model", "an unknown model name gets 404 (or 400) with an error object")
async def unknown_model(ctx: Ctx) -> str:
    r = await ctx.chat({**ctx.body(ASK, max_tokens=1), "model": "no-such-model-k3serve-verify"})
    if r.status not in (400, 404):
        raise Fail(f"an unknown model got HTTP {r.status}")
    return f"HTTP {r.status}: {r.error[:60]}"
