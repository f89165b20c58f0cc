"""The three merge paths (small O(n^2), heap, linear backtracking) give tiktoken's merge order."""

from __future__ import annotations

import random

import pytest

from k3serve.tokenizer import Tokenizer
from k3serve.tokenizer.reference import bpe

SMALL, HEAP, LINEAR = 1, 2, 3
LINEAR_ONLY = 4  # the linear encoder without the heap fallback: empty if it fails
ALPHABETS = ["ab", "abcdefghijklmnopqrstuvwxyz", "aeiou rst", "0123456789abcdef", "=-+", " \t",
             "日本語中文", "абвгд", "éèêë", "🙂👍"]


def random_pieces(n: int, seed: int, lo: int = 2, hi: int = 127) -> list[bytes]:
    rnd = random.Random(seed)
    return [("".join(rnd.choices(rnd.choice(ALPHABETS), k=rnd.randint(lo, hi)))).encode()[:hi]
            for _ in range(n)]


def test_linear_encoder_is_enabled(tok):
    assert tok._core.linear_ok()


def test_paths_agree_with_reference(tok, ranks):
    for p in random_pieces(600, seed=1):
        want = bpe(p, ranks)
        if p in ranks:
            continue  # the whole-piece lookup answers these before any merging
        for mode in (SMALL, HEAP, LINEAR):
            assert tok._core.bpe(p, mode).tolist() == want, (mode, p)


def test_linear_matches_heap_on_long_pieces(tok):
    pieces = random_pieces(40, seed=2, lo=128, hi=20_000) + [b"a" * 25_000, b" " * 25_000, b"ab" * 9_000]
    for p in pieces:
        assert tok._core.bpe(p, LINEAR).tolist() == tok._core.bpe(p, HEAP).tolist(), p[:40]


def test_long_single_piece_matches_tiktoken(enc):
    # the benchmark's case: one 100k-character piece (no cuts), through the linear encoder
    t = Tokenizer.kimi(kimi_cuts=False)
    rnd = random.Random(2)
    for alphabet in ("abcdefghijklmnopqrstuvwxyz", "ab", "aeiou", "qxzj"):
        text = "".join(rnd.choices(alphabet, k=100_000))
        assert t.encode(text).tolist() == enc.encode_ordinary(text), alphabet


# Alphabets whose tokens are mostly one to three bytes long: the linear encoder's shortcuts for short
# tokens (splits read from the bytes, merges known from the walk at a token's start) do most of the
# work there, next to its general pair check for longer tokens.
SHORT_TOKEN_ALPHABETS = [b"abcdefghijklmnopqrstuvwxyz", b"qxzjvkw", b"etaoinshr", b"aAbBcCdDeE",
                         b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", b"ab ",
                         "éèàùçôî".encode(), "日本語中文字".encode(), bytes(range(256)), bytes(range(0x80, 0x100))]


def short_token_pieces(n: int, seed: int, lo: int, hi: int) -> list[bytes]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        alphabet = rnd.choice(SHORT_TOKEN_ALPHABETS)
        out.append(bytes(rnd.choices(alphabet, k=rnd.randint(lo, hi))))
    return out


def test_linear_matches_heap_on_short_token_alphabets(tok):
    for p in short_token_pieces(300, seed=4, lo=128, hi=4000):
        assert tok._core.bpe(p, LINEAR).tolist() == tok._core.bpe(p, HEAP).tolist(), p[:40]


def test_linear_matches_heap_on_three_byte_tokens(tok, ranks):
    # pieces glued from vocabulary tokens of one to three bytes, half of them of three: most pair
    # checks then pair a three-byte token with a short one, which the linear encoder answers from
    # the bytes (small_pairs.h: the split of each three-byte token, and merges into three bytes)
    rnd = random.Random(6)
    short = sorted(t for t in ranks if len(t) <= 3)
    three = [t for t in short if len(t) == 3]
    for _ in range(400):
        p = b"".join(rnd.choice(three if rnd.random() < 0.5 else short) for _ in range(rnd.randint(20, 400)))
        assert tok._core.bpe(p, LINEAR).tolist() == tok._core.bpe(p, HEAP).tolist(), p[:40]


def test_linear_matches_heap_around_dead_ends(tok, ranks):
    # A two-byte token x y followed by z where y z ranks below x y can be followed only by a token
    # whose prefix token of rank below y z takes z first; the linear encoder skips such a token
    # when there is none (linear_bpe.h, dead_end) instead of taking it and backing up. It does so
    # only in the loop for varied ASCII pieces, so the pieces here are ASCII, glued from such
    # triples, three-byte tokens (which end in y too) and two-byte tokens: both answers occur.
    # A wrong skip can make the encoder fail (it then falls back to the heap merge, so LINEAR would
    # still match), or fail LinearBpe's self-check, which turns it off: hence LINEAR_ONLY and the
    # first assert.
    assert tok._core.linear_ok()
    rnd = random.Random(7)
    two = [t for t in ranks if len(t) == 2 and t.isascii()]
    by_first = {}
    for t in two:
        by_first.setdefault(t[0], []).append(t)
    triples = []
    for t in two:
        for z in by_first.get(t[1], []):  # y z is a token; keep those that merge before x y
            if ranks[z] < ranks[t]:
                triples.append(t + z[1:])
    three = [t for t in ranks if len(t) == 3 and t.isascii()]
    assert len(triples) > 1000
    for _ in range(300):
        frags = []
        for _ in range(rnd.randint(10, 200)):
            r = rnd.random()
            if r < 0.6:
                frags.append(rnd.choice(triples))
            elif r < 0.8:
                frags.append(rnd.choice(three))
            else:
                frags.append(rnd.choice(two))
        p = b"".join(frags)
        assert tok._core.bpe(p, LINEAR_ONLY).tolist() == tok._core.bpe(p, HEAP).tolist(), p[:40]
    # random letters too (the benchmark's case: most dead ends follow two- and three-byte tokens)
    for _ in range(20):
        p = bytes(rnd.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(100, 5000)))
        assert tok._core.bpe(p, LINEAR_ONLY).tolist() == tok._core.bpe(p, HEAP).tolist(), p[:40]


@pytest.mark.slow
def test_linear_matches_heap_many(tok):
    for p in random_pieces(20_000, seed=3, lo=2, hi=600):
        assert tok._core.bpe(p, LINEAR).tolist() == tok._core.bpe(p, HEAP).tolist(), p
    for p in short_token_pieces(5_000, seed=5, lo=2, hi=2000):
        assert tok._core.bpe(p, LINEAR).tolist() == tok._core.bpe(p, HEAP).tolist(), p[:40]
