"""One fixture per bug class of frontend.md §2.4 for each family (K2: K2/K2.5 markers; K3: XTML),
parsed non-streaming and under adversarial chunking (every split point, 1-7 chars, single bytes)."""

from __future__ import annotations

import json
import re

import pytest

from k3serve.chat import K2_INSTRUCT, K3, K25, ChatOptions
from k3serve.chat.parsers import (
    K2Parser,
    K3Parser,
    ParsedMessage,
    ToolCall,
    is_degenerate,
    mint_tool_call_id,
    tool_call_error,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}
EXEC = {"type": "function", "function": {"name": "exec", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
TOOLS = [WEATHER, EXEC]

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def k2call(cid: str, args: str) -> str:
    return f"{CB}{cid}{AB}{args}{CE}"


def k3call(name: str, *args: tuple[str, str, str], index: str = "1") -> str:
    body = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'


def k3tools(*calls: str) -> str:
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


K3_END = "<|close|>message<|sep|>"
PARIS_ARGS = '{"city": "Paris"}'
PARIS_K2 = k2call("functions.get_weather:0", PARIS_ARGS)
PARIS = ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')


def k2(chunked, text, expected, *, reasoning=False, tools=None, base=0, every_split=True):
    chunked.check(lambda: K2Parser(reasoning=reasoning, tools=tools, next_call_index=base), text, expected,
                  chunked.K2, every_split=every_split)


def k3(chunked, text, expected, *, thinking=False, tools=None, base=0, every_split=True):
    chunked.check(lambda: K3Parser(thinking=thinking, tools=tools, next_call_index=base), text, expected,
                  chunked.K3, every_split=every_split)


# B1: markers (and noise between section and call) never reach content/reasoning.
def test_b01_k2(chunked):
    text = f"Let me check.{SB} \n noise{PARIS_K2}{SE}"
    k2(chunked, text, ParsedMessage(None, "Let me check.", (PARIS,)))


def test_b01_k3(chunked):
    text = ("Let me check.<|close|>response<|sep|><|open|>tools<|sep|> noise "
            + k3call("get_weather", ("city", "string", "Paris")) + "<|close|>tools<|sep|>" + K3_END)
    k3(chunked, text, ParsedMessage(None, "Let me check.", (PARIS,)))


# B2: a tool section opened inside the reasoning channel ends reasoning there.
@pytest.mark.parametrize("opener", [SB, ""])
def test_b02_k2(chunked, opener):
    text = f"I need the weather.{opener}{PARIS_K2}{SE}"
    k2(chunked, text, ParsedMessage("I need the weather.", None, (PARIS,)), reasoning=True)


def test_b02_k3(chunked):
    text = "I need the weather." + k3tools(k3call("get_weather", ("city", "string", "Paris"))) + K3_END
    k3(chunked, text, ParsedMessage("I need the weather.", None, (PARIS,)), thinking=True)


# B3: non-canonical ids neither crash nor drop the call; names resolve, ids become canonical.
@pytest.mark.parametrize("raw,tools,name,cid", [
    ("get_weather:0", TOOLS, "get_weather", "functions.get_weather:0"),
    ("functions.get_weather:3", None, "get_weather", "functions.get_weather:3"),
    ("call_0a1b2c3d", TOOLS, "get_weather", "functions.get_weather:7"),
    ("call00003", TOOLS, "get_weather", "functions.get_weather:7"),
    ("functionsexec5", TOOLS, "exec", "functions.exec:7"),
    ("functionsexec5", None, "exec", "functions.exec:7"),
    ("3f2b8c1e-9d4a-4e8b-a1c2-7d6e5f4a3b2c", TOOLS, "get_weather", "functions.get_weather:7"),
])
def test_b03_k2(chunked, raw, tools, name, cid):
    args = '{"cmd": "ls"}' if name == "exec" else '{"city": "Paris"}'
    text = f"{SB}{k2call(raw, args)}{SE}"
    k2(chunked, text, ParsedMessage(None, None, (ToolCall(cid, name, args),)), tools=tools, base=7)


def test_b03_k3(chunked):
    text = k3tools('<|open|>call index="1"<|sep|><|open|>argument key="x" type="string"<|sep|>y<|close|>argument<|sep|>'
                   '<|close|>call<|sep|>', k3call("get_weather", ("city", "string", "Paris"), index="abc")) + K3_END
    k3(chunked, "<|close|>response<|sep|>" + text, ParsedMessage(None, None, (PARIS,)))


# B4: ids the server mints are Kimi ids with the conversation-global counter.
def test_b04_k2(goldens):
    prompt = K25.render(goldens["conversations"]["C"], goldens["tools"])
    oslo = k2call("chatcmpl-tool-9f8e", '{"city": "Oslo"}')
    got = K25.new_parser(prompt, goldens["tools"]).parse(f"ok</think>{SB}{oslo}{SE}")
    assert got.tool_calls[0].id == "functions.get_weather:2" == mint_tool_call_id("get_weather", prompt.next_call_index)
    with pytest.raises(ValueError):
        mint_tool_call_id("", 0)


def test_b04_k3(goldens):
    prompt = K3.render(goldens["conversations"]["C"], goldens["tools"])
    text = "x<|close|>think<|sep|>" + k3tools(k3call("get_weather", ("city", "string", "Oslo")),
                                               k3call("get_weather", ("city", "string", "Rome"))) + K3_END
    got = K3.new_parser(prompt, goldens["tools"]).parse(text)
    assert [c.id for c in got.tool_calls] == ["functions.get_weather:2", "functions.get_weather:3"]


# B5: history ids are normalised with a global index (K2); K3 never renders ids and matches
# results by opaque ids.
def test_b05_k2():
    msgs = [{"role": "user", "content": "q"}]
    for turn in range(3):
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "search:0", "type": "function", "function": {"name": "search", "arguments": "{}"}},
            {"id": f"call_{turn}", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": "f"},
            {"role": "tool", "tool_call_id": "search:0", "content": "s"}]
    prompt = K25.render(msgs)
    text = prompt.text()
    for n in range(6):
        name = "search" if n % 2 == 0 else "fetch"
        assert f"{CB}functions.{name}:{n}{AB}" in text
        assert f"## Return of functions.{name}:{n}\n" in text
    ids = re.findall(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>", text)
    returns = re.findall(r"## Return of (.*?)\n", text)
    assert ids == [f"functions.{'search' if n % 2 == 0 else 'fetch'}:{n}" for n in range(6)]
    assert returns == [ids[n ^ 1] for n in range(6)]
    assert prompt.next_call_index == 6


def test_b05_k3():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "search:0", "type": "function", "function": {"name": "search", "arguments": "{}"}},
                {"id": "call_x", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_x", "content": "f"},
            {"role": "tool", "tool_call_id": "search:0", "content": "s"}]
    text = K3.render(msgs, None, ChatOptions(thinking=False)).text()
    assert "search:0" not in text and "call_x" not in text
    assert text.index('tool="search" index="1"<|sep|>s') < text.index('tool="fetch" index="2"<|sep|>f')


# B6: arguments never run across a call boundary.
def test_b06_k2(chunked):
    a1, a2 = '{"cmd": "echo }"}', '{"city": "Paris"}'
    text = f"{SB}{k2call('functions.exec:0', a1)}{k2call('functions.get_weather:1', a2)}{SE}"
    k2(chunked, text, ParsedMessage(None, None, (ToolCall("functions.exec:0", "exec", a1),
                                                 ToolCall("functions.get_weather:1", "get_weather", a2))))
    text = f"{SB}{CB}functions.exec:0{AB}{{\"cmd\": \"ls\"{k2call('functions.get_weather:1', a2)}{SE}"
    k2(chunked, text, ParsedMessage(None, None, (ToolCall("functions.exec:0", "exec", '{"cmd": "ls"'),
                                                 ToolCall("functions.get_weather:1", "get_weather", a2))))


def test_b06_k3(chunked):
    unclosed = '<|open|>call tool="exec" index="1"<|sep|><|open|>argument key="cmd" type="string"<|sep|>ls'
    text = "<|close|>response<|sep|>" + k3tools(unclosed + k3call("get_weather", ("city", "string", "Paris"))) + K3_END
    k3(chunked, text, ParsedMessage(None, None, (ToolCall("functions.exec:0", "exec", '{"cmd": "ls"}'),
                                                 ToolCall("functions.get_weather:1", "get_weather", '{"city": "Paris"}'))))


# B7: the last argument fragment survives a call end and section end in the same chunk.
def test_b07_k2(chunked):
    head = f"{SB}{CB}functions.get_weather:0{AB}" + '{"city": '
    got = chunked.stream(lambda: K2Parser(reasoning=False), [head, f'"Paris"}}{CE}{SE}'])
    from k3serve.chat.parsers import collect
    assert collect(got) == ParsedMessage(None, None, (PARIS,))


def test_b07_k3(chunked):
    head = '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Par'
    got = chunked.stream(lambda: K3Parser(thinking=False),
                         [head, "is<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>" + K3_END])
    from k3serve.chat.parsers import collect
    assert collect(got) == ParsedMessage(None, None, (PARIS,))


# B8: no state survives between requests; a finished parser refuses more input.
@pytest.mark.parametrize("fmt,partial,full", [
    (K25, f"x</think>{SB}{CB}functions.get_weather:0{AB}" + '{"ci', f"y</think>hello"),
    (K3, 'x<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>',
     "y<|close|>think<|sep|><|open|>response<|sep|>hello<|close|>response<|sep|>"),
])
def test_b08(fmt, partial, full):
    prompt = fmt.render([{"role": "user", "content": "q"}], [WEATHER])
    first = fmt.new_parser(prompt, [WEATHER])
    first.feed(partial)
    second = fmt.new_parser(prompt, [WEATHER])
    assert second is not first and second.parse(full) == ParsedMessage("y", "hello")
    first.finish()
    with pytest.raises(ValueError):
        first.feed("more")
    with pytest.raises(ValueError):
        first.finish()


# B9: whitespace and structure after a call started are not content.
def test_b09_k2(chunked):
    call = k2call("functions.get_weather:0", " " + PARIS_ARGS + " ")
    text = f"{SB}\n {call}\n\n{SE}\n  \n"
    k2(chunked, text, ParsedMessage(None, None, (PARIS,)))


def test_b09_k3(chunked):
    text = "<|close|>response<|sep|>\n" + k3tools("\n " + k3call("get_weather", ("city", "string", "Paris")) + "\n") + "\n " + K3_END
    k3(chunked, text, ParsedMessage(None, None, (PARIS,)))


# B10: a call is not closed because its JSON looks complete; only the end marker closes it.
def test_b10_k2(chunked):
    args = '{"city": "Paris"} {"unit": "c"}'
    text = f"{SB}{k2call('functions.get_weather:0', args)}{SE}"
    k2(chunked, text, ParsedMessage(None, None, (ToolCall("functions.get_weather:0", "get_weather", args),)))


def test_b10_k3(chunked):
    text = "<|close|>response<|sep|>" + k3tools(k3call("exec", ("cmd", "object", '{"a": 1} trailing'))) + K3_END
    k3(chunked, text, ParsedMessage(None, None, (ToolCall("functions.exec:0", "exec",
                                                          json.dumps({"cmd": '{"a": 1} trailing'})),)))


# B11: marker spelling variants (K2 singular section marker; K3 `json` argument block).
def test_b11_k2(chunked):
    text = f"<|tool_call_section_begin|>{PARIS_K2}<|tool_call_section_end|>"
    k2(chunked, text, ParsedMessage(None, None, (PARIS,)))


def test_b11_k3(chunked):
    call = '<|open|>call tool="get_weather" index="1"<|sep|><|open|>json type="object"<|sep|>{"city":"Paris"}<|close|>json<|sep|><|close|>call<|sep|>'
    k3(chunked, "<|close|>response<|sep|>" + k3tools(call) + K3_END, ParsedMessage(None, None, (PARIS,)))


# B12: hallucinated names and schema-invalid arguments are surfaced and flagged, not dropped.
def test_b12_k2():
    text = SB + k2call("functions.get_wether:0", "{}") + k2call("functions.get_weather:1", '{"town": 1}') + SE
    calls = K2Parser(reasoning=False, tools=TOOLS).parse(text).tool_calls
    assert [c.name for c in calls] == ["get_wether", "get_weather"]
    assert "not declared" in tool_call_error(calls[0], TOOLS)
    assert "schema" in tool_call_error(calls[1], TOOLS)
    assert tool_call_error(PARIS, TOOLS) is None


def test_b12_k3():
    text = "<|close|>response<|sep|>" + k3tools(k3call("get_wether"), k3call("get_weather", ("city", "number", "3"))) + K3_END
    calls = K3Parser(thinking=False, tools=TOOLS).parse(text).tool_calls
    assert [c.name for c in calls] == ["get_wether", "get_weather"]
    assert "not declared" in tool_call_error(calls[0], TOOLS)
    assert "schema" in tool_call_error(calls[1], TOOLS)


# B13: long arguments (hyphens, newlines, quotes) stream through intact.
LONG = "-".join(f'line {i} "q" \\ end-of-line' for i in range(1500)) + "\n" * 3 + "x"


def test_b13_k2(chunked):
    args = json.dumps({"cmd": LONG})
    text = "think " * 200 + "</think>" + "text-" * 300 + SB + k2call("functions.exec:12", args) + SE
    k2(chunked, text, ParsedMessage("think " * 200, "text-" * 300, (ToolCall("functions.exec:12", "exec", args),)),
       reasoning=True, every_split=False)


def test_b13_k3(chunked):
    text = "think " * 200 + "<|close|>think<|sep|><|open|>response<|sep|>" + "text-" * 300 + "<|close|>response<|sep|>"
    text += k3tools(k3call("exec", ("cmd", "string", LONG))) + K3_END
    k3(chunked, text, ParsedMessage("think " * 200, "text-" * 300, (ToolCall("functions.exec:0", "exec", json.dumps({"cmd": LONG}, ensure_ascii=False)),)),
       thinking=True, every_split=False)


# B14: the `(no content)` placeholder is not content; the same words inside real text are.
def test_b14_k2(chunked):
    text = f"r</think>(no content){SB}{PARIS_K2}{SE}"
    k2(chunked, text, ParsedMessage("r", None, (PARIS,)), reasoning=True)
    k2(chunked, "r</think>(no content) is what I saw", ParsedMessage("r", "(no content) is what I saw"), reasoning=True)


def test_b14_k3(chunked):
    text = "(no content)<|close|>response<|sep|>" + k3tools(k3call("get_weather", ("city", "string", "Paris"))) + K3_END
    k3(chunked, text, ParsedMessage(None, None, (PARIS,)))
    k3(chunked, "(no content)!<|close|>response<|sep|>" + K3_END, ParsedMessage(None, "(no content)!"))


# B15: the generation prompt is always added; empty text-part lists render as empty, never a repr.
@pytest.mark.parametrize("fmt,tail", [(K25, "<|im_assistant|>assistant<|im_middle|><think>"),
                                      (K2_INSTRUCT, "<|im_assistant|>assistant<|im_middle|>"),
                                      (K3, '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')])
def test_b15(fmt, tail):
    empty = [{"type": "text", "text": ""}]
    text = fmt.render([{"role": "system", "content": empty}, {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": empty}, {"role": "user", "content": "again"}]).text()
    assert text.endswith(tail)
    assert "'type'" not in text and "[{" not in text
    assert ChatOptions().add_generation_prompt


# B16: response_format with callable tools: rejected where the template cannot carry it (K2),
# rendered together with the tools for K3.
def test_b16_k2():
    rf = {"type": "json_object"}
    with pytest.raises(ValueError):
        K25.render([{"role": "user", "content": "q"}], [WEATHER], ChatOptions(response_format=rf))
    K25.render([{"role": "user", "content": "q"}], [WEATHER], ChatOptions(response_format=rf, tool_choice="none"))


def test_b16_k3():
    rf = {"type": "json_object"}
    text = K3.render([{"role": "user", "content": "q"}], [WEATHER], ChatOptions(response_format=rf, tool_choice="auto")).text()
    assert 'type="tool-declare"' in text and 'type="response-format"' in text


# B17: untyped or non-JSON values and odd attributes never raise; raw text is kept.
def test_b17_k3(chunked):
    text = "<|close|>response<|sep|>" + k3tools(k3call("exec", ("n", "number", "abc"), ("o", "object", "{bad"),
                                                         ("s", "mystery", "[1]"), index="first")) + K3_END
    args = json.dumps({"n": "abc", "o": "{bad", "s": [1]})
    k3(chunked, text, ParsedMessage(None, None, (ToolCall("functions.exec:0", "exec", args),)))


def test_b17_k2(chunked):
    text = f"{SB}{k2call('functions.exec:0', '{cmd: ls')}{SE}"
    k2(chunked, text, ParsedMessage(None, None, (ToolCall("functions.exec:0", "exec", "{cmd: ls"),)))


# B18: spaces a detokenizer put around special tokens do not break parsing.
def test_b18_k3(chunked):
    text = ("4 <|close|> think <|sep|> <|open|> response <|sep|>ok<|close|> response <|sep|> <|open|> tools <|sep|>"
            ' <|open|> call tool="get_weather" index="1" <|sep|> <|open|> argument key="city" type="string" <|sep|>Paris'
            "<|close|> argument <|sep|> <|close|> call <|sep|> <|close|> tools <|sep|> <|close|> message <|sep|>")
    k3(chunked, text, ParsedMessage("4 ", "ok", (PARIS,)), thinking=True)


def test_b18_k2(chunked):
    text = f"r </think> ok {SB} {CB} functions.get_weather:0 {AB} {PARIS_ARGS} {CE} {SE} "
    k2(chunked, text, ParsedMessage("r ", " ok ", (PARIS,)), reasoning=True)


# B19: the tool parser runs even when the request declares no tools.
@pytest.mark.parametrize("fmt,text", [
    (K25, f"r</think>{SB}{PARIS_K2}{SE}"),
    (K3, "r<|close|>think<|sep|>" + k3tools(k3call("get_weather", ("city", "string", "Paris"))) + K3_END),
])
def test_b19(fmt, text, chunked):
    prompt = fmt.render([{"role": "user", "content": "again"}])
    k_markers = chunked.K3 if fmt is K3 else chunked.K2
    chunked.check(lambda: fmt.new_parser(prompt, None), text, ParsedMessage("r", None, (PARIS,)), k_markers)


# B20: degenerate reasoning passes through unchanged and is flagged for the verifier.
@pytest.mark.parametrize("fmt,close", [(K25, "</think>"), (K3, "<|close|>think<|sep|><|open|>response<|sep|>")])
def test_b20(fmt, close):
    bang = "!" * 500
    prompt = fmt.render([{"role": "user", "content": "q"}])
    got = fmt.new_parser(prompt).parse(bang + close + "fine")
    assert got.reasoning_content == bang and got.content == "fine"
    assert is_degenerate(got.reasoning_content) and not is_degenerate(got.content)
    assert not is_degenerate("a normal line of thought. " * 40) and not is_degenerate(" " * 200)
