"""Synthetic K3 tasks: tool calls, tool choice, declining, JSON under a schema, long-context recall and
follow-ups that use tool results. Each ``make_*`` returns a ``Sample``: the OpenAI-style request (messages,
tools, thinking, response_format), the assistant message to learn, and what a correct answer must contain.

``score(sample, content, tool_calls)`` grades a parsed answer the same way for training-time checks, the
offline evaluation and the HTTP evaluation. Everything is drawn from a seeded ``random.Random``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from training import pools
# the offer and the decision sentences, re-exported: callers write ``tasks.decided``, ``tasks.draw_toolset``
from training.offer import (decided, decision_reasoning, decline_content, draw_toolset,  # noqa: F401
                                 object_twin, same_object)
# the styles, re-exported: callers write ``tasks.Style``, ``tasks.SHIPPED``
from training.styles import (FORMS, NOTHINKS, PLAIN, REASONINGS, RECALLS, SHIPPED,  # noqa: F401
                                  STYLED_KINDS, Style)

KINDS = ("tool", "choose", "decline", "json", "recall", "followup")
# training-only: plain copying, and key -> value lookup (find a key, read what follows it); every task needs both
WARMUP_KINDS = ("copy", "lookup")
# Most leaves a tool or choose request's arguments have (1..this, some nested): evaluations keep this; a run
# may train on more (``--tool-leaves``) so that the call does not learn to close after the usual count.
TOOL_LEAVES = 4
# A decline's request and offered tools have 1..this leaves. A run that widens tool requests widens these to the
# same range: with wider calls alone, a short request reads as a decline.
DECLINE_LEAVES = 3
EFFORTS = ("max", "max", "max", "high", "low")  # the K3 efforts, the server default (max) most often


@dataclass(frozen=True)
class Sample:
    kind: str
    messages: list[dict[str, Any]]
    target: dict[str, Any]  # the assistant message: content, reasoning_content, tool_calls
    expected: dict[str, Any]  # {"tool", "arguments"} | {"tool": None} | {"json"} | {"text"}
    tools: list[dict[str, Any]] | None = None
    thinking: bool = True
    effort: str | None = "max"
    response_format: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


Dumps = Callable[[Any], str]
TOOL_DUMPS: Dumps = partial(json.dumps, ensure_ascii=False)  # how the K3 renderer writes an argument value
JSON_DUMPS: Dumps = partial(json.dumps, ensure_ascii=False, separators=(",", ":"))  # JSON answers: compact


def _words(rng: random.Random, repeats: float = 0.0, twins: float = 0.0) -> list[str]:
    """An array leaf's 2-3 words. A ``repeats`` share of them (training only) write one word twice: drawn
    freely, ~3% of arrays do, too few to learn to end one (``["river","island","island"]`` goes on with
    ``"island"`` until max_tokens), where the token before the next item and before the closing ``"]`` is
    the same word. A ``twins`` share of those end in two equal words, as that array does (otherwise a
    quarter of the three-word ones do): the word before the last is copied over the last, so a three-word
    array whose copy went to the middle becomes one word three times (``["island","island","island"]``), the
    others ``["river","island","island"]``."""
    words = [rng.choice(pools.WORDS) for _ in range(rng.randint(2, 3))]
    if repeats and rng.random() < repeats:  # only when set, so a default run draws what it drew before
        later = rng.randrange(1, len(words))
        words[later] = words[rng.randrange(later)]
        if twins and rng.random() < twins:  # likewise: without it a run draws what --array-repeats alone drew
            words[-1] = words[-2]
    return words


def _leaf(rng: random.Random, repeats: float = 0.0, twins: float = 0.0) -> tuple[dict[str, Any], Any]:
    """(schema, value) for one leaf parameter (``repeats``, ``twins``: ``_words``)."""
    r = rng.random()
    if r < 0.35:
        return {"type": "string"}, pools.string_value(rng)
    if r < 0.6:
        return {"type": "integer"}, rng.randint(0, 9999)
    if r < 0.72:
        return {"type": "boolean"}, rng.random() < 0.5
    if r < 0.88:
        options = rng.choice(pools.ENUMS)
        return {"type": "string", "enum": list(options)}, rng.choice(options)
    return {"type": "array", "items": {"type": "string"}}, _words(rng, repeats, twins)


def make_schema(rng: random.Random, n_leaves: int, dumps: Dumps = TOOL_DUMPS, repeats: float = 0.0,
                twins: float = 0.0) -> tuple[dict[str, Any], dict[str, Any], list[tuple[str, str]]]:
    """An object schema with ``n_leaves`` uniquely named leaves, some grouped into one nested object.

    Returns (schema, value object, [(top-level key, written value)]). Each value is written in the user
    message exactly as the answer writes it (``dumps``: the K3 argument form for tool calls, compact JSON
    for JSON answers), so an answer value is a plain copy of a span of the request. Strings keep their
    double quotes: a quoted word is the same token in both places ('"Boston"' -> '"', 'Boston'), while a
    bare word would carry its leading space (' Boston', another id)."""
    keys = rng.sample(pools.KEYS, n_leaves + 1)
    props: dict[str, Any] = {}
    values: dict[str, Any] = {}
    nested = n_leaves >= 3 and rng.random() < 0.4
    group = keys.pop() if nested else None
    inner = rng.randint(2, min(3, n_leaves - 1)) if nested else 0
    sub_props: dict[str, Any] = {}
    sub_values: dict[str, Any] = {}
    for i, key in enumerate(keys[:n_leaves]):
        schema, value = _leaf(rng, repeats, twins)
        if i < inner:
            sub_props[key], sub_values[key] = schema, value
        else:
            props[key], values[key] = schema, value
    if group is not None:
        props = {group: {"type": "object", "properties": sub_props, "required": list(sub_props)}, **props}
        values = {group: sub_values, **values}
    mentions = [(k, dumps(v)) for k, v in values.items()]
    return {"type": "object", "properties": props, "required": list(props)}, values, mentions


def declare_tool(name: str, verb: str, obj: str, params: dict[str, Any]) -> dict[str, Any]:
    # The request's own words: " verb the obj" tokenizes the same in both, so finding the offered tool that
    # does what was asked is matching a span ("Verb the obj." shares no verb token with the request).
    desc = f"Use this to {verb} the {obj}."
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


def _mention_text(mentions: list[tuple[str, str]], form: str) -> str:
    # In the schema's order, which is the answer's order: the next key is then the one after the current
    # key in the request (a shuffled order made the model track which keys it had already written).
    if form == "lines":
        return "\n".join(f"{k}: {v}" for k, v in mentions)
    return "; ".join(f"{k} {v}" for k, v in mentions)


def write_request(rng: random.Random, verb: str, obj: str, mentions: list[tuple[str, str]], form: str) -> str:
    m = _mention_text(mentions, form)
    if form == "lines":
        return rng.choice((f"Please {verb} the {obj} with:\n{m}", f"I need you to {verb} the {obj}. Use:\n{m}",
                           f"{verb.capitalize()} the {obj}:\n{m}", f"Can you {verb} the {obj}?\n{m}"))
    return rng.choice((f"Please {verb} the {obj} with {m}.", f"I need you to {verb} the {obj}. Use {m}.",
                       f"{verb.capitalize()} the {obj}: {m}.", f"Can you {verb} the {obj}? {m}."))


def draw_effort(rng: random.Random, thinking: bool) -> str | None:
    return rng.choice(EFFORTS) if thinking else None


def tool_call(name: str, args: dict[str, Any], k: int = 1) -> dict[str, Any]:
    return {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def make_tool(rng: random.Random, held_out: bool, thinking: bool, n_tools: int | None = None,
              style: Style = PLAIN, leaves: int = TOOL_LEAVES, object_share: float = 0.0,
              repeats: float = 0.0, twins: float = 0.0) -> Sample:
    n = n_tools if n_tools is not None else 1
    tools = draw_toolset(rng, held_out, n)
    schemas = [make_schema(rng, rng.randint(1, leaves), repeats=repeats, twins=twins) for _ in tools]
    pick = rng.randrange(n)
    if n > 1 and object_share and rng.random() < object_share:
        other = rng.choice([i for i in range(n) if i != pick])
        tools[other] = object_twin(rng, held_out, tools[pick], tools)
    name, verb, obj = tools[pick]
    _, values, mentions = schemas[pick]
    decl = [declare_tool(t[0], t[1], t[2], s[0]) for t, s in zip(tools, schemas)]
    target = {**decided(verb, obj, name, True, thinking, style, [t[0] for t in tools]),
              "tool_calls": [tool_call(name, values)]}
    user = write_request(rng, verb, obj, mentions, style.form)
    return Sample("tool" if n == 1 else "choose", [{"role": "user", "content": user}],
                  target, {"tool": name, "arguments": values}, decl, thinking, draw_effort(rng, thinking))


def make_choose(rng: random.Random, held_out: bool, thinking: bool, style: Style = PLAIN,
                leaves: int = TOOL_LEAVES, object_share: float = 0.0, repeats: float = 0.0,
                twins: float = 0.0) -> Sample:
    """A call of one of 2-4 offered tools. ``object_share`` of them (training only) offer, beside the picked
    tool, one with its object and another verb (``share_road`` beside ``convert_road``): the same hard negative
    that ``make_decline``'s ``object_share`` asks for, so that its presence does not tell a decline apart."""
    return make_tool(rng, held_out, thinking, n_tools=rng.randint(2, 4), style=style, leaves=leaves,
                     object_share=object_share, repeats=repeats, twins=twins)


