"""Fidelity against a reference (``--reference``): on a fixed prompt set, greedy decoding must agree token for
token and the logprobs must match. Agreement = common greedy prefix / the longer answer, averaged; KL(ref || endpoint)
over the reference's top tokens at each shared position (a token missing from the endpoint's top list gets its
smallest listed logprob, so the estimate is a lower bound), averaged. A sampling bug that shifts logits fails
both or the KL alone."""

from __future__ import annotations

import math

from k3serve.verify.checks.base import Ctx, Fail, check
from k3serve.verify.checks.prompts import CAR, DECLINE_ASK, HOTEL, TOOL_ASK
from k3serve.verify.reference import TOP, Step, steps_from_openai

PROMPTS = [(TOOL_ASK, [HOTEL], True), (TOOL_ASK, [HOTEL], False), (DECLINE_ASK, [HOTEL, CAR], False)]
MAX_TOKENS = 24
MIN_AGREEMENT = 0.9
MAX_KL = 0.02  # nats per token


def agreement(ref: list[Step], got: list[Step]) -> tuple[float, int]:
    n = 0
    while n < min(len(ref), len(got)) and ref[n].token == got[n].token:
        n += 1
    return (n / max(len(ref), len(got)) if ref or got else 1.0), n


def kl(ref: list[Step], got: list[Step], upto: int) -> float:
    vals = []
    for r, g in zip(ref[:upto], got[:upto]):
        top = r.top or {r.token: r.logprob}
        floor = min(g.top.values()) if g.top else g.logprob
        mass = sum(math.exp(v) for v in top.values())
        vals.append(sum(math.exp(v) / mass * (v - g.top.get(t, floor)) for t, v in top.items()))
    return max(0.0, sum(vals) / len(vals)) if vals else 0.0


async def _pairs(ctx: Ctx) -> list[tuple[list[Step], list[Step]]]:
    if "fidelity" in ctx._cache:
        return ctx._cache["fidelity"]  # type: ignore[return-value]
    pairs = []
    for messages, tools, think in PROMPTS:
        body = ctx.body(messages, tools=tools, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=TOP,
                        **({} if think else {"chat_template_kwargs": {"thinking": False}}))
        r = await ctx.ok(body, "greedy request with logprobs")
        if not r.logprobs:
            raise Fail("the endpoint returned no logprobs, so fidelity cannot be measured")
        ref = await ctx.reference.greedy(messages, tools, think, MAX_TOKENS)
        pairs.append((ref, steps_from_openai(r.logprobs)))
    ctx._cache["fidelity"] = pairs  # type: ignore[assignment]
    return pairs


@check("fidelity", "greedy_agreement", "greedy tokens agree with the reference on a fixed prompt set",
       needs_reference=True)
async def greedy_agreement(ctx: Ctx) -> str:
    scores = [agreement(ref, got)[0] for ref, got in await _pairs(ctx)]
    mean = sum(scores) / len(scores)
    detail = f"agreement {mean:.3f} ({', '.join(f'{s:.2f}' for s in scores)})"
    if mean < MIN_AGREEMENT:
        raise Fail(f"{detail} < {MIN_AGREEMENT}")
    return detail


@check("fidelity", "logprob_kl", "logprobs match the reference: mean KL(ref || endpoint) per token",
       needs_reference=True)
async def logprob_kl(ctx: Ctx) -> str:
    vals = [kl(ref, got, agreement(ref, got)[1] or 1) for ref, got in await _pairs(ctx)]
    mean = sum(vals) / len(vals)
    detail = f"KL {mean:.4f} nats/token ({', '.join(f'{v:.4f}' for v in vals)})"
    if mean > MAX_KL:
        raise Fail(f"{detail} > {MAX_KL}")
    return detail
