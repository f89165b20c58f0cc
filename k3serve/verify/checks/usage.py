"""``usage.prompt_tokens`` against a local K3 render (chat_format_examples.md §3.3): under the kimi contract the
count is exact (rendered ids minus the 3-token channel stub); under openai anything from that to the full
length passes, as KVV's prompt-token suite allows. Kimi Vendor Verifier's own anchors (36, 119) are checked as
published. Images: a data-URL PNG counts its vision tokens; a text-only model refusing it is 'unsupported'."""

from __future__ import annotations

import base64
import io

from k3serve.verify.checks.base import Ctx, Fail, Unsupported, check
from k3serve.verify.checks.prompts import (DECLINE_ASK, HOTEL, JSON_ASK, JSON_FORMAT, KVV_ASK, KVV_FORMAT,
                                           KVV_TOKENS, TOOL_ASK, TOOL_TURNS, thinking)
from k3serve.verify.local import expected_prompt_tokens


def _within(ctx: Ctx, got: object, moonshot: int, full: int) -> bool:
    if not isinstance(got, int):
        return False
    return got == moonshot if ctx.kimi else moonshot <= got <= full


async def _count(ctx: Ctx, what: str, messages, **kw) -> str:
    think = kw.pop("think", True)
    body = ctx.body(messages, max_tokens=1, **thinking(think), **kw)
    r = await ctx.ok(body, what)
    moonshot, full = expected_prompt_tokens(messages, tools=kw.get("tools"), thinking=think,
                                            response_format=kw.get("response_format"))
    got = (r.usage or {}).get("prompt_tokens")
    if not _within(ctx, got, moonshot, full):
        want = moonshot if ctx.kimi else f"{moonshot}..{full}"
        raise Fail(f"{what}: usage.prompt_tokens={got}, expected {want}")
    return f"{what}={got}"


@check("usage", "prompt_tokens_kvv_anchors", "prompt_tokens of Kimi Vendor Verifier's anchor requests (36, 119)")
async def kvv_anchors(ctx: Ctx) -> str:
    out = []
    for kind, extra in (("plain", {}), ("json_schema", {"response_format": KVV_FORMAT})):
        r = await ctx.ok(ctx.body(KVV_ASK, max_tokens=1, **thinking(False), **extra), f"KVV {kind} request")
        got, want = (r.usage or {}).get("prompt_tokens"), KVV_TOKENS[kind]
        if not _within(ctx, got, want, want + 3):
            raise Fail(f"KVV {kind} request: usage.prompt_tokens={got}, Moonshot's ground truth is {want}")
        out.append(f"{kind}={got}")
    return ", ".join(out)


@check("usage", "prompt_tokens_local", "prompt_tokens of tool, JSON, multi-turn and thinking requests vs a local render")
async def local_render(ctx: Ctx) -> str:
    return "; ".join([
        await _count(ctx, "tools+thinking", TOOL_ASK, tools=[HOTEL]),
        await _count(ctx, "tools, thinking off", DECLINE_ASK, tools=[HOTEL], think=False),
        await _count(ctx, "json_schema", JSON_ASK, response_format=JSON_FORMAT, think=False),
        await _count(ctx, "tool result turn", TOOL_TURNS, tools=[HOTEL]),
    ])


@check("usage", "streamed", "stream_options.include_usage: usage arrives in the stream and adds up")
async def streamed(ctx: Ctx) -> str:
    body = ctx.body(JSON_ASK, response_format=JSON_FORMAT, max_tokens=120, stream=True, **thinking(True))
    r = await ctx.ok(body, "streamed JSON answer with thinking", cache="json.think.stream")
    u = r.usage
    if not u:
        raise Fail("include_usage=true but no usage in the stream (top level or choices[0].usage)")
    if u.get("total_tokens") != u.get("prompt_tokens", 0) + u.get("completion_tokens", 0):
        raise Fail(f"usage does not add up: {u}")
    moonshot, full = expected_prompt_tokens(JSON_ASK, thinking=True, response_format=JSON_FORMAT)
    if not _within(ctx, u.get("prompt_tokens"), moonshot, full):
        raise Fail(f"streamed usage.prompt_tokens={u.get('prompt_tokens')}, expected {moonshot}")
    return f"usage {u.get('prompt_tokens')}+{u.get('completion_tokens')}"


def _png(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@check("images", "data_url", "an image as a data URL: accepted with its vision tokens counted, or refused as text-only")
async def image(ctx: Ctx) -> str:
    w, h = 56, 28
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                             {"type": "image_url", "image_url": {"url": _png(w, h)}}]}]
    r = await ctx.chat(ctx.body(messages, max_tokens=1, **thinking(False)))
    if r.status == 400 and any(s in r.error.lower() for s in ("text only", "image", "vision")):
        raise Unsupported(f"the model takes no images: {r.error[:100]}")
    if r.status in (404, 501):
        raise Unsupported(f"HTTP {r.status}: {r.error[:100]}")
    if not r.ok:
        raise Fail(f"an image request got HTTP {r.status}: {r.error[:100]}")
    moonshot, full = expected_prompt_tokens(messages, thinking=False, image_sizes=((w, h),))
    got = (r.usage or {}).get("prompt_tokens")
    if not _within(ctx, got, moonshot, full):
        raise Fail(f"image request: usage.prompt_tokens={got}, expected {moonshot}")
    return f"prompt_tokens={got} with one {w}x{h} image"
