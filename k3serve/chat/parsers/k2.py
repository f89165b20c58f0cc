"""K2-family output parser (K2-Instruct, K2-Thinking, K2.5+): `<think>` reasoning and
`<|tool_calls_section_begin|>` tool calls, one streaming state machine.

States: reasoning -> content -> section -> call id -> arguments -> section ... Markers are
matched in the decoded text (decode with specials kept, no spaces between them); a partial
marker at the end of a chunk is held back, so no marker byte ever reaches a delta. Rules from
frontend.md §2.4: a tool marker ends reasoning (B2); text between section and call markers is
dropped (B1); arguments end only at `<|tool_call_end|>`, a new call, the section end or the
stream end (B6, B7, B10); the singular `<|tool_call_section_begin|>` also opens a section (B11).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from k3serve.chat.parsers.base import StreamParser, find_first, partial_tail
from k3serve.chat.parsers.tool_ids import (
    fallback_name,
    mint_tool_call_id,
    name_from_arguments,
    name_from_id,
    split_id,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
EOS = "<|im_end|>"
MARKERS = (THINK_OPEN, THINK_CLOSE, *SECTION_BEGIN, *SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END, EOS)

REASONING, CONTENT, SECTION, CALL_ID, ARGS, END = "reasoning", "content", "section", "call_id", "args", "end"


class K2Parser(StreamParser):
    """`reasoning=True` when generation starts inside `<think>` (the prompt opened it, or the
    model opens it itself as K2-Thinking does); a leading `<think>` is then dropped."""

    def __init__(self, *, reasoning: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                 next_call_index: int = 0):
        super().__init__(tools=tools, next_call_index=next_call_index)
        self.state = REASONING if reasoning else CONTENT
        self._id = ""
        self._index: int | None = None
        self._deferred: str | None = None  # the raw id of a call whose name only its arguments can tell
        self._args_buf = ""
        self._args_started = False
        self._ws = ""

    def _consume(self, final: bool) -> None:
        while self._buf and self.state != END:
            hit = find_first(self._buf, MARKERS)
            if hit is None:
                keep = 0 if final else partial_tail(self._buf, MARKERS)
                self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, marker = hit
            self._text(self._buf[:at])
            self._buf = self._buf[at + len(marker):]
            self._marker(marker)
        if self.state == END:
            self._buf = ""
        if final:
            self._finish_call()

    def _text(self, text: str) -> None:
        if self.state == REASONING:
            self._reasoning(text)
        elif self.state == CONTENT:
            self._content(text)
        elif self.state == CALL_ID:
            self._id += text
        elif self.state == ARGS:
            self._arguments(text)

    def _marker(self, m: str) -> None:
        s = self.state
        if m == EOS:
            self._finish_call()
            self.state = END
        elif s in (REASONING, CONTENT):
            if m in SECTION_BEGIN or m == CALL_BEGIN:
                self._end_content()
                self.state = SECTION
                if m == CALL_BEGIN:
                    self._begin_call()
            elif m == THINK_CLOSE and s == REASONING:
                self.state = CONTENT
        elif s == SECTION:
            if m == CALL_BEGIN:
                self._begin_call()
            elif m in SECTION_END:
                self.state = CONTENT
        elif m == ARG_BEGIN and s == CALL_ID:
            self._open_call()
        elif m in (CALL_END, CALL_BEGIN) or m in SECTION_END:
            self._finish_call()
            if m == CALL_BEGIN:
                self._begin_call()
            elif m in SECTION_END:
                self.state = CONTENT

    def _begin_call(self) -> None:
        self._id, self.state = "", CALL_ID

    def _open_call(self) -> None:
        """The id is complete: start the call now, or defer it until the arguments name it."""
        raw = self._id.strip()
        self._args_buf, self._args_started, self._ws = "", False, ""
        self.state = ARGS
        name = name_from_id(raw, self.tool_names)
        if name is None and not self.tools:
            name = fallback_name(raw)
        if name is None:
            self._deferred = raw
            return
        parsed = split_id(raw)
        n = parsed[1] if parsed else self.next_call_index + self.calls_started
        self._index = self._start_call(mint_tool_call_id(name, n), name)

    def _arguments(self, text: str) -> None:
        """Arguments without surrounding whitespace: leading space is skipped, trailing space is
        held until more text follows (so it is dropped at the call end)."""
        if not self._args_started:
            text = text.lstrip()
            if not text:
                return
            self._args_started = True
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if self._index is None:
            self._args_buf += body
        else:
            self._args(self._index, body)

    def _finish_call(self) -> None:
        if self.state == CALL_ID:
            self._open_call()
        if self.state != ARGS:
            return
        if self._deferred is not None:
            name = name_from_arguments(self._args_buf, self.tools) or fallback_name(self._deferred)
            n = self.next_call_index + self.calls_started
            index = self._start_call(mint_tool_call_id(name, n), name)
            self._args(index, self._args_buf)
        self._calls_done += 1
        self._deferred, self._index, self._args_buf, self._ws = None, None, "", ""
        self.state = SECTION