def make_decline(rng: random.Random, held_out: bool, thinking: bool, style: Style = PLAIN,
                 leaves: int = DECLINE_LEAVES, object_share: float = 0.0) -> Sample:
    """A request for a tool that is not offered. ``object_share`` of them (training only) ask for a tool that
    shares its object with an offered one: drawn as ``draw_toolset`` draws, one in ~8 does, and those are
    the declines a model misses (``The tool convert_road does that.`` with ``share_road`` offered)."""
    tools = draw_toolset(rng, held_out, rng.randint(2, 5))
    ask_name, verb, obj = tools.pop()  # asked for, then removed from the offer: a hard negative
    if object_share and rng.random() < object_share:
        ask_name, verb, obj = same_object(rng, held_out, tools)
    schemas = [make_schema(rng, rng.randint(1, leaves)) for _ in tools]
    _, _, mentions = make_schema(rng, rng.randint(1, leaves))
    decl = [declare_tool(t[0], t[1], t[2], s[0]) for t, s in zip(tools, schemas)]
    target = decided(verb, obj, ask_name, False, thinking, style, [t[0] for t in tools])
    user = write_request(rng, verb, obj, mentions, style.form)
    return Sample("decline", [{"role": "user", "content": user}], target, {"tool": None, "text": target["content"]},
                  decl, thinking, draw_effort(rng, thinking), meta={"asked": ask_name})


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with ``additionalProperties: false`` on every object, as OpenAI's strict structured outputs
    require: with it the server's grammar closes an object once its required members are written (without it
    a model that keeps adding members runs out of tokens inside the JSON)."""
    if schema.get("type") != "object":
        return schema
    props = {k: closed(v) for k, v in schema["properties"].items()}
    return {**schema, "properties": props, "additionalProperties": False}


def strict(s: Sample) -> Sample:
    """The same sample with its tools declared as OpenAI strict functions (``strict: true``, every object
    closed): the K3 render then shows ``"strict":true``, and the server constrains calls to the schemas."""
    if s.tools is None:
        return s
    tools = [{**t, "function": {**t["function"], "strict": True, "parameters": closed(t["function"]["parameters"])}}
             for t in s.tools]
    return replace(s, tools=tools)


def make_json(rng: random.Random, held_out: bool, thinking: bool, style: Style = PLAIN,
              repeats: float = 0.0, twins: float = 0.0) -> Sample:
    schema, values, mentions = make_schema(rng, rng.randint(2, 5), JSON_DUMPS, repeats, twins)
    schema = closed(schema)
    name, _, obj = pools.tool_name(rng, held_out)
    rf = {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}
    m = _mention_text(mentions, style.form)
    user = rng.choice((f"Give me the {obj} as JSON:\n{m}", f"Return JSON for this {obj}.\n{m}") if style.form == "lines"
                      else (f"Give me the {obj} as JSON: {m}.", f"Return JSON for this {obj}. {m}."))
    reasoning = f"I will fill {len(mentions)} fields from the message." if thinking else None
    content = json.dumps(values, ensure_ascii=False, separators=(",", ":"))
    target = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    return Sample("json", [{"role": "user", "content": user}], target, {"json": values}, None, thinking,
                  draw_effort(rng, thinking), rf)


def make_recall(rng: random.Random, held_out: bool, thinking: bool, records: int = 40,
                style: Style = PLAIN) -> Sample:
    """A list of ``records`` numbered lines (~13 tokens each); the asked one sits in the first quarter.
    Passages are lexicon words, none repeated in the list (``pools.passage``). ``style.recall`` sets how
    records are written and answered (``RECALLS``)."""
    labels = rng.sample(range(100, 1000), records)
    used: set[str] = set()
    lines = {lab: " ".join(pools.passage(rng, 8, used)) for lab in labels}
    pick = labels[rng.randrange(max(1, records // 4))]
    restate = style.recall == "restate"
    written = {lab: f"Record {lab} {text}" if restate else f"Record {lab}: \"{text}\"" for lab, text in lines.items()}
    doc = "\n".join(written[lab] for lab in labels)
    user = f"Here are the records.\n{doc}\nCopy record {pick} exactly."
    reasoning = f"I need record {pick}." if thinking else None
    content = written[pick] if restate else lines[pick]
    target = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    expected = {"text": lines[pick], "line": written[pick]} if restate else {"text": lines[pick]}
    return Sample("recall", [{"role": "user", "content": user}], target, expected, None, thinking,
                  draw_effort(rng, thinking), meta={"records": records})


def draw_result(rng: random.Random, schema: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A tool result (three keys the call did not use) and the key the user asks back."""
    result_keys = rng.sample([k for k in pools.KEYS if k not in schema["properties"]], 3)
    result = {k: _leaf(rng)[1] for k in result_keys}
    return result, rng.choice(result_keys)


