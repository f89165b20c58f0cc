"""What the engine hands back per request and step: plain data (ints, strings, lists), so it can cross a
process boundary as a typed message."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str = ""  # the finished sequence's text (filled by ``LLM`` from its SequenceDecoder; the engine has none)
    delta_token_ids: list[int] = field(default_factory=list)  # new in this step
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" (LLM: a stop string's "stop" too)
    stop_reason: int | str | None = None  # the stop token id (LLM: or stop string) that ended it
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class CompletionGroup:
    """``LLM.generate``'s result for one prompt: ``n`` completions; the fields of the first are mirrored."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[RequestOutput]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        return self.outputs[0].prompt_logprobs
