"""Unicode coverage: the native class tables equal the generated reference tables for every code
point, and every Unicode scalar value tokenizes as tiktoken 0.14 does."""

from __future__ import annotations

import pytest

from k3serve.tokenizer import _native, unicode_data

SCALARS = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]


def test_class_tables_match_reference():
    flags = {"HAN": _native.HAN, "L": _native.LETTER, "N": _native.NUMBER, "UPPER": _native.UPPER,
             "LOWER": _native.LOWER, "WS": _native.WS, "PYSPACE": _native.PYSPACE}
    expect = [0] * 0x110000
    for name, bit in flags.items():
        for lo, hi in unicode_data.RANGES[name]:
            for c in range(lo, hi + 1):
                expect[c] |= bit
    mask = sum(flags.values())
    bad = [c for c in range(0x110000) if _native.classify(c) & mask != expect[c]]
    assert not bad, [hex(c) for c in bad[:10]]


def test_pyspace_table_is_str_isspace():
    spaces = {c for lo, hi in unicode_data.RANGES["PYSPACE"] for c in range(lo, hi + 1)}
    assert spaces == {c for c in range(0x110000) if chr(c).isspace()}


def _chunks(template: str, size: int = 40_000):
    for i in range(0, len(SCALARS), size):
        yield "".join(template.format(c=chr(c)) for c in SCALARS[i:i + size])


def test_every_scalar_in_context(tok, enc):
    """All 1,112,064 scalar values, each between letters and doubled, in 40k-value chunks."""
    for chunk in _chunks("a{c}b {c}{c}z\n"):
        assert tok.encode(chunk).tolist() == enc.encode_ordinary(chunk)


@pytest.mark.slow
def test_every_scalar_alone_in_rich_context(tok, enc):
    """Each scalar value as its own string in the context of design/tokenizer.md §3.7, so the
    look-ahead sees the string's end after it."""
    strings = [f"a{c}b {c}{c}z A{c}'s 1{c}2\n{c} x{c}'ſ {c}\u25cc\u0301 \u2019{c}" for c in map(chr, SCALARS)]
    for i in range(0, len(strings), 100_000):
        batch = strings[i:i + 100_000]
        got = tok.encode_batch(batch)
        want = enc.encode_ordinary_batch(batch, num_threads=2)
        bad = [s for s, g, w in zip(batch, got, want) if g.tolist() != w]
        assert not bad, [hex(ord(s[1])) for s in bad[:10]]
