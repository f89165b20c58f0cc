"""Samples -> token ids with the real K3 renderer and Kimi tokenizer, and model output -> parsed answer.

``encode_sample`` returns ``(ids, n_prompt)``: ``ids[:n_prompt]`` is exactly what the server feeds the model
for the request (the generation prompt ends with ``<|open|>think<|sep|>`` or ``<|open|>response<|sep|>``),
``ids[n_prompt:]`` is the assistant continuation through ``<|end_of_msg|>``: the only tokens with loss.
The continuation is cut from a render of the conversation *with* the answer, so it is byte-identical to
how the renderer writes that message into a later turn's history.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from k3serve.chat import K3, ChatOptions
from training.tasks import Sample

STOP_ID = 163586  # <|end_of_msg|>


def request_options(s: Sample, *, add_generation_prompt: bool = True, with_format: bool = True) -> ChatOptions:
    return ChatOptions(thinking=s.thinking, effort=s.effort, tool_choice=None,
                       response_format=s.response_format if with_format else None,
                       add_generation_prompt=add_generation_prompt)


def prompt_ids(s: Sample, tokenizer) -> list[int]:
    return K3.render(s.messages, s.tools, request_options(s)).encode(tokenizer.encode_segments)


def continuation_segments(s: Sample) -> list[tuple[str, bool]]:
    """The answer's segments after the channel-open stub, through ``<|end_of_msg|>``."""
    head = K3.render(s.messages, s.tools, request_options(s, with_format=False)).token_segments()
    full = K3.render([*s.messages, s.target], s.tools,
                     request_options(s, add_generation_prompt=False, with_format=False)).token_segments()
    if full[:len(head)] != head:
        raise ValueError(f"{s.kind}: the rendered answer does not extend the generation prompt")
    return full[len(head):]


def encode_sample(s: Sample, tokenizer) -> tuple[list[int], int]:
    prompt = prompt_ids(s, tokenizer)
    cont = [int(i) for i in tokenizer.encode_segments(continuation_segments(s))]
    if not cont or cont[-1] != STOP_ID:
        raise ValueError(f"{s.kind}: the answer does not end with <|end_of_msg|>")
    return prompt + cont, len(prompt)


def encode_turns(s: Sample, tokenizer) -> tuple[list[int], int, tuple[tuple[int, int], ...]]:
    """``encode_sample`` plus the ``(start, end)`` span of every assistant message: the earlier ones in
    ``s.messages`` as well as the target. The renderer writes a history turn exactly as it writes a fresh
    answer, so each span is what the model generates after that turn's generation prompt."""
    ids, n_prompt = encode_sample(s, tokenizer)
    spans = []
    for j, m in enumerate(s.messages):
        if m["role"] == "assistant":
            turn, start = encode_sample(replace(s, messages=s.messages[:j], target=m, response_format=None), tokenizer)
            if ids[:len(turn)] != turn:
                raise ValueError(f"{s.kind}: assistant turn {j} is not rendered as a prefix of the conversation")
            spans.append((start, len(turn)))
    return ids, n_prompt, (*spans, (n_prompt, len(ids)))


def parse_message(s: Sample, text: str) -> dict[str, Any]:
    """The OpenAI assistant message (content, reasoning_content, tool_calls) the server's K3 parser makes of
    the generated text."""
    parser = K3.new_parser(K3.render(s.messages, s.tools, request_options(s)), s.tools)
    return parser.parse(text).to_openai()


def parse_output(s: Sample, text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) from the generated text, using the server's K3 parser."""
    msg = parse_message(s, text)
    return msg.get("content") or "", list(msg.get("tool_calls") or [])
