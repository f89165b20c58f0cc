"""Parser goldens (chat_format_examples.md §9) under every chunking, and the OpenAI delta shape."""

from __future__ import annotations

import json

import pytest

from k3serve.chat import K3, K25, ChatOptions
from k3serve.chat.parsers import (
    ContentDelta,
    K2Parser,
    K3Parser,
    ParsedMessage,
    ReasoningDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    collect,
)

K3_O1 = ("The user asks for 2+2. That is 4.<|close|>think<|sep|><|open|>response<|sep|>2 + 2 = 4."
         "<|close|>response<|sep|><|close|>message<|sep|>")
K3_O2 = "2 + 2 = 4.<|close|>response<|sep|><|close|>message<|sep|>"
K3_O3 = ('Two tools are needed.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
         '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
         '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="search_flights" index="2"<|sep|>'
         '<|open|>argument key="route" type="object"<|sep|>{"from": "CDG", "to": "NRT"}<|close|>argument<|sep|>'
         '<|open|>argument key="max_results" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
         '<|close|>tools<|sep|><|close|>message<|sep|>')
K25_O1 = "The user asks for 2+2. That is 4.</think>2 + 2 = 4."
K25_O3 = ('Two tools are needed.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
          '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.search_flights:1'
          '<|tool_call_argument_begin|>{"route": {"from": "CDG", "to": "NRT"}, "max_results": 3}<|tool_call_end|>'
          '<|tool_calls_section_end|>')
ANSWER = ParsedMessage("The user asks for 2+2. That is 4.", "2 + 2 = 4.")
TWO_CALLS = ParsedMessage("Two tools are needed.", None, (
    ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
    ToolCall("functions.search_flights:1", "search_flights", '{"route": {"from": "CDG", "to": "NRT"}, "max_results": 3}')))


@pytest.mark.parametrize("text,thinking,expected", [
    (K3_O1, True, ANSWER),
    (K3_O2, False, ParsedMessage(None, "2 + 2 = 4.")),
    (K3_O3, True, TWO_CALLS),
])
def test_k3_goldens(text, thinking, expected, chunked):
    chunked.check(lambda: K3Parser(thinking=thinking), text, expected, chunked.K3)


@pytest.mark.parametrize("text,reasoning,expected", [
    (K25_O1, True, ANSWER),
    ("2 + 2 = 4.", False, ParsedMessage(None, "2 + 2 = 4.")),
    (K25_O3, True, TWO_CALLS),
])
def test_k25_goldens(text, reasoning, expected, chunked):
    chunked.check(lambda: K2Parser(reasoning=reasoning), text, expected, chunked.K2)


def test_k3_arguments_are_a_json_dumps_reserialisation():
    got = K3Parser(thinking=True).parse(K3_O3)
    for call in got.tool_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    assert got.finish_reason == "tool_calls" and ANSWER.finish_reason == "stop"


def test_k3_string_arguments_stream_before_close():
    p = K3Parser(thinking=False)
    p.feed('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>')
    first = p.feed('<|open|>argument key="q" type="string"<|sep|>he said "hi"\n')
    assert first == [ToolCallArgs(0, '{"q": "he said \\"hi\\"\\n')]
    assert p.feed("<|close|>argument<|sep|><|close|>call<|sep|>") == [ToolCallArgs(0, '"}')]
    assert json.loads('{"q": "he said \\"hi\\"\\n"}') == {"q": 'he said "hi"\n'}


