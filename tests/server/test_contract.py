"""The request contract over raw HTTP: Kimi Vendor Verifier's malformed requests (400s with an
OpenAI error object), the fixed sampling parameters of the kimi contract, auth, 404, context length."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def fn(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def sysmsg(*tools):
    return {"role": "system", "content": "", "tools": list(tools)}


BAD = {
    # sampling parameters fixed by the kimi contract (KVV tests/params)
    "temperature 1.1": {"temperature": 1.1},
    "temperature 2.0": {"temperature": 2.0},
    "temperature -0.1": {"temperature": -0.1},
    "top_p 0.8": {"top_p": 0.8},
    "presence_penalty 0.5": {"presence_penalty": 0.5},
    "frequency_penalty 0.5": {"frequency_penalty": 0.5},
    "n 2": {"n": 2},
    # tool_choice (KVV k3_features/test_tool_choice)
    "required without tools": {"tool_choice": "required"},
    "required with empty tools": {"tool_choice": "required", "tools": []},
    "bogus tool_choice": {"tool_choice": "bogus", "tools": [TOOL]},
    "named unknown tool": {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [TOOL],
                           "thinking": {"type": "disabled"}},
    "named in thinking mode": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                               "tools": [TOOL]},
    # response_format (KVV k3_features/test_response_format)
    "unknown response_format": {"response_format": {"type": "yaml"}},
    "json_schema without name": {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    "json_schema without schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    "json_schema missing": {"response_format": {"type": "json_schema"}},
    "strict not boolean": {"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
    "schema not object": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
    # dynamic tools (KVV k3_features/test_dynamic_tools)
    "tools in user message": {"messages": [{"role": "user", "content": "hi", "tools": [TOOL]}]},
    "tools in assistant message": {"messages": [*USER, {"role": "assistant", "content": "x", "tools": [TOOL]}, *USER]},
    "system with content and tools": {"messages": [{"role": "system", "content": "x", "tools": [TOOL]}, *USER]},
    "tool without type": {"messages": [sysmsg({"function": {"name": "a"}}), *USER]},
    "tool without function": {"messages": [sysmsg({"type": "function"}), *USER]},
    "tool without name": {"messages": [sysmsg({"type": "function", "function": {}}), *USER]},
    "name starts with digit": {"messages": [sysmsg(fn("1abc")), *USER]},
    "name with @": {"messages": [sysmsg(fn("a@b")), *USER]},
    "empty name": {"messages": [sysmsg(fn("")), *USER]},
    "257-char name": {"messages": [sysmsg(fn("a" * 257)), *USER]},
    "bogus tool type": {"messages": [sysmsg({"type": "bogus", "function": {"name": "a"}}), *USER]},
    "bogus mixed with valid": {"messages": [sysmsg(fn("a"), {"type": "bogus", "function": {"name": "b"}}), *USER]},
    "tools not array": {"messages": [{"role": "system", "content": "", "tools": {"a": 1}}, *USER]},
    "tool item not object": {"messages": [sysmsg("x"), *USER]},
    "duplicate in one message": {"messages": [sysmsg(fn("a"), fn("a")), *USER]},
    "duplicate across messages": {"messages": [sysmsg(fn("a")), *USER, sysmsg(fn("a")), *USER]},
    "duplicate with request tools": {"messages": [sysmsg(fn("get_weather")), *USER], "tools": [TOOL]},
    "tool message without id": {"messages": [*USER, {"role": "tool", "content": "x"}]},
    # general shape
    "empty messages": {"messages": []},
    "messages not array": {"messages": "hi"},
    "unknown role": {"messages": [{"role": "robot", "content": "x"}]},
    "max_tokens 0": {"max_tokens": 0},
    "max_tokens conflicts": {"max_tokens": 5, "max_completion_tokens": 6},
    "stream_options without stream": {"stream_options": {"include_usage": True}},
    "top_logprobs without logprobs": {"top_logprobs": 2},
    "five stop strings": {"stop": ["a", "b", "c", "d", "e"]},
    "thinking keep none": {"thinking": {"type": "enabled", "keep": "none"}},
    "bogus reasoning_effort": {"reasoning_effort": "extreme"},
    "temperature as string": {"temperature": "hot"},
    "image with bad data": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_is_400(kimi_server, case):
    body = {"model": MODEL, "messages": USER, "max_tokens": 1, **BAD[case]}
    r = kimi_server.post("/v1/chat/completions", body)
    assert r.status_code == 400, (case, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "Traceback" not in err["message"]


ACCEPTED = {
    "defaults": {},
    "kimi defaults thinking": {"temperature": 1.0, "top_p": 0.95, "presence_penalty": 0, "frequency_penalty": 0,
                               "n": 1},
    "temperature 0.6": {"temperature": 0.6},
    "temperature 0": {"temperature": 0.0},
    "tool_choice none without tools": {"tool_choice": "none"},
    "tool_choice auto without tools": {"tool_choice": "auto"},
    "dynamic tools later": {"messages": [*USER, {"role": "assistant", "content": "x"}, sysmsg(fn("a"), fn("b")),
                                         *USER]},
    "dynamic + request tools": {"messages": [sysmsg(fn("a")), *USER], "tools": [TOOL]},
    "effort low": {"thinking": {"type": "enabled", "keep": "all", "effort": "low"}},
    "reasoning_effort high": {"reasoning_effort": "high"},
    "chat_template_kwargs": {"chat_template_kwargs": {"thinking": False}},
    "max_completion_tokens": {"max_completion_tokens": 1},
    "json_object": {"response_format": {"type": "json_object"}, "thinking": {"type": "disabled"}},
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted(kimi_server, case):
    body = {"model": MODEL, "messages": USER, "max_tokens": 1, **ACCEPTED[case]}
    r = kimi_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, (case, r.text)
    assert r.json()["usage"]["completion_tokens"] == 1


def test_openai_contract_accepts_full_params(openai_server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 1, "temperature": 1.3, "top_p": 0.8,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"100": 2}}
    assert openai_server.post("/v1/chat/completions", body).status_code == 200
    assert openai_server.post("/v1/chat/completions", {**body, "temperature": 2.5}).status_code == 400


def test_errors_auth_model_context(kimi_server):
    url = kimi_server.url + "/v1/chat/completions"
    body = {"model": MODEL, "messages": USER, "max_tokens": 1}
    r = httpx.post(url, json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = kimi_server.post("/v1/chat/completions", {**body, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = kimi_server.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi " * 3000}]})
    # 400, as OpenAI and vLLM answer it and KVV expects (frontend.md 4.5); 413 is for oversized bodies
    err = r.json()["error"]
    assert r.status_code == 400 and "max_model_len" in err["message"] and err["code"] == "context_length_exceeded"
    r = httpx.post(url, content=b"{not json", headers={**kimi_server.headers, "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url, json=[1, 2], headers=kimi_server.headers)
    assert r.status_code == 400
    r = httpx.get(kimi_server.url + "/v1/nothing", headers=kimi_server.headers)
    assert r.status_code == 404 and "error" in r.json()


def test_side_endpoints(kimi_server):
    s = kimi_server
    assert httpx.get(s.url + "/health").status_code == 200
    assert httpx.get(s.url + "/version").json()["version"]
    models = httpx.get(s.url + "/v1/models", headers=s.headers).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    toks = s.post("/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) == 2
    assert s.post("/detokenize", {"model": MODEL, "tokens": toks["tokens"]}).json()["prompt"] == "Hello world"
    assert s.post("/detokenize", {"model": MODEL, "tokens": [-1]}).status_code == 400
    spec = httpx.get(s.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/messages" in spec["paths"]
    s.post("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1})
    text = httpx.get(s.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:time_to_first_token_seconds_count"):
        assert name in text, name


def test_completions_endpoint(openai_server):
    s = openai_server
    r = s.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "logprobs": 1,
                                   "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 3
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 3
    r2 = s.post("/v1/completions", {"model": MODEL, "prompt": [[9906], [9906, 1917]], "max_tokens": 2,
                                    "temperature": 0})
    assert [c["index"] for c in r2.json()["choices"]] == [0, 1]
    assert s.post("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 2}).status_code == 400
    assert s.post("/v1/completions", {"model": MODEL, "prompt": [10**9], "max_tokens": 2}).status_code == 400


@pytest.mark.parametrize("stream", [False, True])
def test_completions_report_cached_tokens(openai_server, stream):
    s = openai_server
    prompt = list(range(1000 + 500 * stream, 1100 + 500 * stream))  # its own prompt per case: cold at first
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}

    def cached() -> int:
        r = s.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        frames = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        return frames[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached() == 0
    assert cached() >= 64  # the whole blocks of the first run's prompt


def test_kimi_chat_cached_tokens_never_exceed_the_reported_prompt(kimi_server):
    """The kimi contract reports prompt_tokens without the 3-id channel-open stub that ends the prompt. A prompt
    of 16k + 1 ids is cached up to 16k ids on a repeat, 2 of them in the stub: cached_tokens must stop at the
    reported prompt (README's tool request shape)."""
    s = kimi_server
    book = {"type": "function", "function": {"name": "book_hotel", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

    def ask(words: int, **extra) -> httpx.Response:
        content = "Can you book the hotel?\ncity: \"Paris\"" + " x" * words
        r = s.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                            "tools": [book], "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r

    words = next(w for w in range(48) if (ask(w).json()["usage"]["prompt_tokens"] + 3) % 16 == 1)
    usage = ask(words).json()["usage"]  # the whole prompt was seen just now
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    r = ask(words, stream=True, stream_options={"include_usage": True})
    frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    finish = [f["choices"][0]["usage"] for f in frames if f["choices"] and f["choices"][0]["finish_reason"]]
    for u in finish + [frames[-1]["usage"]]:
        assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] == usage["prompt_tokens"]
