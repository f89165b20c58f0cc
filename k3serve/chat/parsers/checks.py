"""Output checks the server and the verifier apply after parsing: a tool call must name a
declared tool and carry arguments valid for its schema (K2VV's schema accuracy; B12), and a
reasoning or content text made of one repeated character is flagged as degenerate (B20)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema

from k3serve.chat.parsers.deltas import ToolCall


def tool_call_error(call: ToolCall, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """Why `call` would fail K2VV's schema check, or None when it passes."""
    by_name = {t["function"]["name"]: t["function"] for t in tools if t.get("function")}
    fn = by_name.get(call.name)
    if fn is None:
        return f"tool {call.name!r} is not declared"
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        return f"arguments of {call.name!r} are not JSON: {e.msg}"
    try:
        jsonschema.validate(args, fn.get("parameters") or {"type": "object"})
    except jsonschema.ValidationError as e:
        return f"arguments of {call.name!r} do not match its schema: {e.message}"
    except jsonschema.SchemaError as e:
        return f"schema of {call.name!r} is invalid: {e.message}"
    return None


def is_degenerate(text: str, *, min_run: int = 64) -> bool:
    """True when the text contains a run of at least `min_run` copies of one non-space character
    (the `!!!!…` reasoning of a broken engine or quantization)."""
    run, last = 0, ""
    for ch in text:
        run = run + 1 if ch == last else 1
        last = ch
        if run >= min_run and not ch.isspace():
            return True
    return False
