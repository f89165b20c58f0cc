"""The pure-Python reference is itself checked against tiktoken, so either oracle can be trusted."""

from __future__ import annotations

from k3serve.tokenizer.reference import kimi_cuts, pretokenize, split_specials


def test_reference_matches_tiktoken_on_text(ref, enc, texts):
    for name in ("prose", "code", "cjk", "json"):
        sample = texts[name][:20_000]
        assert ref.encode(sample) == enc.encode_ordinary(sample), name


def test_reference_pretokenizer_on_text(tok, texts):
    for name in ("prose", "code", "cjk"):
        sample = texts[name][:20_000]
        assert pretokenize(sample) == tok._core.pieces(sample, False), name


def test_kimi_cuts():
    assert kimi_cuts("") == [""]
    assert kimi_cuts("a" * 25_001) == ["a" * 25_000, "a"]
    assert kimi_cuts(" " * 50_001 + "b") == [" " * 25_000, " " * 25_000, " b"]
    parts = kimi_cuts("ab " * 200_000)
    assert [len(p) for p in parts] == [400_000, 200_000]


def test_split_specials():
    sp = {"<a>": 1, "<ab>": 2, "[x]": 3}
    assert split_specials("q<ab>r<a>[x]", sp, sp.keys()) == ["q", 2, "r", 1, 3]
    assert split_specials("q<ab>r", sp, {"<a>"}) == ["q<ab>r"]
