"""Typed parser output. Each delta maps to one OpenAI `chat.completion.chunk` delta; `collect`
folds a delta stream into the non-streaming assistant message."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningDelta:
    text: str

    def __post_init__(self) -> None:
        if not self.text:
            raise ValueError("ReasoningDelta.text must be non-empty")

    def to_openai(self) -> dict[str, Any]:
        return {"reasoning_content": self.text}


@dataclass(frozen=True)
class ContentDelta:
    text: str

    def __post_init__(self) -> None:
        if not self.text:
            raise ValueError("ContentDelta.text must be non-empty")

    def to_openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallStart:
    """First chunk of a call: `index` is the 0-based position in this message."""

    index: int
    id: str
    name: str

    def __post_init__(self) -> None:
        if self.index < 0 or not self.id or not self.name:
            raise ValueError(f"invalid tool call start {self!r}")

    def to_openai(self) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": ""}}]}


@dataclass(frozen=True)
class ToolCallArgs:
    """A fragment of a call's `arguments` string; fragments concatenate."""

    index: int
    arguments: str

    def __post_init__(self) -> None:
        if self.index < 0 or not self.arguments:
            raise ValueError(f"invalid tool call arguments delta {self!r}")

    def to_openai(self) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "function": {"arguments": self.arguments}}]}


Delta = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgs


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    reasoning_content: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def finish_reason(self) -> str:
        """`tool_calls` when calls were parsed (K2VV/KVV expect it), else `stop`; the engine
        overrides with `length` when generation was cut."""
        return "tool_calls" if self.tool_calls else "stop"

    def to_openai(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def collect(deltas: Iterable[Delta]) -> ParsedMessage:
    """Fold deltas the way an OpenAI client does (arguments concatenated per index)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    heads: dict[int, ToolCallStart] = {}
    for d in deltas:
        if isinstance(d, ReasoningDelta):
            reasoning.append(d.text)
        elif isinstance(d, ContentDelta):
            content.append(d.text)
        elif isinstance(d, ToolCallStart):
            if d.index in heads:
                raise ValueError(f"tool call index {d.index} started twice")
            heads[d.index] = d
            calls[d.index] = []
        else:
            if d.index not in heads:
                raise ValueError(f"arguments for tool call {d.index} before its start")
            calls[d.index].append(d.arguments)
    tool_calls = tuple(ToolCall(heads[i].id, heads[i].name, "".join(calls[i])) for i in sorted(heads))
    return ParsedMessage("".join(reasoning) or None, "".join(content) or None, tool_calls)
