"""One generated sequence on its way back to the client: engine token ids -> text (stop strings
applied) -> parser deltas, plus its logprobs and finish reason.

`ChoiceDecoder.push(output)` returns the new deltas of one engine step; `done` tells when the
choice ended (engine finish or a stop string, after which the engine request is aborted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from k3serve.engine.detokenizer import IncrementalDetokenizer
from k3serve.server.chat.parsers import ContentDelta, Delta, ParsedMessage, StreamParser, collect
from k3serve.server.messages import Output


def token_str(decode_bytes: Callable[[list[int]], bytes], token_id: int) -> tuple[str, list[int]]:
    data = decode_bytes([token_id])
    return data.decode("utf-8", errors="replace"), list(data)


class ChoiceDecoder:
    """`parser` None = raw text (completions); `skip_ids` are dropped before decoding."""

    def __init__(self, index: int, decode_bytes: Callable[[list[int]], bytes], *, stop: Sequence[str] = (),
                 parser: StreamParser | None = None, skip_ids: frozenset[int] = frozenset(),
                 eos_ids: Sequence[int] = ()):
        self.index = index
        self._decode_bytes = decode_bytes
        self._detok = IncrementalDetokenizer(decode_bytes, stop, False, skip_ids)
        self.parser = parser
        self._eos = frozenset(eos_ids)
        self.deltas: list[Delta] = []
        self.text = ""
        self.num_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.logprobs: list[tuple[int, dict[int, float]]] = []
        self.finish_reason: str | None = None
        self.done = False

    def push(self, out: Output) -> tuple[list[Delta] | str, list[tuple[int, dict[int, float]]]]:
        """New deltas (or raw text without a parser) and the logprobs of this step's tokens."""
        ids = list(out.token_ids)
        self.num_tokens += len(ids)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        lps = list(zip(ids, out.logprobs)) if out.logprobs else []
        self.logprobs += lps
        # the stop token is consumed as the stop, never shown (chat_format_examples.md §9)
        if out.finished and out.finish_reason == "stop" and ids and ids[-1] in self._eos | {out.stop_reason}:
            ids = ids[:-1]
        text = self._detok.push(ids)
        if self._detok.stopped_on is not None:
            self.finish_reason, self.done = "stop", True
        elif out.finished:
            text += self._detok.flush()
            self.finish_reason, self.done = out.finish_reason or "stop", True
        self.text += text
        if self.parser is None:
            return text, lps
        deltas = self.parser.feed(text) if text else []
        if self.done:
            deltas += self.parser.finish()
        self.deltas += deltas
        return deltas, lps

    @property
    def stopped_on(self) -> str | None:
        return self._detok.stopped_on

    def message(self) -> ParsedMessage:
        return collect(self.deltas)

    def final_finish_reason(self) -> str:
        """`tool_calls` whenever calls were parsed and generation was not cut (K2VV/KVV rule)."""
        if self.finish_reason == "length":
            return "length"
        if self.parser is not None and self.parser.calls_started:
            return "tool_calls"
        return "stop" if self.finish_reason in (None, "stop", "abort") else self.finish_reason

    def logprobs_content(self, top: int, items: Sequence[tuple[int, dict[int, float]]] | None = None
                         ) -> list[dict[str, Any]]:
        """OpenAI chat `logprobs.content` entries."""
        out = []
        for tok, d in (self.logprobs if items is None else items):
            s, b = token_str(self._decode_bytes, tok)
            tops = sorted(d.items(), key=lambda kv: -kv[1])[:top]
            out.append({"token": s, "logprob": d.get(tok, 0.0), "bytes": b,
                        "top_logprobs": [{"token": token_str(self._decode_bytes, t)[0], "logprob": lp,
                                          "bytes": token_str(self._decode_bytes, t)[1]} for t, lp in tops]})
        return out


def has_content(deltas: Sequence[Delta]) -> bool:
    return any(isinstance(d, ContentDelta) for d in deltas)
