"""Tool-call ids and names: Kimi ids are `functions.<name>:<n>` with n conversation-global
(frontend.md §0.2). Models and clients also produce `name:0`, `call_<hex>`, `call00003`,
`functionsexec5` or UUIDs; those must resolve to a name without crashing or dropping the call."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_CANONICAL = re.compile(r"([\w.\-]+):(\d+)")


def mint_tool_call_id(name: str, n: int) -> str:
    """The id the server gives a call it generated or could not keep (also for tool_choice
    required/named paths, so the next turn's history stays in Kimi form)."""
    if not name or n < 0:
        raise ValueError(f"cannot mint a tool-call id from name={name!r}, n={n}")
    return f"functions.{name}:{n}"


def split_id(raw: str) -> tuple[str, int] | None:
    """`(name, n)` of `functions.<name>:<n>` or `<name>:<n>`, else None."""
    s = raw.strip()
    body = s[len("functions."):] if s.startswith("functions.") else s
    m = _CANONICAL.fullmatch(body)
    return (m[1], int(m[2])) if m else None


def name_from_id(raw: str, known: Sequence[str]) -> str | None:
    """Resolve a call's function name from its id; None when only the arguments can tell."""
    parsed = split_id(raw)
    if parsed is not None:
        name = parsed[0]
        if known and name not in known and name.rsplit(".", 1)[-1] in known:
            return name.rsplit(".", 1)[-1]
        return name
    inside = [k for k in known if k in raw]
    if inside:
        return max(inside, key=len)
    return None


def fallback_name(raw: str) -> str:
    """Last resort with no declared tools: the id without a `functions` prefix or index suffix."""
    s = re.sub(r"^functions\.?", "", raw.strip())
    s = re.sub(r"[:_\-]?\d+$", "", s)
    return s or raw.strip() or "unknown"


def name_from_arguments(arguments: str, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """The single declared tool whose parameters fit the argument keys (required ⊆ keys ⊆
    properties), else None."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict):
        return None
    fits = []
    for tool in tools:
        fn = tool.get("function") or {}
        params = fn.get("parameters") or {}
        props = set((params.get("properties") or {}).keys())
        required = set(params.get("required") or ())
        if required <= args.keys() and (not props or args.keys() <= props):
            fits.append(fn.get("name"))
    return fits[0] if len(fits) == 1 else None
