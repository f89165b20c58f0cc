"""Grammars for structured outputs (llguidance Lark text), built per request from the chat family.

The grammar covers the whole assistant turn after the generation prompt, so the model is forced
through its own wire format: free reasoning when the prompt opened the think channel, then the
channel markup, then the constrained JSON, then the end-of-message token. Special tokens are
written by id (`<[163588]>`), which is independent of the K2/K3 special-token names.

    json_grammar(fmt, prompt, schema)            # response_format json_object / json_schema
    tool_call_grammar(fmt, prompt, tools)        # tool_choice required / named: exactly one call
    strict_tools_grammar(prompt, tools)          # K3, tool_choice auto, every function strict: an answer
                                                 # or calls whose arguments follow their schemas
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from k3serve.chat import ChatFormat, Prompt
from k3serve.chat.k3 import escape_attr
from k3serve.chat.parsers import mint_tool_call_id

# K3 XTML markers and the shared end-of-message id
OPEN, CLOSE, SEP, EOM = "<[163587]>", "<[163588]>", "<[163589]>", "<[163586]>"
# K2 family markers
SECTION_BEGIN, SECTION_END = "<[163595]>", "<[163596]>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<[163597]>", "<[163598]>", "<[163599]>"
THINK_OPEN, THINK_CLOSE = "<[163606]>", "<[163607]>"

_COMPACT = {"whitespace_flexible": False}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(name: str, schema: Mapping[str, Any] | None, *, lenient: bool = False) -> str:
    """A Lark rule holding a JSON schema; compact separators (KVV: no newline or tab in the answer)."""
    body = dict(schema) if schema else {"type": "object"}
    body["x-guidance"] = {**_COMPACT, **({"lenient": True} if lenient else {})}
    return f"{name}: %json {json.dumps(body, ensure_ascii=False)}\n"


def _k3_head(prompt: Prompt) -> str:
    """From the generation prompt to the inside of the response channel."""
    if prompt.thinking:
        return f'THINK {CLOSE} "think" {SEP} {OPEN} "response" {SEP}'
    return ""


def _k2_head(fmt: ChatFormat, prompt: Prompt) -> str:
    if prompt.thinking:
        # K2.5 opened <think> in the prompt; K2-Thinking's model opens it itself.
        opener = "" if fmt.k2_style is not None and fmt.k2_style.think == "prompt" else f"{THINK_OPEN} "
        return f"{opener}THINK {THINK_CLOSE}"
    return ""


_THINK_RULE = "THINK: /(?s:.*)/\n"


def json_grammar(fmt: ChatFormat, prompt: Prompt, schema: Mapping[str, Any] | None, *, strict: bool = True) -> str:
    """The assistant turn whose content is one JSON value of `schema` (None: any JSON object)."""
    if fmt.is_k3:
        start = f'start: {_k3_head(prompt)} answer {CLOSE} "response" {SEP} {CLOSE} "message" {SEP} {EOM}\n'
    else:
        start = f"start: {_k2_head(fmt, prompt)} answer {EOM}\n"
    return start + _json_rule("answer", schema, lenient=not strict) + _THINK_RULE


def _tool_functions(tools: Sequence[Mapping[str, Any]], name: str | None) -> list[Mapping[str, Any]]:
    fns = [t["function"] for t in tools if t.get("type") == "function" and isinstance(t.get("function"), Mapping)]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    if not fns:
        raise ValueError("tool_choice: no declared tool to call")
    return fns


def tool_call_grammar(fmt: ChatFormat, prompt: Prompt, tools: Sequence[Mapping[str, Any]],
                      name: str | None = None) -> str:
    """Exactly one call to `name` (or to any declared tool), arguments valid for its parameters.
    K2 ids are minted `functions.<name>:<n>` with the conversation-global n (B4)."""
    fns = _tool_functions(tools, name)
    rules, alts = [], []
    for k, fn in enumerate(fns):
        fname = fn["name"]
        if fmt.is_k3:
            head, block = _lit(f'call tool="{fname}" index="1"'), _lit('json type="object"')
            alts.append(f'{OPEN} {head} {SEP} {OPEN} {block} {SEP} args{k} {CLOSE} "json" {SEP} {CLOSE} "call" {SEP}')
        else:
            call_id = mint_tool_call_id(fname, prompt.next_call_index)
            alts.append(f"{CALL_BEGIN} {_lit(call_id)} {ARG_BEGIN} args{k} {CALL_END}")
        rules.append(_json_rule(f"args{k}", fn.get("parameters"), lenient=fn.get("strict") is False))
    call = "call: " + " | ".join(alts) + "\n"
    if fmt.is_k3:
        start = (f'start: {_k3_head(prompt)} {CLOSE} "response" {SEP} {OPEN} "tools" {SEP} call '
                 f'{CLOSE} "tools" {SEP} {CLOSE} "message" {SEP} {EOM}\n')
    else:
        start = f"start: {_k2_head(fmt, prompt)} {SECTION_BEGIN} call {SECTION_END} {EOM}\n"
    return start + call + "".join(rules) + _THINK_RULE


_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # the K3 writer's json.dumps
_XTML_TYPES = ("string", "number", "boolean", "null", "object", "array")
_XTML = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null", "object": "object",
         "array": "array"}  # JSON schema type -> the K3 writer's type attribute for such a value
_QUOTE = '"\\""'  # a Lark literal holding one double quote
_STRICT_TERMINALS = "TEXT: /(?s:.*)/\nIDX: /[1-9][0-9]{0,3}/\n"


def _argument(rule: str, key: str, schema: Any) -> str:
    """One K3 `argument` element: the type attribute the writer gives such a value, then the value. Strings
    are raw text (an enum: one of its values; min/maxLength in characters; a pattern is not enforced, as
    MFJS has none); every other type is the writer's `json.dumps` of a value valid for the schema."""
    schema = schema if isinstance(schema, Mapping) else {}
    kind = schema.get("type") or ("object" if "properties" in schema else None)
    kind = kind if isinstance(kind, str) else None  # a list of types is a union
    enum = schema.get("enum")
    extra = ""
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) and kind in (None, "string"):
        xtml, value = _lit("string"), " | ".join(_lit(v) for v in enum)
    elif kind == "string":
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        lo, hi = (lo if isinstance(lo, int) else None), (hi if isinstance(hi, int) else None)
        xtml, value = _lit("string"), "TEXT" if lo is None and hi is None else f"/(?s:.{{{lo or 0},{'' if hi is None else hi}}})/"
    elif kind in _XTML:
        xtml, value = _lit(_XTML[kind]), f"{rule}_v"
        extra = f"{rule}_v: %json {json.dumps({**schema, 'x-guidance': _SPACED}, ensure_ascii=False)}\n"
    else:  # a union or an untyped schema: any K3 type, the value kept as written
        xtml, value = "(" + " | ".join(_lit(t) for t in _XTML_TYPES) + ")", "TEXT"
    opening = 'argument key="' + escape_attr(key) + '" type="'
    head = f"{_lit(opening)} {xtml} {_QUOTE}"
    return f'{rule}: {OPEN} {head} {SEP} ({value}) {CLOSE} "argument" {SEP}\n' + extra


