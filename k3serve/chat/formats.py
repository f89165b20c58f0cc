"""Chat formats and the selector: the model's `model_type` picks the renderer + parser pair.

    fmt = chat_format_for("kimi_k3")
    prompt = fmt.render(messages, tools, ChatOptions(thinking=False))
    ids = prompt.encode(tokenizer.encode_segments)
    parser = fmt.new_parser(prompt, tools)      # one per request
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3serve.chat import k2, k3
from k3serve.chat.parsers import K2Parser, K3Parser, StreamParser
from k3serve.chat.request import ChatOptions
from k3serve.chat.segments import Prompt

STOP_TOKEN_ID = 163586  # <|end_of_msg|> in K3, <|im_end|> in K2: same id


@dataclass(frozen=True)
class ChatFormat:
    """`k2_style` is None for K3."""

    name: str
    k2_style: k2.K2Style | None = None

    @property
    def is_k3(self) -> bool:
        return self.k2_style is None

    @property
    def stop_token(self) -> str:
        return "<|end_of_msg|>" if self.is_k3 else "<|im_end|>"

    def check_request(self, tools: Sequence[Mapping[str, Any]] | None, options: ChatOptions) -> None:
        """K2 templates cannot state a response format; with tools that may be called the
        format would be silently lost, so reject the pair (SGLang does the same). K3 renders
        both, and Moonshot's K3 ground truth combines them."""
        if self.is_k3 or not tools or options.tool_choice == "none":
            return
        if options.response_format_type != "text":
            raise ValueError("response_format json_object/json_schema cannot be combined with tools for this "
                             "model unless tool_choice is 'none'")

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               options: ChatOptions = ChatOptions()) -> Prompt:
        self.check_request(tools, options)
        if self.is_k3:
            return k3.render(messages, tools, options)
        return k2.render(messages, tools, options, style=self.k2_style)

    def new_parser(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None) -> StreamParser:
        """A fresh parser for one response to `prompt`. The tool parser always runs, with or
        without `tools`, so tool markup never leaks as content (B19)."""
        if self.is_k3:
            return K3Parser(thinking=prompt.thinking, tools=tools, next_call_index=prompt.next_call_index)
        return K2Parser(reasoning=prompt.thinking, tools=tools, next_call_index=prompt.next_call_index)


K3 = ChatFormat("kimi_k3")
K25 = ChatFormat("kimi_k25", k2.K25)
K2_INSTRUCT = ChatFormat("kimi_k2", k2.K2_INSTRUCT)
K2_THINKING = ChatFormat("kimi_k2_thinking", k2.K2_THINKING)
_BY_NAME = {f.name: f for f in (K3, K25, K2_INSTRUCT, K2_THINKING)}
_ALIASES = {"kimi_k2_5": "kimi_k25", "kimi_k26": "kimi_k25", "kimi_k27": "kimi_k25"}


def chat_format_for(model_type: str, variant: str | None = None) -> ChatFormat:
    """K3 for `kimi_k3`; the K2 family otherwise (K2.5 template for kimi_k25/26/27, the
    K2-Instruct template for other types). `variant` names a format explicitly, e.g.
    `kimi_k2_thinking`, for checkpoints whose model_type does not tell."""
    if variant is not None:
        name = _ALIASES.get(variant, variant)
        if name not in _BY_NAME:
            raise ValueError(f"unknown chat format {variant!r}; known: {', '.join(sorted(_BY_NAME))}")
        return _BY_NAME[name]
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty string, got {model_type!r}")
    name = _ALIASES.get(model_type, model_type)
    if name in ("kimi_k3", "kimi_k25"):
        return _BY_NAME[name]
    return K2_INSTRUCT
