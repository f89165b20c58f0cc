"""Renderer output: an ordered list of segments that the tokenizer encodes one by one.

A `TextSegment` is a `(text, allow_special)` pair. Only the renderer ever sets `allow_special`; every
piece of user, tool or system text (and, for K3, every tag name and attribute fragment) is a
segment with `allow_special=False`, so typed `<|im_end|>` or `<|open|>` stays plain bytes.
An `ImageSegment` stands for one image: the server encodes its `prompt` (specials allowed, one
`<|media_pad|>`) and expands the pad to the image's vision-token count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

MEDIA_PAD = "<|media_pad|>"


class TextSegment(NamedTuple):
    """`(text, allow_special)`; unpacks like the tuple `Tokenizer.encode_segments` takes."""

    text: str
    allow_special: bool


@dataclass(frozen=True)
class ImageSegment:
    """One image: its position among the request's images, original size and prompt text."""

    index: int
    width: int
    height: int
    prompt: str

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"image index must be >= 0, got {self.index}")
        if self.width <= 0 or self.height <= 0:
            raise ValueError(f"image size must be positive, got {self.width}x{self.height}")
        if self.prompt.count(MEDIA_PAD) != 1:
            raise ValueError("an image prompt must hold exactly one <|media_pad|>")


Segment = TextSegment | ImageSegment


@dataclass(frozen=True)
class Prompt:
    """A rendered conversation.

    `stub` is the number of trailing segments that open the generation channel (K3:
    `<|open|>think<|sep|>` or `<|open|>response<|sep|>`, 3 segments); Moonshot's verifier
    counts `usage.prompt_tokens` without those ids (chat_format_examples.md §3.3).
    `thinking` tells the parser whether generation starts inside the reasoning channel.
    `next_call_index` is the conversation-global number of the next tool call (K2 ids).
    """

    segments: tuple[Segment, ...]
    stub: int = 0
    thinking: bool = False
    next_call_index: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.stub <= len(self.segments):
            raise ValueError(f"stub {self.stub} out of range for {len(self.segments)} segments")

    @property
    def images(self) -> tuple[ImageSegment, ...]:
        return tuple(s for s in self.segments if isinstance(s, ImageSegment))

    def token_segments(self, image_text: str | None = None) -> list[tuple[str, bool]]:
        """`(text, allow_special)` pairs for `encode_segments`. Images become their prompt (one
        pad, specials allowed) or, with `image_text`, that string as plain text."""
        out: list[tuple[str, bool]] = []
        for s in self.segments:
            if isinstance(s, TextSegment):
                out.append((s.text, s.allow_special))
            elif image_text is None:
                out.append((s.prompt, True))
            else:
                out.append((image_text, False))
        return out

    def text(self, image_text: str | None = None) -> str:
        return "".join(t for t, _ in self.token_segments(image_text))

    def encode(self, encode_segments: Callable[[Sequence[tuple[str, bool]]], Sequence[int]]) -> list[int]:
        """Token ids before image-pad expansion, using the given segment encoder."""
        return [int(i) for i in encode_segments(self.token_segments())]

    def stub_ids(self, encode_segments: Callable[[Sequence[tuple[str, bool]]], Sequence[int]]) -> int:
        """How many of the trailing ids belong to the generation-channel stub."""
        if not self.stub:
            return 0
        return len(encode_segments(self.token_segments()[-self.stub:]))


class SegmentBuilder:
    """Collects segments; drops empty text. With `merge_text`, adjacent plain-text pieces are
    joined (K2 templates render one string, so text between two control tokens is one BPE run)."""

    def __init__(self, *, merge_text: bool = False):
        self._merge = merge_text
        self._out: list[Segment] = []

    def control(self, text: str) -> None:
        if text:
            self._out.append(TextSegment(text, True))

    def text(self, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if self._merge and isinstance(last, TextSegment) and not last.allow_special:
            self._out[-1] = TextSegment(last.text + text, False)
        else:
            self._out.append(TextSegment(text, False))

    def image(self, segment: ImageSegment) -> None:
        self._out.append(segment)

    def __len__(self) -> int:
        return len(self._out)

    def build(self, *, stub: int = 0, thinking: bool = False, next_call_index: int = 0) -> Prompt:
        return Prompt(tuple(self._out), stub=stub, thinking=thinking, next_call_index=next_call_index)
