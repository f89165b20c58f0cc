"""Grammars without a model: random walks through llguidance's masks over the real Kimi vocabulary
must always give a turn the family's parser reads back as a valid tool call / JSON answer."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from k3serve.chat import K2_INSTRUCT, K2_THINKING, K3, K25, ChatOptions
from k3serve.engine.guided import kimi_lltokenizer
from k3serve.server.grammars import check_grammar, json_grammar, tool_call_grammar

SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "s": {"type": "string", "maxLength": 4},
    "o": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
          "additionalProperties": False},
    "e": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 2}},
    "required": ["a", "s", "o", "e"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}}]
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def lltok():
    return kimi_lltokenizer(163840, 163586)


@pytest.fixture(scope="module")
def tok():
    from k3serve.tokenizer import Tokenizer

    return {"k3": Tokenizer.kimi("k3"), "k2": Tokenizer.kimi("k2")}


def walk(lltok, grammar: str, seed: int, think_tokens: int = 3) -> list[int]:
    """Sample uniformly among allowed tokens; leave free reasoning after `think_tokens` by taking
    the smallest allowed special id (the channel close) as soon as it is allowed."""
    import llguidance

    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for step in range(400):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:163840]
        allowed = np.flatnonzero(bits)
        special = allowed[allowed >= 163584]
        t = int(special[0]) if step >= think_tokens and len(special) else int(rng.choice(allowed))
        out.append(t)
        assert m.consume_token(t), m.get_error()
        if m.is_stopped():
            return out
    raise AssertionError("grammar did not finish")


FORMATS = [(K3, False), (K3, True), (K25, False), (K25, True), (K2_INSTRUCT, False), (K2_THINKING, True)]


@pytest.mark.parametrize("fmt,thinking", FORMATS, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_tool_call_parses_and_validates(lltok, tok, fmt, thinking, seed):
    prompt = fmt.render(USER, TOOLS, ChatOptions(thinking=thinking, tool_choice="required"))
    grammar = tool_call_grammar(fmt, prompt, TOOLS, "f")
    check_grammar(grammar)
    ids = walk(lltok, grammar, seed)
    assert ids[-1] == 163586
    text = tok["k3" if fmt.is_k3 else "k2"].decode(ids[:-1])
    msg = fmt.new_parser(prompt, TOOLS).parse(text)
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].name == "f" and msg.content is None
    jsonschema.validate(json.loads(msg.tool_calls[0].arguments), SCHEMA)
    if not fmt.is_k3:
        assert msg.tool_calls[0].id == "functions.f:0"  # Kimi ids, never random ones (B4)


@pytest.mark.parametrize("fmt,thinking", FORMATS, ids=lambda v: getattr(v, "name", str(v)))
def test_json_schema_answer(lltok, tok, fmt, thinking):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    prompt = fmt.render(USER, None, ChatOptions(thinking=thinking, response_format=rf))
    ids = walk(lltok, json_grammar(fmt, prompt, SCHEMA), seed=3)
    text = tok["k3" if fmt.is_k3 else "k2"].decode(ids[:-1])
    msg = fmt.new_parser(prompt).parse(text)
    assert "\n" not in msg.content and "\t" not in msg.content
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert (msg.reasoning_content is not None) == thinking


def test_bad_schema_is_a_value_error():
    with pytest.raises(ValueError, match="cannot be enforced"):
        check_grammar(json_grammar(K3, K3.render(USER), {"type": "string", "pattern": "(((("}))


def test_guide_applies_packed_mask_and_bias():
    """`Guide.apply`: tokens whose bit is clear become -inf, biases add, an all-zero mask leaves the row."""
    from concurrent.futures import Future

    import numpy as np
    import torch

    from k3serve.engine.guided import Guide

    V = 77  # not a multiple of 32: the packed mask has tail bits past the vocabulary
    allowed = [0, 5, 31, 32, 76]
    words = np.zeros((V + 31) // 32, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    words[-1] |= np.uint32(1) << np.uint32(31)  # a stray bit beyond V must not matter

    def run(mask_bytes: bytes) -> torch.Tensor:
        g = Guide(None, {5: 2.0, 6: 1.0}, pool=None)
        fut: Future = Future()
        fut.set_result(mask_bytes)
        g._mask = fut
        row = torch.zeros(V)
        g.apply(row)
        return row

    row = run(words.tobytes())
    assert torch.isfinite(row).nonzero().flatten().tolist() == allowed
    assert row[5] == 2.0 and row[0] == 0.0
    empty = run(np.zeros_like(words).tobytes())
    assert torch.isfinite(empty).all() and empty[6] == 1.0


def test_guides_sharing_a_grammar_are_independent():
    """Guides of one grammar come from one compiled template (copied): advancing one leaves the other at
    the start, and the template is reused rather than compiled again."""
    from k3serve.engine.guided import GuidedDecoding

    gd = GuidedDecoding(163840, 163586, enabled=True)
    grammar = json_grammar(K3, K3.render(USER), SCHEMA)
    a, b = gd.processor(grammar, {}), gd.processor(grammar, {})
    assert len(gd._templates) == 1 and a.matcher is not b.matcher
    start = b.matcher.compute_bitmask()
    text = a.matcher.compute_bitmask()
    assert start == text
    for t in walk(gd._tokenizer, grammar, seed=0)[:-1]:  # a whole answer, all but the last token
        assert a.matcher.consume_token(t)
    assert a.matcher.compute_bitmask() != start
    assert b.matcher.compute_bitmask() == start
    assert gd.processor(grammar, {}).matcher.compute_bitmask() == start


STRICT_SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "s": {"type": "string"},
    "u": {"type": "string", "enum": ["metric", "imperial"]},
    "short": {"type": "string", "minLength": 2, "maxLength": 3},
    "o": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
          "additionalProperties": False},
    "e": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 2},
    "opt": {"type": "number"}},
    "required": ["a", "s", "u", "short", "o", "e"], "additionalProperties": False}
STRICT_TOOLS = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": STRICT_SCHEMA}},
                {"type": "function", "function": {"name": "g_2", "strict": True, "parameters": {
                    "type": "object", "properties": {}, "additionalProperties": False}}}]


def _matcher(lltok, grammar: str):
    import llguidance

    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strict_tools_walk_gives_schema_valid_calls(lltok, tok, thinking, seed):
    """Any path through the strict-tools grammar is a K3 turn whose calls name declared tools and whose
    arguments validate against their schemas (the walk always takes the tools section when offered; one call,
    as with `parallel_tool_calls: false`, since it would always open another)."""
    from k3serve.server.grammars import all_strict, strict_tools_grammar

    assert all_strict(STRICT_TOOLS) and not all_strict([*STRICT_TOOLS, TOOLS[0]])
    prompt = K3.render(USER, STRICT_TOOLS, ChatOptions(thinking=thinking))
    grammar = strict_tools_grammar(prompt, STRICT_TOOLS, one_call=True)
    check_grammar(grammar)
    ids = walk(lltok, grammar, seed)
    msg = K3.new_parser(prompt, STRICT_TOOLS).parse(tok["k3"].decode(ids[:-1]))
    assert len(msg.tool_calls) == 1
    schemas = {"f": STRICT_SCHEMA, "g_2": STRICT_TOOLS[1]["function"]["parameters"]}
    for call in msg.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def _k3_answer_ids(tok, tools, target, thinking: bool) -> tuple[object, list[int]]:
    """The generation prompt and the tokens of `target` as the K3 renderer writes it after that prompt."""
    opts = ChatOptions(thinking=thinking)
    prompt = K3.render(USER, tools, opts)
    head = prompt.token_segments()
    full = K3.render([*USER, target], tools, ChatOptions(thinking=thinking, add_generation_prompt=False))
    segs = full.token_segments()
    assert segs[:len(head)] == head
    return prompt, [int(t) for t in tok["k3"].encode_segments(segs[len(head):])]


@pytest.mark.parametrize("thinking", [False, True])
def test_strict_tools_accept_rendered_answers_and_reject_off_schema_calls(lltok, tok, thinking):
    """The grammar accepts what the K3 writer renders for valid calls (and for a plain answer), and stops
    a call to an undeclared tool, a repeated or skipped key, a wrong type attribute or an off-enum value."""
    from k3serve.server.grammars import strict_tools_grammar

    def call(name, args):
        return {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}

    good = {"a": 7, "s": "two words", "u": "metric", "short": "éé", "o": {"b": True}, "e": ["x", "yy"]}

    def accepted(target) -> bool:
        prompt, ids = _k3_answer_ids(tok, STRICT_TOOLS, {"role": "assistant", "reasoning_content": "r", **target},
                                     thinking)
        m = _matcher(lltok, strict_tools_grammar(prompt, STRICT_TOOLS))
        return all(m.consume_token(t) for t in ids) and m.is_stopped()

    assert accepted({"content": "No tool fits.", "tool_calls": []})
    assert accepted({"content": "", "tool_calls": [call("f", good)]})
    assert accepted({"content": "", "tool_calls": [call("f", {**good, "opt": 2.5}), call("g_2", {})]})
    assert not accepted({"content": "", "tool_calls": [call("h", good)]})  # undeclared tool
    assert not accepted({"content": "", "tool_calls": [call("f", {k: v for k, v in good.items() if k != "u"})]})
    assert not accepted({"content": "", "tool_calls": [call("f", {"a": 7, "s": "x", "s2": "y"})]})
    assert not accepted({"content": "", "tool_calls": [call("f", {**good, "a": "7"})]})  # type="string"
    assert not accepted({"content": "", "tool_calls": [call("f", {**good, "u": "kelvin"})]})
    assert not accepted({"content": "", "tool_calls": [call("f", {**good, "a": 100})]})  # above maximum
    assert not accepted({"content": "", "tool_calls": [call("f", {**good, "short": "abcd"})]})  # maxLength
    assert not accepted({"content": "", "tool_calls": [call("f", {**good, "short": "a"})]})  # minLength


def test_strict_tools_odd_schemas_compile_or_are_bad_input():
    """Unions (a list of types, anyOf), untyped properties and a malformed `required` give a grammar that
    compiles (any K3 type, the value as written); a sub-schema llguidance cannot enforce is a ValueError."""
    from k3serve.server.grammars import strict_tools_grammar

    odd = {"type": "object", "required": [{"x": 1}, "u"], "properties": {
        "u": {"type": ["string", "null"]}, "a": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "n": {}}}
    prompt = K3.render(USER, None, ChatOptions(thinking=False))
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": odd}}]
    check_grammar(strict_tools_grammar(prompt, tools))
    bad = {"type": "object", "properties": {"o": {"type": "object", "properties": {"s": {"type": "string",
                                                                                         "pattern": "(((("}}}}}
    with pytest.raises(ValueError, match="cannot be enforced"):
        check_grammar(strict_tools_grammar(prompt, [{"type": "function", "function": {
            "name": "f", "strict": True, "parameters": bad}}]))


def test_strict_tools_accept_every_gold_answer_of_the_training_tasks(lltok):
    """The default model's task answers (tool, choose, decline, follow-up) pass the grammar once their tools
    are declared strict: the grammar and the K3 writer agree on every argument type the data uses."""
    import random

    from k3serve.server.grammars import strict_tools_grammar
    from training import tasks
    from training.render import encode_sample, prompt_ids, request_options
    from training.tok import load_tokenizer

    tk = load_tokenizer()
    rng = random.Random(11)
    for kind in ("tool", "choose", "decline", "followup"):
        for _ in range(6):
            s = tasks.strict(tasks.make(kind, rng))
            ids, n = encode_sample(s, tk)
            assert ids[:n] == prompt_ids(s, tk)
            prompt = K3.render(s.messages, s.tools, request_options(s))
            m = _matcher(lltok, strict_tools_grammar(prompt, s.tools))
            assert all(m.consume_token(t) for t in ids[n:]), (kind, m.get_error())
            assert m.is_stopped()
