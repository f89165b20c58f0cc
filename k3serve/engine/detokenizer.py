"""Incremental detokenization with stop strings.

Tokens are turned into *bytes* and fed through an incremental UTF-8 decoder, so a character split across
tokens is emitted only once complete. Stop strings are searched in the decoded text, including matches that
span token boundaries; text that could still become the start of a stop string is held back, so a stop
string (or a piece of it) never reaches the client unless ``include_stop_str_in_output`` asks for it.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text[start:]`` as ``(position, stop)``; on a tie the first listed wins."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


class IncrementalDetokenizer:
    def __init__(self, decode_bytes: Callable[[Sequence[int]], bytes], stop: Sequence[str] = (),
                 include_stop: bool = False, skip_ids: frozenset[int] = frozenset()):
        self._decode_bytes = decode_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop
        self._skip = skip_ids
        self.text = ""  # everything decoded so far (after a stop: cut at the stop)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped_on: str | None = None

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text that is now safe to emit. Sets ``stopped_on`` on a stop string."""
        if self.stopped_on is not None:
            return ""
        data = self._decode_bytes([t for t in token_ids if t not in self._skip])
        return self._advance(self._utf8.decode(data))

    def flush(self) -> str:
        """End of stream: the held-back text (and a dangling partial character as U+FFFD)."""
        if self.stopped_on is not None:
            return ""
        delta = self._advance(self._utf8.decode(b"", final=True))
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return delta + rest

    def _advance(self, new: str) -> str:
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += new
        hit = find_stop(self.text, self._stop, start)
        if hit is not None:
            pos, s = hit
            self.text = self.text[:pos + len(s)] if self._include_stop else self.text[:pos]
            self.stopped_on = s
            safe = len(self.text)
        else:
            safe = len(self.text) - self._held_back()
        delta = self.text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return delta


    def _held_back(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