def ask_back(request: str, ask: str, form: str) -> str:
    """The request, then asking for ``ask`` from the tool's result."""
    return request + f"\nThen tell me the {ask}." if form == "lines" else request[:-1] + f", then tell me the {ask}."


def answer_from(result: dict[str, Any], ask: str, thinking: bool) -> dict[str, Any]:
    answer = f"The {ask} is {json.dumps(result[ask], ensure_ascii=False)}."
    return {"role": "assistant", "content": answer,
            "reasoning_content": f"The tool returned the {ask}." if thinking else None}


def tool_message(result: dict[str, Any], k: int = 1) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{k}", "content": json.dumps(result, ensure_ascii=False)}


def make_followup(rng: random.Random, held_out: bool, thinking: bool, style: Style = PLAIN) -> Sample:
    name, verb, obj = pools.tool_name(rng, held_out)
    schema, values, mentions = make_schema(rng, rng.randint(1, 3))
    result, ask = draw_result(rng, schema)
    user = ask_back(write_request(rng, verb, obj, mentions, style.form), ask, style.form)
    messages = [{"role": "user", "content": user},
                {**decided(verb, obj, name, True, thinking, style, [name]), "tool_calls": [tool_call(name, values)]},
                tool_message(result)]
    target = answer_from(result, ask, thinking)
    return Sample("followup", messages, target, {"tool": None, "text": target["content"]},
                  [declare_tool(name, verb, obj, schema)], thinking, draw_effort(rng, thinking))


