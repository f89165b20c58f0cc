"""Differential fuzz against tiktoken (and, on a sample, the pure-Python reference), built from a
pool of characters that stress the pattern: case folding (ſ, Kelvin K), marks, Han next to kana and
letters, \\s vs isspace differences, contractions, CRLF, emoji with modifiers, special tokens."""

from __future__ import annotations

import random

import pytest

POOL = (
    list("abcxyzABCXYZ0123456789 ''\"!?.,;:-_/\\()[]{}<>|=+*&^%$#@~`\t\r\n")
    + ["ſ", "\u212a", "\u0301", "\u0308", "\u20dd", "é", "Ñ", "ß", "ǅ", "ʰ", "ª", "中", "文", "〇", "々",
       "\u2e80", "カ", "ひ", "한", "ก", "\u0e31", "ع", "\u064b", "Ω", "д", "Ж", "\x0b", "\x0c", "\x1c",
       "\x1f", "\x85", "\xa0", "\u2028", "\u3000", "\u200b", "\ufeff", "\U0001f44d", "\U0001f3fd", "\u200d",
       "\U0001f468", "𝐀", "𝑎", "①", "½", "\U00020000", "\U000e0001", "\ufffd", "\x00", "\x7f"]
    + ["'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'D", "'ſ", "  ", "\r\n", " \n ", "<|im_end|>",
       "<|open|>", "[EOS]", "<think>", "<|reserved_token_163700|>", "hello", " World", "CamelCase"]
)


def fuzz_strings(n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(rnd.choices(POOL, k=rnd.randint(0, 24))) for _ in range(n)]


def run_fuzz(tok, enc, n: int, seed: int) -> None:
    strings = fuzz_strings(n, seed)
    got = tok.encode_batch(strings)
    want = enc.encode_ordinary_batch(strings)
    bad = [s for s, g, w in zip(strings, got, want) if g.tolist() != w]
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:3]!r}"
    joined = "\x00".join(strings)
    assert tok.decode(tok.encode(joined)) == joined


def test_fuzz_10k(tok, enc):
    run_fuzz(tok, enc, 10_000, seed=1)


@pytest.mark.slow
def test_fuzz_100k(tok, enc):
    run_fuzz(tok, enc, 100_000, seed=2)


def test_fuzz_with_specials_allowed(tok, enc):
    for s in fuzz_strings(3000, seed=3):
        assert tok.encode(s, allowed_special="all").tolist() == enc.encode(s, allowed_special="all"), s


def test_fuzz_against_python_reference(tok, ref):
    for s in fuzz_strings(1500, seed=4):
        assert tok.encode(s).tolist() == ref.encode(s), s
        assert tok.encode(s, allowed_special="all").tolist() == ref.encode(s, "all"), s


def test_pieces_match_reference_pretokenizer(tok):
    from k3serve.tokenizer.reference import pretokenize

    for s in fuzz_strings(3000, seed=5):
        assert tok._core.pieces(s, False) == pretokenize(s), s
