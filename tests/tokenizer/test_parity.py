"""Token-identical to tiktoken 0.14 (Kimi pattern + Kimi's 400k/25k cuts) on real and adversarial
text, and decode(encode(x)) == x."""

from __future__ import annotations

import random

import pytest

from k3serve.tokenizer.reference import kimi_cuts, tiktoken_encode


def check(tok, enc, text: str) -> None:
    ids = tok.encode(text)
    expect = tiktoken_encode(enc, text)
    if ids.tolist() != expect:
        got = ids.tolist()
        i = next((k for k in range(min(len(got), len(expect))) if got[k] != expect[k]), min(len(got), len(expect)))
        pytest.fail(f"first difference at token {i}: got {[enc.decode([t]) for t in got[i:i + 4]]}, "
                    f"want {[enc.decode([t]) for t in expect[i:i + 4]]}")
    assert tok.decode(ids) == text
    assert tok.count(text) == len(expect)


@pytest.mark.parametrize("name", ["prose", "code", "cjk", "json", "base64", "base64_lines", "hex", "digits"])
def test_corpora(tok, enc, texts, name):
    check(tok, enc, texts[name])


def test_corpora_raw_equals_single_tiktoken_call(enc, texts):
    """With the cuts off, the result is one plain tiktoken call."""
    from k3serve.tokenizer import Tokenizer

    raw = Tokenizer.kimi(kimi_cuts=False)
    for name in ("prose", "code", "cjk"):
        assert raw.encode(texts[name]).tolist() == enc.encode_ordinary(texts[name])


ADVERSARIAL = {
    "a_25000": "a" * 25_000,
    "a_25001": "a" * 25_001,
    "a_100k": "a" * 100_000,
    "x_spaces_y": "x" + " " * 100_000 + "y",
    "spaces_60k": " " * 60_000,
    "fs_30k": "\x1c" * 30_000,  # isspace but not regex \s
    "nel_30k": "\x85" * 30_000,
    "ideographic_space_30k": "\u3000" * 30_000,
    "zwsp_30k": "\u200b" * 30_000,  # neither
    "mixed_60k": "ab \x1c\u3000" * 12_000,
    "han_30k": "".join(chr(random.Random(1).randint(0x4E00, 0x9FFF)) for _ in range(30_000)),
    "newlines": "\n" * 30_000 + "x" + "\r\n" * 20_000,
    "punct_run": "=-" * 20_000 + "\n\n",
    "long_line_450k": ("lorem ipsum dolor sit amet, " * 20_000)[:450_000],
    "line_820k_b64": __import__("base64").b64encode(random.Random(2).randbytes(615_000)).decode(),
    "random_lower_60k": "".join(random.Random(3).choices("abcdefghijklmnopqrstuvwxyz", k=60_000)),
    "digits_60k": "".join(random.Random(4).choices("0123456789", k=60_000)),
    "emoji_run": "👍🏽" * 15_000,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial(tok, enc, name):
    check(tok, enc, ADVERSARIAL[name])


def test_cut_parts_match_reference(tok):
    for name, text in ADVERSARIAL.items():
        assert tok._core.cut_parts(text) == kimi_cuts(text), name


def test_over_400k_with_multibyte_boundaries(tok, enc):
    rnd = random.Random(5)
    words = ["héllo", "wörld", "日本語", "🙂", "ascii", "  ", "\n", "ẞ", "x" * 30]
    text = "".join(rnd.choice(words) for _ in range(160_000))
    assert len(text) > 400_000
    check(tok, enc, text)


def test_empty_and_tiny(tok, enc):
    for text in ["", " ", "\n", "a", "中", "'s", " 's", "\r\n", "\t\t", "  x"]:
        check(tok, enc, text)
