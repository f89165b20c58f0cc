"""Where a chat answer ends early, decided on the parser's deltas (not on the raw model text):

* stop strings match the user-visible `content` only (frontend.md §4.2: Moonshot applies stop to
  content, so a stop string never cuts inside reasoning or tool-call markup, and the text inside
  reasoning or tool-call arguments never stops generation). The match may span any number of
  deltas within one content run; the matched text and everything after it are dropped. Content
  that could still grow into a stop string is held back, so no piece of a stop string is streamed.
  A run ends at a reasoning or tool-call delta (the held text is released then): a stop string
  does not match across a tool section.
* `parallel_tool_calls: false` without a grammar (tool_choice `auto`): the answer ends once the
  first call is complete; later calls and any text after the first call are dropped.

`Cutoff.push(deltas, calls_finished)` returns the deltas to send; once `done`, the caller aborts
the engine request and sends nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3serve.chat.parsers import ContentDelta, Delta, ToolCallArgs, ToolCallStart
from k3serve.chat.parsers.base import partial_tail
from k3serve.engine.detokenizer import find_stop


class Cutoff:
    def __init__(self, stop: Sequence[str] = (), *, one_call: bool = False):
        if not all(stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._one_call = one_call
        self._held = ""  # content not sent yet: it may be the start of a stop string
        self._in_call = False
        self.stopped_on: str | None = None
        self.done = False

    @property
    def active(self) -> bool:
        return bool(self._stop) or self._one_call

    def push(self, deltas: Sequence[Delta], calls_finished: int = 0) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if self.done:
                break
            if self._one_call and self._in_call and not (isinstance(d, ToolCallArgs) and d.index == 0):
                self.done = True  # the first call is over: this delta belongs to what comes after it
                break
            if isinstance(d, ContentDelta) and self._stop:
                self._content(d.text, out)
                continue
            self._release(out)
            self._in_call = self._in_call or isinstance(d, ToolCallStart)
            out.append(d)
        if self._one_call and calls_finished >= 1 and self._in_call:
            self.done = True
        if self.done:
            self._held = ""
        return out

    def flush(self) -> list[Delta]:
        """The stream ended: release held content (a stop string can no longer complete)."""
        out: list[Delta] = []
        if not self.done:
            self._release(out)
        return out

    def _content(self, text: str, out: list[Delta]) -> None:
        # Sent text never holds the start of a match (any suffix that is a prefix of a stop string
        # is held), so searching the held text plus the new text finds every match.
        pending = self._held + text
        hit = find_stop(pending, self._stop)
        if hit is not None:
            at, s = hit
            if at:
                out.append(ContentDelta(pending[:at]))
            self.stopped_on, self.done, self._held = s, True, ""
            return
        hold = partial_tail(pending, self._stop)
        if hold < len(pending):
            out.append(ContentDelta(pending[:len(pending) - hold]))
        self._held = pending[len(pending) - hold:]

    def _release(self, out: list[Delta]) -> None:
        if self._held:
            out.append(ContentDelta(self._held))
        self._held = ""
