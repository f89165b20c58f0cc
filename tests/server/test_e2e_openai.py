"""End to end through the official `openai` client against real servers (both contracts)."""

from __future__ import annotations

import base64
import io
import json

import jsonschema
import openai
import pytest
from PIL import Image

from tests.server.conftest import API_KEY, MODEL

NO_THINK = {"thinking": {"type": "disabled"}}
NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 3},
        "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "ok": {"type": "boolean"}},
                  "required": ["lat", "ok"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 1},
    },
    "required": ["city", "where", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": NESTED}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


def collect_stream(stream) -> dict:
    """Reassemble a chat stream the way K2VV does; also return the frames."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None, "frames": []}
    for chunk in stream:
        out["frames"].append(chunk)
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"name": None, "arguments": ""})
                if tc.function.name:
                    call["name"] = tc.function.name
                call["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                out["finish"] = ch.finish_reason
    return out


def test_chat_non_stream(server):
    r = client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=4, extra_body=NO_THINK)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    ids = server.post("/tokenize", {"model": MODEL, "messages": USER, **NO_THINK}).json()["tokens"]
    # kimi: usage counts the ids without the 3-id `<|open|>response<|sep|>` stub (chat_format_examples §3.3)
    assert r.usage.prompt_tokens == len(ids) - (3 if server.contract == "kimi" else 0)


def test_chat_stream_usage_and_frames(server):
    stream = client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=3, stream=True,
                                                    stream_options={"include_usage": True}, extra_body=NO_THINK)
    got = collect_stream(stream)
    frames = got["frames"]
    assert frames[0].choices[0].delta.role == "assistant"
    assert all(len(f.choices) == 1 for f in frames[:-1]) and frames[-1].choices == []
    finish = frames[-2].choices[0]
    assert finish.finish_reason == "length" and finish.delta.content is None
    assert finish.model_extra["usage"]["completion_tokens"] == 3  # Moonshot: usage on the finish frame
    assert got["usage"].completion_tokens == 3 and got["content"]
    assert len({f.id for f in frames}) == 1


def test_n2_openai_and_rejected_by_kimi(openai_server, kimi_server):
    r = client(openai_server).chat.completions.create(model=MODEL, messages=USER, max_tokens=3, n=2,
                                                      temperature=1.0, seed=1, extra_body=NO_THINK)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6
    assert r.choices[0].message.content != r.choices[1].message.content
    frames = list(client(openai_server).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, n=2, stream=True, stream_options={"include_usage": True},
        extra_body=NO_THINK))
    assert all(len(f.choices) == 1 for f in frames[:-1])  # Moonshot: one choice per frame, even for n > 1
    finishes = [f.choices[0].index for f in frames[:-1] if f.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1] and frames[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError):
        client(kimi_server).chat.completions.create(model=MODEL, messages=USER, max_tokens=3, n=2,
                                                    extra_body=NO_THINK)


def test_logprobs(server):
    r = client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=3, logprobs=True,
                                               top_logprobs=2, extra_body=NO_THINK)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0 and len(tops) == 2 and tops[0] >= tops[1] and entry.logprob <= tops[0] + 1e-6
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token


def test_seed_reproducible(server):
    c = client(server)

    def run(seed):
        return c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=1.0, seed=seed,
                                         extra_body=NO_THINK).choices[0].message.content

    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(openai_server, stream):
    c = client(openai_server)
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=0, extra_body=NO_THINK)
    full = c.chat.completions.create(**kw).choices[0].message.content
    assert len(full) > 4
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if stream:
        got = collect_stream(c.chat.completions.create(stream=True, stop=[stop], **kw))
        content, finish = got["content"], got["finish"]
        # no frame ends with the start of the stop string: it is held until it cannot be one
        assert not any((f.choices[0].delta.content or "").endswith(stop[0]) for f in got["frames"] if f.choices)
    else:
        r = c.chat.completions.create(stop=[stop], **kw)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    assert content == full[:full.index(stop)]


def test_stop_string_in_reasoning_does_not_stop(openai_server):
    """Stop strings apply to content only (frontend.md §4.2): the random model's 8 tokens stay in the
    think channel, so a stop string taken from them leaves the answer unchanged."""
    c = client(openai_server)
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=0, extra_body={"thinking": {"type": "enabled"}})
    full = c.chat.completions.create(**kw).choices[0]
    reasoning = full.message.model_extra.get("reasoning_content") or ""
    assert len(reasoning) > 4 and full.finish_reason == "length"
    r = c.chat.completions.create(stop=[reasoning[2:5]], **kw).choices[0]
    assert r.message.model_extra.get("reasoning_content") == reasoning and r.finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_validates(server, stream):
    c = client(server)
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, extra_body=NO_THINK,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        got = collect_stream(c.chat.completions.create(stream=True, **kw))
        calls, finish = [(v["name"], v["arguments"]) for _, v in sorted(got["calls"].items())], got["finish"]
        assert got["content"] == ""
    else:
        r = c.chat.completions.create(**kw)
        msg = r.choices[0].message
        calls, finish = [(t.function.name, t.function.arguments) for t in msg.tool_calls], r.choices[0].finish_reason
        assert msg.content is None and msg.tool_calls[0].id
    assert finish == "tool_calls" and len(calls) == 1
    name, args = calls[0]
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), NESTED)


def test_required_tool_call(openai_server):
    r = client(openai_server).chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80,
                                                      tool_choice="required", temperature=0, extra_body=NO_THINK)
    call = r.choices[0].message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_strict_tools_auto_calls_follow_the_schema(openai_server):
    """`tool_choice` auto with strict functions: the turn may still answer in text, but a call is constrained
    to a declared tool and its schema. The bias steers the random model out of the answer text (`<|close|>`)
    and into the tools section (`<|open|>`); `parallel_tool_calls: false` allows exactly one call."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    r = client(openai_server).chat.completions.create(
        model=MODEL, messages=USER, tools=strict, max_tokens=120, temperature=0, parallel_tool_calls=False,
        logit_bias={"163587": 100, "163588": 50}, extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output(server, stream):
    c = client(server)
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": NESTED, "strict": True}}
    kw = dict(model=MODEL, messages=USER, response_format=rf, max_tokens=80, extra_body=NO_THINK)
    if stream:
        got = collect_stream(c.chat.completions.create(stream=True, **kw))
        text, finish = got["content"], got["finish"]
    else:
        r = c.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    assert "\n" not in text and "\t" not in text
    jsonschema.validate(json.loads(text), NESTED)


def test_reasoning_separated_from_content(openai_server):
    """Thinking on: the grammar forces `<|close|>think<|sep|><|open|>response<|sep|>` + JSON after free
    reasoning; a bias on `<|close|>` (163588) lets the random model leave the think channel soon."""
    c = client(openai_server)
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": NESTED}}
    seen = 0
    for seed in range(6):
        r = c.chat.completions.create(model=MODEL, messages=USER, response_format=rf, max_tokens=80, seed=seed,
                                      logit_bias={"163588": 12}, extra_body={"thinking": {"type": "enabled"}})
        msg = r.choices[0].message
        jsonschema.validate(json.loads(msg.content), NESTED)
        reasoning = msg.model_extra.get("reasoning_content")
        for text in (msg.content, reasoning or ""):
            assert "<|" not in text
        seen += bool(reasoning)
    assert seen >= 1


def _png(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_request(server):
    c = client(server)
    text_only = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, extra_body=NO_THINK)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(56, 84)}},
                                         {"type": "text", "text": USER[0]["content"]}]}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body=NO_THINK)
    # 56x84 -> 2x3 cells of 28 px = 6 vision tokens, plus the `<|media_begin|>image 56x84<|media_content|>`
    # header and `<|media_end|>` around them
    extra = r.usage.prompt_tokens - text_only.usage.prompt_tokens
    assert extra > 6 and extra < 20
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not allowed"):
        c.chat.completions.create(model=MODEL, messages=remote, max_tokens=1)