def make_copy(rng: random.Random, held_out: bool, thinking: bool, items: tuple[int, int] = (3, 24)) -> Sample:
    """Repeat a random run of pool words, names and numbers: the answer is only predictable by copying, so
    the softmax-attention layers learn to find a token's earlier occurrence and read what followed it."""
    words = [rng.choice(pools.WORDS) if rng.random() < 0.3 else rng.choice(pools.LEXICON) if rng.random() < 0.5 else
             rng.choice(pools.NAMES) if rng.random() < 0.5 else str(rng.randint(0, 9999))
             for _ in range(rng.randint(*items))]
    text = " ".join(words)
    user = rng.choice((f'Repeat exactly: "{text}"', f'Copy this: "{text}"', f'Say it back: "{text}"'))
    target = {"role": "assistant", "content": text, "reasoning_content": "I will repeat it." if thinking else None}
    return Sample("copy", [{"role": "user", "content": user}], target, {"text": text}, None, thinking,
                  draw_effort(rng, thinking))


def make_lookup(rng: random.Random, held_out: bool, thinking: bool, pairs: tuple[int, int] = (2, 6),
                objects: float = 0.0, style: Style = PLAIN) -> Sample:
    """Read values back from a short ``key value; ...`` list: the lookup that tool arguments, JSON fields
    and follow-ups make (find the key in the request, copy what follows it), without their format.

    Most ask one key as a word (``What is the height?``, answered by the value). An ``objects`` fraction
    name 1-3 keys in quotes, in an order of their own, and are answered as the argument object
    (``{"width": "ability", "height": "x"}``): a quoted key is the token a call writes (``height``), not
    the request's (`` height``), so these teach matching the two forms and finding a value by its key
    rather than by its place in the list (a call that finds a value by place takes a neighbour's).
    With ``objects`` 0 no extra random draw is made: the samples of the runs before it."""
    schema, values, mentions = make_schema(rng, rng.randint(*pairs))
    mentions = [(k, v) for k, v in mentions if not isinstance(values[k], dict)] or mentions[-1:]
    m = _mention_text(mentions, style.form)
    listed = f"Values:\n{m}\n" if style.form == "lines" else f"Values: {m}. "
    if not (objects and rng.random() < objects):
        key, written = rng.choice(mentions)
        # asked with the key's token as listed: bare (quoted) for lines, spaced inline
        ask = f'What is "{key}"?' if style.form == "lines" else f"What is the {key}?"
        user, content, why = listed + ask, written, f"I need the {key}."
    else:
        asked = [k for k, _ in rng.sample(mentions, rng.randint(1, min(3, len(mentions))))]
        content = TOOL_DUMPS({k: values[k] for k in asked})
        user = f"{listed}Give {', '.join(TOOL_DUMPS(k) for k in asked)} as an object."
        why = f"I need {len(asked)} values."
    target = {"role": "assistant", "content": content, "reasoning_content": why if thinking else None}
    return Sample("lookup", [{"role": "user", "content": user}], target, {"text": content}, None, thinking,
                  draw_effort(rng, thinking))


