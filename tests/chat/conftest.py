"""Parser chunking helpers, and a test tokenizer built straight from tiktoken: the Kimi vocabulary, pattern and 256 specials.

Independent of k3serve.tokenizer so the goldens do not wait on the native build; K3 and K2 name
the same ids differently (design/frontend.md §1.1, §1.5).
"""

from __future__ import annotations

import base64
import json
import pathlib
import random
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace

import pytest
import tiktoken

from k3serve.chat.parsers import ContentDelta, ReasoningDelta, StreamParser, collect
from k3serve.chat.parsers.deltas import Delta, ParsedMessage
from k3serve.tokenizer.kimi import KIMI_PATTERN, VOCAB_PATH

# The vocabulary shipped in the package (a byte copy of shared/tokenizers/kimi, MIT); the pattern is a fact
# of the format, taken from the package rather than written out again.
KIMI_DIR = VOCAB_PATH.parent
PATTERN = KIMI_PATTERN
K3_NAMES = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
            163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]", 163593: "[EOT]",
            163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
            163605: "<|media_pad|>", 163838: "[UNK]", 163839: "[PAD]"}
DATA = pathlib.Path(__file__).parent / "data" / "goldens.json"


class SegmentEncoder:
    """`encode_segments([(text, allow_special), ...])` over a tiktoken Encoding."""

    def __init__(self, enc: tiktoken.Encoding):
        self.enc = enc

    def __call__(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        ids: list[int] = []
        for text, allow in segments:
            if allow:
                ids += self.enc.encode(text, allowed_special="all")
            else:
                ids += self.enc.encode(text, allowed_special=set(), disallowed_special=())
        return ids

    def whole(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def special_ids(self) -> set[int]:
        return set(self.enc._special_tokens.values())


def _encoding(variant: str) -> tiktoken.Encoding:
    ranks = {}
    for line in (KIMI_DIR / "tiktoken.model").read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if variant == "k3":
        names = K3_NAMES
    else:
        cfg = json.loads((KIMI_DIR / "tokenizer_config.json").read_text())
        names = {int(i): e["content"] for i, e in cfg["added_tokens_decoder"].items()}
    n = len(ranks)
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding(f"kimi-{variant}-test", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="session")
def k3_encode() -> SegmentEncoder:
    return SegmentEncoder(_encoding("k3"))


@pytest.fixture(scope="session")
def k2_encode() -> SegmentEncoder:
    return SegmentEncoder(_encoding("k2"))


@pytest.fixture(scope="session")
def goldens() -> dict:
    return json.loads(DATA.read_text())


K2_MARKERS = ("<|tool_call", "<think>", "</think>", "<|im_end|>", "_section_", "<|tool_calls")
K3_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def stream(make: Callable[[], StreamParser], chunks: Iterable[str | bytes]) -> list[Delta]:
    p = make()
    out: list[Delta] = []
    for c in chunks:
        out += p.feed(c)
    return out + p.finish()


def chunkings(text: str, *, every_split: bool = True, seed: int = 0) -> Iterable[list[str | bytes]]:
    """Whole; cut in two at every position; 1, 2, 3 and 7 characters at a time; one byte at a
    time; random cuts."""
    yield [text]
    if every_split:
        for i in range(1, len(text)):
            yield [text[:i], text[i:]]
    for n in (1, 2, 3, 7):
        yield [text[i:i + n] for i in range(0, len(text), n)]
    data = text.encode()
    yield [data[i:i + 1] for i in range(len(data))]
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(12, max(len(text) - 1, 0))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check_all_ways(make: Callable[[], StreamParser], text: str, expected: ParsedMessage,
                   markers: tuple[str, ...], *, every_split: bool = True) -> None:
    """Every chunking gives `expected`; no reasoning/content delta carries a marker; the
    non-streaming `parse` agrees."""
    assert make().parse(text) == expected
    for chunks in chunkings(text, every_split=every_split):
        deltas = stream(make, chunks)
        got = collect(deltas)
        assert got == expected, f"chunks={chunks!r}"
        for d in deltas:
            if isinstance(d, ContentDelta | ReasoningDelta):
                assert not any(m in d.text for m in markers), f"marker leaked in {d!r} for chunks={chunks!r}"


@pytest.fixture(scope="session")
def chunked() -> SimpleNamespace:
    """Helpers for adversarially chunked parser runs."""
    return SimpleNamespace(K2=K2_MARKERS, K3=K3_MARKERS, stream=stream, check=check_all_ways, chunkings=chunkings)
