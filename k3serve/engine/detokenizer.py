"""Incremental detokenization with stop strings, and the one owner of a sequence's reported finish.

``SequenceDecoder`` is where engine token ids become text, for the offline ``LLM`` and for every server
choice alike (the engine itself handles ids only), and where a sequence's finish reason is decided: the
engine reports why *it* stopped (``"stop"`` on EOS / a stop token id, ``"length"``, ``"abort"``); a stop
string found in the text, or a cut further down (the chat content cutoff), ends it with ``"stop"`` and wins.

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
        data = self._decode_bytes([t for t in token_ids if t not in self._skip] if self._skip else token_ids)
        return self._advance(self._utf8.decode(data))

    def flush(self) -> str:
        """End of stream: the held-back text (and a dangling partial character as U+FFFD)."""
        if self.stopped_on is not None:
            return ""
        delta = self._advance(self._utf8.decode(b"", final=True))
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return delta + rest

    def _advance(self, new: str) -> str:
        if not self._stop:  # nothing to search or hold back (a chat answer: its stops apply to content)
            self.text += new
            self.emitted = len(self.text)
            return new
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


class SequenceDecoder:
    """One sequence's engine outputs -> text and its finish reason. The token that stopped it (EOS or a stop
    token id) is consumed as the stop, never decoded (chat_format_examples.md §9)."""

    def __init__(self, decode_bytes: Callable[[Sequence[int]], bytes], *, stop: Sequence[str] = (),
                 include_stop: bool = False, skip_ids: frozenset[int] = frozenset(), eos_ids: Sequence[int] = ()):
        self._detok = IncrementalDetokenizer(decode_bytes, stop, include_stop, skip_ids)
        self._eos = frozenset(eos_ids)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.done = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        d = self._detok
        return d.text if d.emitted == len(d.text) else d.text[:d.emitted]

    def push(self, token_ids: Sequence[int], finished: bool = False, finish_reason: str | None = None,
             stop_reason: int | str | None = None) -> str:
        """One engine step of the sequence (its new ids, and the engine's finish); returns the new text."""
        if self.done:
            return ""
        if finished and finish_reason == "stop" and token_ids and (token_ids[-1] in self._eos
                                                                   or token_ids[-1] == stop_reason):
            token_ids = token_ids[:-1]
        detok = self._detok
        text = detok.push(token_ids) if token_ids else ""
        if detok.stopped_on is not None:  # also when the same token ended it by length: the stop string wins
            self._finish("stop", detok.stopped_on)
        elif finished:
            text += detok.flush()
            self._finish(finish_reason or "stop", stop_reason)
        return text

    def cut(self, stop_reason: str | None = None) -> None:
        """End with ``"stop"`` for a stop found past the text (the chat content cutoff); wins over the engine."""
        self.finish_reason, self.stop_reason, self.done = "stop", stop_reason, True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason, self.done = reason, stop_reason, True
