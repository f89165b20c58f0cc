"""Local K3 rendering and tokenizing: what ``usage.prompt_tokens`` must be for a request (chat_format_examples.md
§3.3: the rendered ids, images expanded to their vision tokens, minus the 3-token generation-channel stub that
Moonshot does not count)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def tokenizer():
    from k3serve.tokenizer import Tokenizer

    return Tokenizer.kimi("k3")


def render_ids(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, thinking: bool = True,
               response_format: dict[str, Any] | None = None,
               image_sizes: tuple[tuple[int, int], ...] = ()) -> tuple[list[int], int]:
    """(prompt ids before image expansion, the stub's length) for a K3 chat request."""
    from k3serve.chat import K3, ChatOptions

    options = ChatOptions(thinking=thinking, effort="max", response_format=response_format, image_sizes=image_sizes)
    prompt = K3.render(messages, tools, options)
    tok = tokenizer()
    return tok.encode_segments(prompt.token_segments()).tolist(), prompt.stub_ids(tok.encode_segments)


def expected_prompt_tokens(messages: list[dict[str, Any]], **kw: Any) -> tuple[int, int]:
    """(Moonshot-style count without the stub, the full length) of a K3 chat request."""
    from k3serve.models.vision_preprocess import num_image_tokens

    ids, stub = render_ids(messages, **kw)
    pads = sum(num_image_tokens(w, h) - 1 for w, h in kw.get("image_sizes", ()))
    return len(ids) + pads - stub, len(ids) + pads
