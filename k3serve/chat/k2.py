"""Kimi K2-family renderer (K2-Instruct, K2-Thinking, K2.5/K2.6): `<|im_*|>` turns, tool-call
markers and `<think>` (chat_format_examples.md §5, frontend.md §1.2–1.4).

The reference renders one string and encodes it with specials allowed; here control tokens are
special-allowed segments and all text between two control tokens is one plain segment, so ids
match the reference for ordinary text while typed control-token spellings stay plain bytes.
History tool-call ids are rewritten to `functions.<name>:<n>` with a conversation-global n, and
tool results follow their call's new id (frontend.md §1.6; foreign ids make K2 stall).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3serve.chat.k2_tools_ts import tools_to_typescript
from k3serve.chat.request import (
    IMAGE,
    ChatOptions,
    call_function,
    check_messages,
    check_tool_choice_against,
    content_parts,
    declared_names,
    deep_sort,
)
from k3serve.chat.segments import ImageSegment, Prompt, SegmentBuilder

KIMI_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
IMAGE_PROMPT = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
_OPENERS = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}


@dataclass(frozen=True)
class K2Style:
    """What distinguishes the K2 templates.

    `typescript_tools`: K2.5 TypeScript declaration (else `tools|tojson`); `default_system`: turn
    inserted when the first message is not a system message; `think`: "none" (K2-Instruct),
    "history" (K2-Thinking: think blocks in turns, the model opens `<think>` itself) or "prompt"
    (K2.5: the generation prompt opens `<think>`, or `<think></think>` in instant mode).
    """

    name: str
    typescript_tools: bool
    default_system: str | None
    think: str
    images: bool

    def __post_init__(self) -> None:
        if self.think not in ("none", "history", "prompt"):
            raise ValueError(f"K2Style.think must be none, history or prompt, got {self.think!r}")


K2_INSTRUCT = K2Style("kimi_k2", typescript_tools=False, default_system=KIMI_SYSTEM, think="none", images=False)
K2_THINKING = K2Style("kimi_k2_thinking", typescript_tools=False, default_system=KIMI_SYSTEM, think="history",
                      images=False)
K25 = K2Style("kimi_k25", typescript_tools=True, default_system=None, think="prompt", images=True)


def canonical_id(name: str, n: int) -> str:
    return f"functions.{name}:{n}"


def rewrite_tool_call_ids(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Give every history call id `functions.<name>:<n>` (n counts calls over the conversation)
    and point tool results at the new ids: by old id within the latest assistant turn, else by
    position among the results since that turn. Returns the messages and the next n."""
    out: list[dict[str, Any]] = []
    n = 0
    mapping: dict[str, str] = {}
    new_ids: list[str] = []
    k = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            mapping, new_ids, k = {}, [], 0
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                name, _ = call_function(call, f"messages[{i}].tool_calls[{j}]")
                new = canonical_id(name, n)
                n += 1
                if call.get("id") is not None:
                    mapping.setdefault(str(call["id"]), new)
                new_ids.append(new)
                calls.append({**call, "id": new})
            m = {**m, "tool_calls": calls}
        elif m["role"] == "assistant":
            mapping, new_ids, k = {}, [], 0
        elif m["role"] == "tool":
            old = m["tool_call_id"]
            new = mapping.get(old) or (new_ids[k] if k < len(new_ids) else old)
            k += 1
            m = {**m, "tool_call_id": new}
        out.append(m)
    return out, n


class _Writer:
    def __init__(self, style: K2Style, image_sizes: Sequence[tuple[int, int]]):
        self.b = SegmentBuilder(merge_text=True)
        self.style = style
        self.sizes = image_sizes
        self.images = 0

    def content(self, content: Any, where: str) -> None:
        for part in content_parts(content, where):
            if part is not IMAGE:
                self.b.text(part)
                continue
            if not self.style.images:
                raise ValueError(f"{where}: {self.style.name} does not accept images")
            if self.images >= len(self.sizes):
                raise ValueError(f"messages contain more images than the {len(self.sizes)} image sizes given")
            w, h = self.sizes[self.images]
            self.b.image(ImageSegment(self.images, w, h, IMAGE_PROMPT))
            self.b.text("\n")
            self.images += 1

    def turn(self, m: Mapping[str, Any]) -> None:
        self.b.control(_OPENERS.get(m["role"], "<|im_system|>"))
        self.b.text(m.get("name") or m["role"])
        self.b.control("<|im_middle|>")

    def tool_calls(self, calls: list[Mapping[str, Any]]) -> None:
        self.b.control("<|tool_calls_section_begin|>")
        for call in calls:
            args = call["function"].get("arguments")
            self.b.control("<|tool_call_begin|>")
            self.b.text(call["id"])
            self.b.control("<|tool_call_argument_begin|>")
            self.b.text(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            self.b.control("<|tool_call_end|>")
        self.b.control("<|tool_calls_section_end|>")


def _declaration(tools: list[Mapping[str, Any]], style: K2Style) -> str:
    tools = deep_sort(list(tools))
    if style.typescript_tools:
        try:
            return tools_to_typescript(tools)
        except (ValueError, KeyError, TypeError):
            return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(tools, ensure_ascii=False)


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
           options: ChatOptions = ChatOptions(), style: K2Style = K25) -> Prompt:
    """Render a K2-family conversation. response_format, tool_choice and effort are not part of
    these templates; the server enforces them (grammar / validation)."""
    msgs = check_messages(list(messages), tools)
    check_tool_choice_against(options.tool_choice, declared_names(msgs, tools))
    msgs, next_call = rewrite_tool_call_ids(msgs)
    w = _Writer(style, options.image_sizes)
    if tools:
        w.b.control("<|im_system|>")
        w.b.text("tool_declare")
        w.b.control("<|im_middle|>")
        w.b.text(_declaration(list(tools), style))
        w.b.control("<|im_end|>")
    if style.default_system and msgs[0]["role"] != "system":
        w.turn({"role": "system"})
        w.b.text(style.default_system)
        w.b.control("<|im_end|>")
    last_plain = max((i for i, m in enumerate(msgs) if m["role"] == "assistant" and not m.get("tool_calls")),
                     default=-1)
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        w.turn(m)
        if m["role"] == "assistant":
            if style.think != "none":
                keep = i > last_plain and (style.think == "history" or options.thinking)
                reasoning = m.get("reasoning_content") if keep else None
                w.b.control("<think>")
                w.b.text(reasoning if isinstance(reasoning, str) else "")
                w.b.control("</think>")
            w.content(m.get("content"), at)
            if m.get("tool_calls"):
                w.tool_calls(m["tool_calls"])
        elif m["role"] == "tool":
            w.b.text(f"## Return of {m['tool_call_id']}\n")
            w.content(m.get("content"), at)
        else:
            w.content(m.get("content"), at)
        w.b.control("<|im_end|>")
    if w.images != len(options.image_sizes):
        raise ValueError(f"{len(options.image_sizes)} image sizes given but messages contain {w.images} images")
    stub = 0
    thinking = style.think == "history"
    if options.add_generation_prompt:
        w.turn({"role": "assistant"})
        if style.think == "prompt":
            thinking = options.thinking
            w.b.control("<think>" if thinking else "<think></think>")
            stub = 1
    return w.b.build(stub=stub, thinking=thinking, next_call_index=next_call)
