"""Kimi K3 output parser: XTML `think` / `response` / `tools` channels, one streaming state
machine (chat_format_examples.md §9.1).

A tag is `<|open|>header<|sep|>` or `<|close|>name<|sep|>`; a tag is acted on only once its
`<|sep|>` has arrived, and a partial marker at a chunk end is held back. Headers are
whitespace-trimmed, so a detokenizer that put spaces around special tokens (B18) still parses.
Each call starts (id + name) at its `call` tag; arguments stream as the JSON object
`{"key": value, ...}` with `json.dumps` spacing: string values stream as they arrive, other
types are parsed at their close tag and kept as a string when they are not JSON (B17).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from k3serve.chat.parsers.base import StreamParser, find_first, partial_tail
from k3serve.chat.parsers.tool_ids import mint_tool_call_id

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, EOM)
MAX_HEADER = 4096
_ATTR = re.compile(r'([\w\-]+)\s*=\s*"([^"]*)"')

THINK, TOP, RESPONSE, TOOLS, CALL, SKIP, ARG, JSON_BLOCK, END = (
    "think", "top", "response", "tools", "call", "skip", "arg", "json", "end")
_TEXT_STATES = (THINK, TOP, RESPONSE, ARG, JSON_BLOCK)


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


class K3Parser(StreamParser):
    """`thinking=True` when the prompt ended with `<|open|>think<|sep|>`, else it ended with
    `<|open|>response<|sep|>`."""

    def __init__(self, *, thinking: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                 next_call_index: int = 0):
        super().__init__(tools=tools, next_call_index=next_call_index)
        self.state = THINK if thinking else RESPONSE
        self._fresh = True
        self._index: int | None = None
        self._n_args = 0
        self._json_done = False
        self._arg_type = "string"
        self._value = ""

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
            self._buf = self._buf[at:]
            if marker == EOM:
                self._buf = ""
                self._end()
                break
            # A tag header must close within MAX_HEADER chars, whatever the chunking.
            window = self._buf[:MAX_HEADER]
            sep = window.find(SEP, len(marker))
            nested = find_first(window, MARKERS, len(marker))
            if sep < 0 or nested is not None and nested[0] < sep:
                if nested is None and not final and len(window) < MAX_HEADER:
                    break
                # Not a tag: the marker is text of the current channel.
                self._text(marker)
                self._buf = self._buf[len(marker):]
                continue
            tag = self._buf[:sep + len(SEP)]
            self._buf = self._buf[sep + len(SEP):]
            self._tag(marker == OPEN, self._header(tag, marker), tag)
        if self.state == END:
            self._buf = ""
        if final:
            self._end()

    @staticmethod
    def _header(tag: str, marker: str) -> str:
        return tag[len(marker):-len(SEP)].strip()

    def _text(self, text: str) -> None:
        if not text:
            return
        s = self.state
        if s == THINK:
            self._fresh = False
            self._reasoning(text)
        elif s in (RESPONSE, TOP):
            self._content(text)
        elif s == ARG:
            if self._arg_type == "string":
                self._args(self._index, json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                self._value += text
        elif s == JSON_BLOCK:
            self._value += text

    def _tag(self, is_open: bool, header: str, raw: str) -> None:
        name, _, rest = header.partition(" ")
        s = self.state
        if not is_open and name == "message":
            self._end()
        elif is_open and name == "call":
            self._close_call()
            self._open_call(dict((k, _unescape(v)) for k, v in _ATTR.findall(rest)))
        elif s in (CALL, SKIP, ARG, JSON_BLOCK):
            self._in_call(is_open, name, rest, raw)
        elif is_open and name == "think" and (s == TOP or s == THINK and self._fresh):
            self.state = THINK
        elif not is_open and name == "think" and s == THINK:
            self.state = TOP
        elif is_open and name == "response" and s in (THINK, TOP, RESPONSE):
            if s == TOP:
                self._end_content()
            self.state = RESPONSE
        elif not is_open and name == "response" and s == RESPONSE:
            self._end_content()
            self.state = TOP
        elif is_open and name == "tools" and s in (THINK, TOP, RESPONSE):
            self._end_content()
            self.state = TOOLS
        elif not is_open and name == "tools" and s == TOOLS:
            self.state = TOP
        elif s in (THINK, RESPONSE) and name not in ("think", "response", "tools", "message"):
            self._text(raw)

    def _in_call(self, is_open: bool, name: str, rest: str, raw: str) -> None:
        s = self.state
        closes_value = not is_open and (name == "argument" and s == ARG or name == "json" and s == JSON_BLOCK)
        if closes_value:
            self._close_value()
            self.state = CALL
        elif not is_open and name in ("call", "tools"):
            self._close_call()
            self.state = TOP if name == "tools" else TOOLS
        elif s == SKIP:
            return
        elif is_open and name == "argument" and s in (CALL, ARG):
            self._close_value()
            attrs = dict((k, _unescape(v)) for k, v in _ATTR.findall(rest))
            self._open_argument(attrs.get("key", ""), attrs.get("type", "string"))
        elif is_open and name == "json" and s == CALL:
            self._value, self.state = "", JSON_BLOCK
        elif s in (ARG, JSON_BLOCK):
            self._text(raw)

    def _open_call(self, attrs: dict[str, str]) -> None:
        tool = attrs.get("tool", "").strip()
        if not tool:
            self.state = SKIP
            return
        self._end_content()
        n = self.next_call_index + self.calls_started
        self._index = self._start_call(mint_tool_call_id(tool, n), tool)
        self._n_args, self._json_done, self.state = 0, False, CALL

    def _open_argument(self, key: str, kind: str) -> None:
        if self._json_done:
            self.state = SKIP
            return
        prefix = "{" if self._n_args == 0 else ", "
        self._n_args += 1
        self._arg_type, self._value, self.state = kind, "", ARG
        self._args(self._index, prefix + json.dumps(key, ensure_ascii=False) + ": " + ('"' if kind == "string" else ""))

    def _close_value(self) -> None:
        if self.state == ARG:
            if self._arg_type == "string":
                self._args(self._index, '"')
            else:
                try:
                    value = json.loads(self._value)
                except (json.JSONDecodeError, RecursionError):
                    value = self._value
                self._args(self._index, json.dumps(value, ensure_ascii=False))
        elif self.state == JSON_BLOCK and self._n_args == 0 and not self._json_done:
            try:
                value = json.loads(self._value)
            except (json.JSONDecodeError, RecursionError):
                value = None
            text = json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else self._value.strip()
            self._args(self._index, text or "{}")
            self._json_done = True
        self._value = ""

    def _close_call(self) -> None:
        if self.state in (ARG, JSON_BLOCK):
            self._close_value()
        if self._index is not None:
            if not self._json_done:
                self._args(self._index, "}" if self._n_args else "{}")
            self._calls_done += 1
        self._index = None
        if self.state in (CALL, SKIP, ARG, JSON_BLOCK):
            self.state = TOOLS

    def _end(self) -> None:
        self._close_call()
        if self.state in (RESPONSE, TOP):
            self._end_content()
        self.state = END