def test_openai_chunk_shapes(chunked):
    deltas = chunked.stream(lambda: K2Parser(reasoning=True), [K25_O3[:60], K25_O3[60:130], K25_O3[130:]])
    kinds = [type(d) for d in deltas]
    assert kinds[0] is ReasoningDelta and ToolCallStart in kinds
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert [s.index for s in starts] == [0, 1]
    assert starts[0].to_openai() == {"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                                                     "function": {"name": "get_weather", "arguments": ""}}]}
    args = [d for d in deltas if isinstance(d, ToolCallArgs)]
    assert all(set(a.to_openai()["tool_calls"][0]) == {"index", "function"} for a in args)
    assert ContentDelta("x").to_openai() == {"content": "x"}
    assert ReasoningDelta("y").to_openai() == {"reasoning_content": "y"}
    # A call's arguments never come before its start, and indices never go back.
    seen = -1
    for d in deltas:
        if isinstance(d, ToolCallStart):
            assert d.index == seen + 1
            seen = d.index
        elif isinstance(d, ToolCallArgs):
            assert d.index == seen


def test_message_shape():
    assert TWO_CALLS.to_openai()["content"] is None
    assert TWO_CALLS.to_openai()["tool_calls"][1]["function"]["name"] == "search_flights"
    assert "reasoning_content" not in ParsedMessage(None, "x").to_openai()


def test_delta_validation():
    for bad in (lambda: ContentDelta(""), lambda: ToolCallStart(-1, "i", "n"), lambda: ToolCallStart(0, "", "n"),
                lambda: ToolCallArgs(0, "")):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        collect([ToolCallArgs(0, "{")])


def test_format_parsers_follow_the_prompt(goldens):
    c = goldens["conversations"]["C"]
    prompt = K3.render(c, goldens["tools"], ChatOptions(thinking=False))
    parser = K3.new_parser(prompt, goldens["tools"])
    got = parser.parse('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                       '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|><|close|>call<|sep|>'
                       '<|close|>tools<|sep|><|close|>message<|sep|>')
    assert got.tool_calls == (ToolCall("functions.get_weather:2", "get_weather", '{"city": "Oslo"}'),)
    prompt = K25.render(c, goldens["tools"], ChatOptions(thinking=True))
    got = K25.new_parser(prompt, goldens["tools"]).parse("Warmer: Tokyo.</think>Tokyo is warmer.")
    assert got == ParsedMessage("Warmer: Tokyo.", "Tokyo is warmer.")


@pytest.mark.parametrize("make,text,expected", [
    (lambda: K2Parser(reasoning=True), "<think>r</think>c<|im_end|>ignored", ParsedMessage("r", "c")),
    (lambda: K2Parser(reasoning=False), "plain <think>x</think>", ParsedMessage(None, "plain x")),
    (lambda: K3Parser(thinking=True), "<|open|>think<|sep|>r<|close|>think<|sep|><|open|>response<|sep|>c"
     "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>ignored", ParsedMessage("r", "c")),
    (lambda: K3Parser(thinking=False), "<|open|>response<|sep|>c<|end_of_msg|>x", ParsedMessage(None, "c")),
    (lambda: K3Parser(thinking=True), "r<|close|>think<|sep|>\n stray <|open|>response<|sep|>c", ParsedMessage("r", "\n stray c")),
    (lambda: K3Parser(thinking=False), "a <|open|>b<|sep|> c", ParsedMessage(None, "a <|open|>b<|sep|> c")),
    (lambda: K3Parser(thinking=False), "a <|close|>" + "b" * 5000 + "<|sep|>", ParsedMessage(None, "a <|close|>" + "b" * 5000 + "<|sep|>")),
])
def test_edge_forms(make, text, expected, chunked):
    markers = ("<|tool_call",) if isinstance(make(), K2Parser) else ("<|end_of_msg|>",)
    chunked.check(make, text, expected, markers, every_split=len(text) < 1000)


def test_truncated_call_is_closed_at_finish():
    got = K3Parser(thinking=False).parse('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                                         '<|open|>argument key="q" type="string"<|sep|>hal')
    assert got.tool_calls == (ToolCall("functions.f:0", "f", '{"q": "hal"}'),)
    got = K2Parser(reasoning=False).parse('<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0'
                                          '<|tool_call_argument_begin|>{"q": "ha')
    assert got.tool_calls == (ToolCall("functions.f:0", "f", '{"q": "ha'),)


def test_chat_format_selector():
    from k3serve.chat import K2_INSTRUCT, K2_THINKING, chat_format_for
    assert chat_format_for("kimi_k3") is K3 and K3.is_k3 and K3.stop_token == "<|end_of_msg|>"
    assert chat_format_for("kimi_k25") is K25 and chat_format_for("kimi_k26") is K25
    assert chat_format_for("deepseek_v3") is K2_INSTRUCT and chat_format_for("kimi_linear") is K2_INSTRUCT
    assert chat_format_for("kimi_k2", variant="kimi_k2_thinking") is K2_THINKING
    assert K25.stop_token == "<|im_end|>"
    assert isinstance(K3.new_parser(K3.render([{"role": "user", "content": "q"}])), K3Parser)
    assert isinstance(K25.new_parser(K25.render([{"role": "user", "content": "q"}])), K2Parser)
    for bad in (lambda: chat_format_for(""), lambda: chat_format_for("kimi_k3", variant="nope")):
        with pytest.raises(ValueError):
            bad()


def test_marker_helpers():
    from k3serve.chat.parsers.base import find_first, partial_tail
    assert partial_tail("abc<|tool", ["<|tool_call_end|>", "<|im_end|>"]) == 6
    assert partial_tail("abc<|tool_call_end|>", ["<|tool_call_end|>"]) == 0
    assert partial_tail("a<", ["<|a|>"]) == 1 and partial_tail("x", ["<|a|>"]) == 0
    assert find_first("x<|a|><|ab|>", ["<|ab|>", "<|a|>"]) == (1, "<|a|>")
    assert find_first("x<|a|>", ["<|a|>"], start=2) is None


def test_whitespace_stream_is_linear():
    p = K2Parser(reasoning=False)
    for _ in range(20000):
        assert p.feed(" ") == []
    assert p.feed("x") == [ContentDelta(" " * 20000 + "x")]
