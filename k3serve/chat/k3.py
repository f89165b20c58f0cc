"""Kimi K3 XTML renderer: OpenAI messages -> segments (chat_format_examples.md §3.1, §4).

Tags are `<|open|>name key="value"…<|sep|>` and `<|close|>name<|sep|>`; the four markers are the
only special-allowed segments besides image prompts. Tag names, each attribute's four pieces
(` key`, `="`, escaped value, `"`), bodies and the fixed instruction texts are separate plain
segments, never merged, because the ids depend on those cuts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from k3serve.chat.request import (
    IMAGE,
    ChatOptions,
    call_function,
    check_messages,
    check_tool_choice_against,
    content_parts,
    declared_names,
    deep_sort,
    named_tool,
)
from k3serve.chat.segments import ImageSegment, Prompt, SegmentBuilder

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

_STATIC_TOOLS = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
_DYNAMIC_TOOLS = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
    "```json\n{}\n```"
)
_EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
_TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)
_JSON_OBJECT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
_JSON_SCHEMA = (
    "The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON
    + "\nThe JSON data must match the following schema:\n```json\n{}\n```"
)


def image_prompt(width: int, height: int) -> str:
    """The per-image prompt (one special-allowed segment); the engine expands the pad."""
    return f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>"


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def escape_attr(value: Any) -> str:
    """An XTML attribute value as the writer puts it between double quotes."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


class _Writer:
    def __init__(self, image_sizes: Sequence[tuple[int, int]]):
        self.b = SegmentBuilder()
        self._sizes = image_sizes
        self._images = 0

    def open(self, tag: str, *attrs: tuple[str, Any]) -> None:
        self.b.control(OPEN)
        self.b.text(tag)
        for key, value in attrs:
            self.b.text(f" {key}")
            self.b.text('="')
            self.b.text(escape_attr(value))
            self.b.text('"')
        self.b.control(SEP)

    def close(self, tag: str) -> None:
        self.b.control(CLOSE)
        self.b.text(tag)
        self.b.control(SEP)

    def end_message(self) -> None:
        self.close("message")
        self.b.control(END_OF_MSG)

    def content(self, content: Any, where: str) -> None:
        for part in content_parts(content, where):
            if part is IMAGE:
                self._image()
            else:
                self.b.text(part)

    def _image(self) -> None:
        k = self._images
        if k >= len(self._sizes):
            raise ValueError(f"messages contain more images than the {len(self._sizes)} image sizes given")
        w, h = self._sizes[k]
        self.b.image(ImageSegment(k, w, h, image_prompt(w, h)))
        self._images += 1

    def check_images_used(self) -> None:
        if self._images != len(self._sizes):
            raise ValueError(f"{len(self._sizes)} image sizes given but messages contain {self._images} images")

    def system_block(self, kind: str, body: str) -> None:
        self.open("message", ("role", "system"), ("type", kind))
        self.b.text(body.strip())
        self.end_message()


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, Mapping) else "array"