MAKERS = {"copy": make_copy, "lookup": make_lookup, "tool": make_tool, "choose": make_choose, "decline": make_decline,
          "json": make_json,
          "recall": make_recall, "followup": make_followup}


def make(kind: str, rng: random.Random, *, held_out: bool = False, thinking: bool | None = None,
         style: Style = PLAIN, **kwargs: Any) -> Sample:
    """A sample of ``kind`` written in ``style`` (kinds it does not concern ignore it)."""
    if kind not in MAKERS:
        raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(MAKERS)}")
    if kind in STYLED_KINDS:
        kwargs["style"] = style
    if thinking is None:
        thinking = rng.random() < 0.6
    return MAKERS[kind](rng, held_out, thinking, **kwargs)


def score(sample: Sample, content: str, tool_calls: list[dict[str, Any]]) -> bool:
    """Did a parsed answer (content, OpenAI tool_calls) solve the task exactly?"""
    exp = sample.expected
    if "arguments" in exp:
        if len(tool_calls) != 1 or tool_calls[0]["function"]["name"] != exp["tool"]:
            return False
        try:
            return json.loads(tool_calls[0]["function"]["arguments"] or "{}") == exp["arguments"]
        except json.JSONDecodeError:
            return False
    if "json" in exp:
        try:
            return not tool_calls and json.loads(content) == exp["json"]
        except json.JSONDecodeError:
            return False
    if sample.kind == "decline":
        return not tool_calls
    # a recall answer may restate the record's line (style "restate") or give its passage alone
    return not tool_calls and content.strip() in (exp["text"], exp.get("line"))