def strict_tools_grammar(prompt: Prompt, tools: Sequence[Mapping[str, Any]], one_call: bool = False) -> str:
    """K3 turn for `tool_choice: auto` when every declared function is `strict` (OpenAI semantics: calls
    adhere to the function's schema): free reasoning and answer text, then either no tools section or
    calls to declared functions only, each writing its schema's properties in declared order (required
    ones always, the others optionally) with values of their type."""
    fns = _tool_functions(tools, None)
    rules, alts = [], []
    for k, fn in enumerate(fns):
        params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
        props = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
        listed = params.get("required")
        required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
        parts = []
        for j, (key, sub) in enumerate(props.items()):
            rules.append(_argument(f"a{k}_{j}", key, sub))
            parts.append(f"a{k}_{j}" if key in required else f"a{k}_{j}?")
        head = _lit(f'call tool="{escape_attr(str(fn.get("name")))}" index="')
        alts.append(f'{OPEN} {head} IDX {_QUOTE} {SEP} {" ".join(parts)} {CLOSE} "call" {SEP}')
    calls = "call" if one_call else "call+"
    start = (f'start: {_k3_head(prompt)} TEXT {CLOSE} "response" {SEP} tools? {CLOSE} "message" {SEP} {EOM}\n'
             f'tools: {OPEN} "tools" {SEP} {calls} {CLOSE} "tools" {SEP}\n')
    return start + "call: " + " | ".join(alts) + "\n" + "".join(rules) + _STRICT_TERMINALS + _THINK_RULE


def all_strict(tools: Sequence[Mapping[str, Any]]) -> bool:
    fns = [t.get("function") for t in tools if t.get("type") == "function"]
    return bool(fns) and all(isinstance(f, Mapping) and f.get("strict") is True for f in fns)


MAX_SCHEMA_NODES = 20_000  # JSON values in one schema; compiling and rendering cost grows with it


def check_schema_size(schema: Any, field: str) -> None:
    """400 (naming `field`) for a schema of more than MAX_SCHEMA_NODES values. Iterative, like the body's nesting
    check (`protocol.nesting_error`), which already bounds its depth."""
    stack, seen = [schema], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > MAX_SCHEMA_NODES:
            raise ValueError(f"{field}: the schema has more than {MAX_SCHEMA_NODES} values")
        if isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def check_grammar(grammar: str) -> None:
    """Reject grammars llguidance cannot compile (e.g. an unsupported schema keyword) as bad input."""
    error = _grammar_error(grammar)
    if error is not None:
        raise ValueError(f"the schema cannot be enforced: {error}")


@functools.lru_cache(maxsize=512)
def _grammar_error(grammar: str) -> str | None:
    # cached: validation takes ~1-2 ms on the event loop, and clients repeat the same schema / tool set
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "invalid grammar") if is_error else None