def _arguments(arguments: Any, where: str) -> tuple[Mapping[str, Any], str | None]:
    """`(argument object, raw json block)`: unparsable strings go into a `json` block."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, Mapping):
        return arguments, None
    if not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments must be a JSON object or a string")
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}.function.arguments must encode a JSON object")
    return parsed, None


def _assistant(w: _Writer, m: Mapping[str, Any], thinking: bool, where: str) -> None:
    if thinking:
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        w.open("think")
        if isinstance(reasoning, str) and reasoning.strip():
            w.b.text(reasoning)
        w.close("think")
    w.open("response")
    w.content(m.get("content"), where)
    w.close("response")
    calls = m.get("tool_calls") or []
    if not calls:
        return
    w.open("tools")
    for k, call in enumerate(calls, start=1):
        at = f"{where}.tool_calls[{k - 1}]"
        name, raw = call_function(call, at)
        args, block = _arguments(raw, at)
        w.open("call", ("tool", name), ("index", k))
        if block is not None:
            w.open("json", ("type", "object"))
            w.b.text(block)
            w.close("json")
        for key, value in args.items():
            w.open("argument", ("key", key), ("type", _xtml_type(value)))
            w.b.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            w.close("argument")
        w.close("call")
    w.close("tools")


def sort_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reorder each run of tool messages into the preceding assistant's call order when every
    message of the run matches a call id; matched messages take the call's tool name."""
    out: list[dict[str, Any]] = []
    positions: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "tool":
            if m["role"] == "assistant":
                positions = {}
                for k, call in enumerate(m.get("tool_calls") or [], start=1):
                    cid = call.get("id")
                    if cid is not None and str(cid) not in positions:
                        positions[str(cid)] = (k, call["function"]["name"])
            out.append(m)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        run = messages[i:j]
        matches = [positions.get(str(t["tool_call_id"])) for t in run]
        if all(matches):
            order = sorted(range(len(run)), key=lambda n: (matches[n][0], n))
            out.extend({**run[n], "tool": matches[n][1]} for n in order)
        else:
            out.extend(run)
        i = j
    return out


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
           options: ChatOptions = ChatOptions()) -> Prompt:
    """Render a K3 conversation. Named tool_choice is rejected in thinking mode (K3 API rule)."""
    msgs = check_messages(list(messages), tools)
    names = declared_names(msgs, tools)
    check_tool_choice_against(options.tool_choice, names)
    if options.thinking and named_tool(options.tool_choice) is not None:
        raise ValueError("tool_choice naming a function is not supported with thinking enabled")
    msgs = sort_tool_results(msgs)
    w = _Writer(options.image_sizes)
    if tools:
        w.system_block("tool-declare", _STATIC_TOOLS.format(compact_json(deep_sort(list(tools)))))
    if options.thinking and options.effort is not None:
        w.system_block("thinking-effort", _EFFORT.format(options.effort))
    calls: list[Any] = []
    tool_k = 0
    n_calls = 0
    for i, m in enumerate(msgs):
        at, role = f"messages[{i}]", m["role"]
        name_attr = (("name", m["name"]),) if m.get("name") else ()
        if role == "system" and m.get("tools"):
            w.system_block("tool-declare", _DYNAMIC_TOOLS.format(compact_json(deep_sort(m["tools"]))))
        elif role in ("system", "user"):
            w.open("message", ("role", role), *name_attr)
            w.content(m.get("content"), at)
            w.end_message()
        elif role == "assistant":
            calls, tool_k = m.get("tool_calls") or [], 0
            n_calls += len(calls)
            w.open("message", ("role", "assistant"), *name_attr)
            _assistant(w, m, options.thinking, at)
            w.end_message()
        else:
            tool_k += 1
            tool = m.get("tool") or m.get("name")
            if tool is None and tool_k <= len(calls):
                tool = calls[tool_k - 1]["function"]["name"]
            if not tool:
                raise ValueError(f"{at}: cannot tell which tool this result belongs to (no matching call or name)")
            w.open("message", ("role", "tool"), ("tool", tool), ("index", tool_k))
            w.content(m.get("content"), at)
            w.end_message()
    if isinstance(options.tool_choice, str) and options.tool_choice in _TOOL_CHOICE:
        w.system_block("tool-choice", _TOOL_CHOICE[options.tool_choice])
    if options.response_format_type == "json_object":
        w.system_block("response-format", _JSON_OBJECT)
    elif options.response_format_type == "json_schema":
        w.system_block("response-format", _JSON_SCHEMA.format(compact_json(deep_sort(options.response_schema))))
    w.check_images_used()
    stub = 0
    if options.add_generation_prompt:
        w.open("message", ("role", "assistant"))
        before = len(w.b)
        w.open("think" if options.thinking else "response")
        stub = len(w.b) - before
    return w.b.build(stub=stub, thinking=options.thinking and options.add_generation_prompt,
                     next_call_index=n_calls)
