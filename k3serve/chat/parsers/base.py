"""Shared machinery of the streaming parsers: UTF-8 reassembly, marker search with hold-back of
partial markers, delta merging, and the content run rule (a run that is only whitespace or
K2's `(no content)` placeholder is dropped; frontend.md §2.4 B9, B14).

A parser is single-use: `feed` chunks, then `finish` once. `parse(text)` is exactly
`feed(text) + finish()`, so streaming and non-streaming results cannot disagree.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from k3serve.chat.parsers.deltas import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ReasoningDelta,
    ToolCallArgs,
    ToolCallStart,
    collect,
)

PLACEHOLDER = "(no content)"
_MAX_HELD = 4096


def find_first(buf: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest marker occurrence at or after `start` (longest wins on a tie)."""
    best: tuple[int, str] | None = None
    for m in markers:
        i = buf.find(m, start)
        if i >= 0 and (best is None or i < best[0] or i == best[0] and len(m) > len(best[1])):
            best = (i, m)
    return best


@functools.lru_cache(maxsize=256)
def _marker_info(markers: tuple[str, ...]) -> tuple[int, str]:
    return max(map(len, markers)), "".join(sorted({m[0] for m in markers}))


def partial_tail(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of some marker."""
    longest, firsts = _marker_info(tuple(markers))
    start = max(0, len(buf) - longest + 1)
    tail = buf[start:]
    if not any(c in tail for c in firsts):  # the common case, checked in C: no marker can start here
        return 0
    for i in range(start, len(buf)):
        if buf[i] in firsts and any(m.startswith(buf[i:]) and len(m) > len(buf) - i for m in markers):
            return len(buf) - i
    return 0


class StreamParser:
    """Base class: subclasses implement `_consume(final)` over `self._buf`."""

    def __init__(self, *, tools: Sequence[Mapping[str, Any]] | None = None, next_call_index: int = 0):
        if next_call_index < 0:
            raise ValueError(f"next_call_index must be >= 0, got {next_call_index}")
        self.tools = list(tools or ())
        self.tool_names = [t["function"]["name"] for t in self.tools if t.get("function")]
        self.next_call_index = next_call_index
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._buf = ""
        self._out: list[Delta] = []
        self._finished = False
        self._run: list[str] | None = []  # held content run; None once it streams
        self._run_core: str | None = None  # the run after its leading whitespace
        self._calls = 0
        self._calls_done = 0

    def feed(self, chunk: str | bytes) -> list[Delta]:
        if self._finished:
            raise ValueError("parser already finished; use a new parser per request")
        self._buf += self._utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
        self._consume(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        if self._finished:
            raise ValueError("parser already finished")
        self._buf += self._utf8.decode(b"", final=True)
        self._finished = True
        self._consume(final=True)
        self._end_content()
        return self._take()

    def parse(self, text: str | bytes) -> ParsedMessage:
        return collect(self.feed(text) + self.finish())

    @property
    def calls_started(self) -> int:
        return self._calls

    @property
    def calls_finished(self) -> int:
        """Calls whose closing markup has arrived (their arguments are complete)."""
        return self._calls_done

    def _consume(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _emit(self, delta: Delta) -> None:
        last = self._out[-1] if self._out else None
        if isinstance(delta, ReasoningDelta) and isinstance(last, ReasoningDelta):
            self._out[-1] = ReasoningDelta(last.text + delta.text)
        elif isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
            self._out[-1] = ContentDelta(last.text + delta.text)
        elif isinstance(delta, ToolCallArgs) and isinstance(last, ToolCallArgs) and last.index == delta.index:
            self._out[-1] = ToolCallArgs(delta.index, last.arguments + delta.arguments)
        else:
            self._out.append(delta)

    def _reasoning(self, text: str) -> None:
        if text:
            self._emit(ReasoningDelta(text))

    def _content(self, text: str) -> None:
        """Content text. A run is held while it is only whitespace or could still be the
        placeholder (plus whitespace); once it is anything else it streams. Work is linear in
        the text: whitespace is checked per piece and the non-space part stays short."""
        if not text:
            return
        if self._run is None:
            self._emit(ContentDelta(text))
            return
        self._run.append(text)
        if self._run_core is None:
            if text.isspace():
                return
            self._run_core = text.lstrip()
        else:
            self._run_core += text
        core = self._run_core
        if len(core) > _MAX_HELD or not PLACEHOLDER.startswith(core.rstrip()):
            self._emit(ContentDelta("".join(self._run)))
            self._run = None

    def _end_content(self) -> None:
        """The current content run ends; the next content text starts a new held run."""
        run, core = self._run, self._run_core
        self._run, self._run_core = [], None
        if run and core is not None and core.strip() != PLACEHOLDER:
            self._emit(ContentDelta("".join(run)))

    def _start_call(self, call_id: str, name: str) -> int:
        index = self._calls
        self._calls += 1
        self._emit(ToolCallStart(index, call_id, name))
        return index

    def _args(self, index: int, text: str) -> None:
        if text:
            self._emit(ToolCallArgs(index, text))
