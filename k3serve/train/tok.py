"""The K3 tokenizer for training and evaluation: the native ``k3serve.tokenizer`` (``kimi``, K3 special
names), or, when its extension is not built, tiktoken over the shared Kimi vocabulary with the same
pattern and specials (per-segment encoding, specials only where allowed: identical ids).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path

SHARED_VOCAB = Path("/work/shared/tokenizers/kimi/tiktoken.model")
NUM_BASE = 163_584
# Same as k3serve.tokenizer.kimi.KIMI_PATTERN / K3_NAMES; repeated because that package cannot be
# imported at all without its extension.
_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
_K3_SPECIALS = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>",
                163588: "<|close|>", 163589: "<|sep|>", 163602: "<|media_begin|>", 163603: "<|media_content|>",
                163604: "<|media_end|>", 163605: "<|media_pad|>", 163838: "[UNK]", 163839: "[PAD]"}


class TiktokenK3:
    """The subset of the ``Tokenizer`` API the trainer and evaluator use."""

    def __init__(self, vocab: Path = SHARED_VOCAB):
        import tiktoken

        ranks = {}
        for line in vocab.read_bytes().splitlines():
            if line:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        names = {i: _K3_SPECIALS.get(i, f"<|reserved_token_{i}|>") for i in range(NUM_BASE, NUM_BASE + 256)}
        self.enc = tiktoken.Encoding("kimi-k3", pat_str=_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={v: k for k, v in names.items()})
        self.n_vocab = NUM_BASE + 256

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        out: list[int] = []
        for text, allow in segments:
            out += self.enc.encode(text, allowed_special="all") if allow else self.enc.encode(text, disallowed_special=())
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode([int(i) for i in ids])


def load_tokenizer():
    try:
        from k3serve.tokenizer import Tokenizer
    except ImportError:
        return TiktokenK3()
    return Tokenizer.kimi(variant="k3")
