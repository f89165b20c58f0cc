"""Validated chat-request pieces the renderers consume: options, tools, tool_choice,
response_format and message shapes. Every malformed input raises one ValueError naming the field
(the server maps it to HTTP 400, as Moonshot's verifier expects; frontend.md §3.2)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EFFORTS = ("low", "high", "max")
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,255}")
ROLES = ("system", "user", "assistant", "tool")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")


@dataclass(frozen=True)
class ChatOptions:
    """Per-request rendering switches. `effort` applies to K3 thinking mode only (None = no
    effort block); `image_sizes` lists the original W×H of the request's images in order."""

    thinking: bool = True
    effort: str | None = "max"
    tool_choice: str | Mapping[str, Any] | None = None
    response_format: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    image_sizes: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.effort is not None and self.effort not in EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {self.effort!r}")
        check_tool_choice(self.tool_choice)
        check_response_format(self.response_format)
        for size in self.image_sizes:
            if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
                raise ValueError(f"image size must be two positive ints, got {size!r}")

    @property
    def response_format_type(self) -> str:
        return "text" if self.response_format is None else self.response_format["type"]

    @property
    def response_schema(self) -> Any:
        return self.response_format["json_schema"]["schema"] if self.response_format_type == "json_schema" else None


def check_tool_choice(tool_choice: Any) -> None:
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if tool_choice.get("type") == "function" and isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            return
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {tool_choice!r}")


def named_tool(tool_choice: Any) -> str | None:
    return tool_choice["function"]["name"] if isinstance(tool_choice, Mapping) else None


def check_response_format(rf: Any) -> None:
    if rf is None:
        return
    if not isinstance(rf, Mapping) or rf.get("type") not in RESPONSE_FORMATS:
        raise ValueError(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}")
    if rf["type"] != "json_schema":
        return
    js = rf.get("json_schema")
    if not isinstance(js, Mapping):
        raise ValueError("response_format.json_schema must be an object")
    if not isinstance(js.get("name"), str) or not SCHEMA_NAME.fullmatch(js["name"]):
        raise ValueError("response_format.json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$")
    if not isinstance(js.get("schema"), Mapping):
        raise ValueError("response_format.json_schema.schema must be an object")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise ValueError("response_format.json_schema.strict must be a boolean")


def check_tools(tools: Any, where: str, seen: set[str]) -> list[dict[str, Any]]:
    """Validate an OpenAI `tools` list; adds names to `seen` and rejects duplicates across lists."""
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be an array")
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{at} must be an object")
        if tool.get("type") != "function":
            raise ValueError(f"{at}.type must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{at}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"{at}.function.name must match ^[A-Za-z_][A-Za-z0-9_-]{{0,255}}$, got {name!r}")
        if name in seen:
            raise ValueError(f"{at}.function.name {name!r} is declared twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"{at}.function.parameters must be an object")
    return [dict(t) for t in tools]


def deep_sort(obj: Any) -> Any:
    """Sort dict keys at every level; lists keep their order."""
    if isinstance(obj, Mapping):
        return {k: deep_sort(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list | tuple):
        return [deep_sort(v) for v in obj]
    return obj


class Image:
    """Marker for an image part inside message content."""

    __slots__ = ()


IMAGE = Image()


def content_parts(content: Any, where: str) -> list[str | Image]:
    """Message content as text pieces and image markers. An empty text list gives no piece (never
    a Python repr in the prompt, frontend.md §1.6)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string, an array of parts or null")
    out: list[str | Image] = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}.content[{i}] must be an object")
        kind = part.get("type")
        if kind in ("image_url", "image"):
            out.append(IMAGE)
        elif kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{i}].text must be a string")
            if text:
                out.append(text)
        else:
            raise ValueError(f"{where}.content[{i}].type {kind!r} is not supported")
    return out


def check_messages(messages: Any, request_tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Message-level checks shared by both families; returns shallow copies. Also checks dynamic
    tools (K3 system messages with `tools`) for duplicates against the request-level list."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty array")
    seen: set[str] = set()
    if request_tools:
        check_tools(list(request_tools), "tools", seen)
    out = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{at} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}")
        if m.get("tools") is not None:
            if role != "system":
                raise ValueError(f"{at}: only system messages may declare tools")
            if content_parts(m.get("content"), at):
                raise ValueError(f"{at}: a system message with tools must have empty content")
            check_tools(m["tools"], f"{at}.tools", seen)
        for key in ("name", "tool", "reasoning_content", "reasoning"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"{at}.{key} must be a string")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(f"{at}.tool_call_id is required for tool messages")
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{at}.tool_calls must be an array")
            for j, call in enumerate(calls):
                call_function(call, f"{at}.tool_calls[{j}]")
        content_parts(m.get("content"), at)
        out.append(dict(m))
    return out


def call_function(call: Any, where: str) -> tuple[str, Any]:
    """`(name, arguments)` of an assistant tool call."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name is required")
    return fn["name"], fn.get("arguments")


def declared_names(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> set[str]:
    names = {t["function"]["name"] for t in tools or ()}
    for m in messages:
        names |= {t["function"]["name"] for t in m.get("tools") or ()}
    return names


def check_tool_choice_against(tool_choice: Any, names: set[str]) -> None:
    if tool_choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs at least one tool")
    name = named_tool(tool_choice)
    if name is not None and name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not a declared tool")
