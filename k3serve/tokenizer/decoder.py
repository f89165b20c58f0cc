"""Streaming detokenization: ids arrive one step at a time, text leaves only in whole characters."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3serve.tokenizer.encoding import Tokenizer


class IncrementalDecoder:
    """Feed ids with ``push``; it returns the text completed so far, holding back the bytes of a
    character split across tokens. ``flush`` ends the stream (a dangling partial character becomes
    U+FFFD). The concatenated output equals ``tokenizer.decode(all_ids)``: invalid UTF-8 is
    replaced the same way, with Python's incremental UTF-8 decoder.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self._utf8.decode(self._tok.decode_bytes(ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    def reset(self) -> None:
        self._utf8.reset()

    @property
    def pending_bytes(self) -> int:
        """Bytes held back waiting for the rest of a character."""
        return len(self._utf8.getstate()[0])
