"""One generated sequence on its way back to the client: engine token ids -> text -> parser deltas
(chat) or raw text (completions), plus its logprobs and finish reason. The ids -> text step and the
finish reason are the engine's `SequenceDecoder` (`engine/detokenizer.py`), the same as the offline `LLM`'s.

Stop strings: a completion matches them on the raw text (the detokenizer); a chat answer on its
user-visible content only, after the parser (`server.cutoffs`), so reasoning and tool-call markup never
stop it. `ChoiceDecoder.push(output)` returns the new deltas of one engine step; `done` tells when the
choice ended (engine finish, a stop string, or the single tool call of `parallel_tool_calls: false`;
the caller then closes the engine stream, which aborts the request).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from k3serve.chat.parsers import ContentDelta, Delta, ParsedMessage, StreamParser, ToolCallStart, collect
from k3serve.engine.detokenizer import SequenceDecoder
from k3serve.engine.messages import Output
from k3serve.server.cutoffs import Cutoff


def token_str(decode_bytes: Callable[[list[int]], bytes], token_id: int) -> tuple[str, list[int]]:
    data = decode_bytes([token_id])
    return data.decode("utf-8", errors="replace"), list(data)


class ChoiceDecoder:
    """`parser` None = raw text (completions, `stop` on the raw text); with a parser, `stop` applies
    to content and `one_call` keeps at most one tool call. `skip_ids` are dropped before decoding.
    Text and the finish reason come from the engine's `SequenceDecoder`; a content cut is handed to it."""

    def __init__(self, index: int, decode_bytes: Callable[[list[int]], bytes], *, stop: Sequence[str] = (),
                 parser: StreamParser | None = None, skip_ids: frozenset[int] = frozenset(),
                 eos_ids: Sequence[int] = (), one_call: bool = False):
        self.index = index
        self._decode_bytes = decode_bytes
        self.parser = parser
        self.seq = SequenceDecoder(decode_bytes, stop=stop if parser is None else (), skip_ids=skip_ids,
                                   eos_ids=eos_ids)
        cut = Cutoff(stop, one_call=one_call) if parser is not None else None
        self._cut = cut if cut is not None and cut.active else None
        self.deltas: list[Delta] = []
        self.num_tokens = 0
        self.step_tokens = 0  # token ids in the last engine step (its text may be empty)
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.handoff = None  # an engine HandoffSource, from the prefill role's last output
        self.num_calls = 0
        self.logprobs: list[tuple[int, dict[int, float]]] = []
        self.done = False

    @property
    def text(self) -> str:
        """The raw text so far (completions)."""
        return self.seq.text

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    def push(self, out: Output) -> tuple[list[Delta] | str, list[tuple[int, dict[int, float]]]]:
        """New deltas (or raw text without a parser) and the logprobs of this step's tokens."""
        ids = out.token_ids
        self.step_tokens = len(ids)
        self.num_tokens += len(ids)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.handoff = out.handoff or self.handoff  # prefill role: where the caches wait for a decode worker
        lps = list(zip(ids, out.logprobs)) if out.logprobs else []
        if lps:
            self.logprobs += lps
        text = self.seq.push(ids, out.finished, out.finish_reason, out.stop_reason)
        if self.parser is None:
            self.done = self.seq.done
            return text, lps
        return self._push_chat(out, text), lps

    def _push_chat(self, out: Output, text: str) -> list[Delta]:
        parser = self.parser
        deltas = parser.feed(text) if text else []
        if out.finished:
            deltas += parser.finish()
        cut = self._cut
        if cut is not None:
            deltas = cut.push(deltas, parser.calls_finished)
            if cut.done:
                self.seq.cut(cut.stopped_on)
            elif out.finished:
                deltas += cut.flush()
        self.done = self.seq.done
        for d in deltas:
            if type(d) is ToolCallStart:
                self.num_calls += 1
        self.deltas += deltas
        return deltas

    @property
    def stopped_on(self) -> str | None:
        """The stop string that ended the choice (on the raw text, or on the content)."""
        reason = self.seq.stop_reason
        return reason if isinstance(reason, str) else None

    def message(self) -> ParsedMessage:
        return collect(self.deltas)

    def final_finish_reason(self) -> str:
        """`tool_calls` whenever calls were parsed and generation was not cut (K2VV/KVV rule)."""
        if self.finish_reason == "length":
            return "length"
        if self.num_calls:
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
