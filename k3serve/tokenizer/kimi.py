"""Kimi tokenizer constants: the pre-tokenizer pattern, the shipped vocabulary, special-token names.

Facts from design/tokenizer.md §1 and design/frontend.md §1.5. The vocabulary (163,584 ranks) and
tokenizer_config.json are MoonshotAI's (MIT, see data/README.md).
"""

from __future__ import annotations

import json
import pathlib

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
VOCAB_PATH = DATA_DIR / "tiktoken.model"
CONFIG_PATH = DATA_DIR / "tokenizer_config.json"
VOCAB_SHA256 = "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"

# Kimi's pat_str, alternative by alternative (identical for K2, K2.5, Kimi-Linear and K3).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

NUM_BASE_TOKENS = 163_584
NUM_RESERVED_SPECIAL = 256

# K3 renames some control tokens (design/frontend.md §1.5; re-verify against the official K3 files).
# Ids not listed keep the reserved name.
K3_NAMES: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|end_of_msg|>",
    163587: "<|open|>",
    163588: "<|close|>",
    163589: "<|sep|>",
    163590: "[start_header_id]",
    163591: "[end_header_id]",
    163593: "[EOT]",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163838: "[UNK]",
    163839: "[PAD]",
}


def k2_names() -> dict[int, str]:
    """Named special ids from the shipped tokenizer_config.json (Kimi K2.5)."""
    config = json.loads(CONFIG_PATH.read_text())
    return {int(i): entry["content"] for i, entry in config["added_tokens_decoder"].items()}


def special_tokens(variant: str = "k2") -> dict[str, int]:
    """All 256 special tokens, name -> id; unnamed ids are ``<|reserved_token_{id}|>`` as in
    tokenization_kimi.py."""
    if variant == "k2":
        names = k2_names()
    elif variant == "k3":
        names = K3_NAMES
    else:
        raise ValueError(f"unknown Kimi variant {variant!r} (expected 'k2' or 'k3')")
    first = NUM_BASE_TOKENS
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, first + NUM_RESERVED_SPECIAL)}
