"""`/v1/messages` through the official `anthropic` client (both contracts)."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

from tests.server.conftest import API_KEY, MODEL
from tests.server.test_e2e_openai import NESTED

NO_THINK = {"thinking": {"type": "disabled"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=600)


def test_messages_text(server):
    r = client(server).messages.create(model=MODEL, max_tokens=3, messages=USER, extra_body=NO_THINK)
    assert r.type == "message" and r.role == "assistant" and r.stop_reason == "max_tokens"
    assert r.usage.output_tokens == 3 and r.usage.input_tokens > 0
    assert r.content[0].type == "text" and r.content[0].text


def test_messages_stream(server):
    with client(server).messages.stream(model=MODEL, max_tokens=3, messages=USER, extra_body=NO_THINK) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_tool(server, stream):
    c = client(server)
    kw = dict(model=MODEL, max_tokens=80, messages=USER, extra_body=NO_THINK,
              tools=[{"name": "get_weather", "description": "weather", "input_schema": NESTED}],
              tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with c.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = c.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, NESTED)


def test_messages_tool_round_trip_and_errors(server):
    c = client(server)
    history = [*USER,
               {"role": "assistant", "content": [{"type": "tool_use", "id": "functions.get_weather:0",
                                                  "name": "get_weather", "input": {"city": "Par"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.get_weather:0",
                                             "content": "sunny"}]}]
    r = c.messages.create(model=MODEL, max_tokens=1, messages=history, extra_body=NO_THINK,
                          tools=[{"name": "get_weather", "input_schema": NESTED}])
    assert r.usage.output_tokens == 1
    n = c.messages.count_tokens(model=MODEL, messages=USER, extra_body=NO_THINK)
    assert n.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "robot", "content": "x"}])
