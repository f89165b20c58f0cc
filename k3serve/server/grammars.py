"""Grammars for structured outputs (llguidance Lark text), built per request from the chat family.

The grammar covers the whole assistant turn after the generation prompt, so the model is forced
through its own wire format: free reasoning when the prompt opened the think channel, then the
channel markup, then the constrained JSON, then the end-of-message token. Special tokens are
written by id (`<[163588]>`), which is independent of the K2/K3 special-token names.

    json_grammar(fmt, prompt, schema)            # response_format json_object / json_schema
    tool_call_grammar(fmt, prompt, tools)        # tool_choice required / named: exactly one call
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from k3serve.server.chat import ChatFormat, Prompt
from k3serve.server.chat.parsers import mint_tool_call_id

# K3 XTML markers and the shared end-of-message id
OPEN, CLOSE, SEP, EOM = "<[163587]>", "<[163588]>", "<[163589]>", "<[163586]>"
# K2 family markers
SECTION_BEGIN, SECTION_END = "<[163595]>", "<[163596]>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<[163597]>", "<[163598]>", "<[163599]>"
THINK_OPEN, THINK_CLOSE = "<[163606]>", "<[163607]>"
MIN_VOCAB = 163840  # grammars name the Kimi special ids; smaller vocabularies cannot hold them

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
