"""Incremental detokenization: whole UTF-8 characters only, stop strings across token boundaries never leak;
``SequenceDecoder``, the one owner of a sequence's text and finish reason.

Tested with the Kimi vocabulary through tiktoken (the package's copy of shared/tokenizers/kimi/tiktoken.model), and with a
byte-level toy vocabulary where every token is one byte (the worst case for split characters)."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3serve.engine.detokenizer import IncrementalDetokenizer, SequenceDecoder
from k3serve.tokenizer.kimi import VOCAB_PATH

KIMI = VOCAB_PATH  # the package copy of shared/tokenizers/kimi/tiktoken.model
PATTERN = (r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}"""
           r"""&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&"""
           r"""[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?"""
           r"""[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


@pytest.fixture(scope="module")
def kimi():
    tiktoken = pytest.importorskip("tiktoken")
    if not KIMI.exists():
        pytest.skip("Kimi vocabulary not available")
    ranks = {base64.b64decode(tok): int(r) for tok, r in (ln.split() for ln in KIMI.read_text().splitlines() if ln)}
    try:
        return tiktoken.Encoding("kimi", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
    except ValueError:  # a regex engine without set intersections: a simpler split gives the same bytes
        return tiktoken.Encoding("kimi", pat_str=r"\s+|\S+", mergeable_ranks=ranks, special_tokens={})


def bytewise(text: str) -> tuple[list[int], object]:
    return list(text.encode()), lambda ids: bytes(ids)


def stream(decode_bytes, ids, stop=(), include=False, step=1):
    d = IncrementalDetokenizer(decode_bytes, stop, include)
    deltas = [d.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(d.flush())
    return deltas, d


def test_multibyte_characters_are_never_split():
    text = "héllo 世界 🎉 naïve"
    ids, dec = bytewise(text)
    deltas, _ = stream(dec, ids)
    assert "".join(deltas) == text and all("\ufffd" not in x for x in deltas)


def test_kimi_tokens_roundtrip(kimi):
    text = "Kimi: 月之暗面 — « déjà vu » 🎉🎉 end"
    ids = kimi.encode(text)
    deltas, _ = stream(kimi.decode_bytes, ids)
    assert "".join(deltas) == text and all("\ufffd" not in x for x in deltas)


def test_stop_string_spanning_tokens_never_leaks(kimi):
    text = "The answer is 42.\n\nUser: next question"
    ids = kimi.encode(text)
    stop = "\n\nUser:"
    deltas, d = stream(kimi.decode_bytes, ids, stop=[stop, "zzz"])
    assert "".join(deltas) == "The answer is 42." and d.stopped_on == stop
    deltas, _ = stream(kimi.decode_bytes, ids, stop=[stop], include=True)
    assert "".join(deltas) == "The answer is 42.\n\nUser:"


def test_earliest_stop_wins_and_partial_prefix_is_released():
    ids, dec = bytewise("abXYab")
    deltas, d = stream(dec, ids, stop=["XYZ", "Yab"])
    assert "".join(deltas) == "abX" and d.stopped_on == "Yab"
    deltas, d = stream(dec, ids, stop=["XYZ"])  # "XY" was held back, then released at the end
    assert "".join(deltas) == "abXYab" and d.stopped_on is None and deltas[2] == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab€😀 \n", max_size=30), start=st.integers(0, 30), length=st.integers(1, 4),
       step=st.integers(1, 5))
def test_stream_equals_text_cut_at_first_stop(text, start, length, step):
    stop = text[start:start + length] or "€€€"
    ids, dec = bytewise(text)
    deltas, _ = stream(dec, ids, stop=[stop], step=step)
    cut = text.find(stop)
    assert "".join(deltas) == (text if cut < 0 else text[:cut])


def test_sequence_decoder_owns_the_finish():
    """The stop token is consumed, never decoded; a stop string beats the engine's "length" on the same token;
    a cut past the text (the chat content cutoff) beats the engine too; nothing changes once done."""
    dec = lambda ids: bytes(ids)  # noqa: E731 - one byte per id
    eos = SequenceDecoder(dec, eos_ids=[0])
    assert eos.push(list(b"ab")) == "ab" and eos.push([0], True, "stop") == "" and eos.text == "ab"
    assert (eos.finish_reason, eos.stop_reason, eos.done) == ("stop", None, True)
    tok = SequenceDecoder(dec)
    assert tok.push([*b"ab", 90], True, "stop", 90) == "ab" and tok.stop_reason == 90  # stop token id 90 = "Z"
    text = SequenceDecoder(dec, stop=["bc"])
    assert text.push(list(b"ab")) == "a" and text.push(list(b"cd"), True, "length") == ""
    assert (text.text, text.finish_reason, text.stop_reason) == ("a", "stop", "bc")
    assert text.push(list(b"e"), True, "length") == "" and text.finish_reason == "stop"
    cut = SequenceDecoder(dec)
    assert cut.push(list(b"x"), True, "length") == "x" and cut.finish_reason == "length"
    cut.cut("STOP")
    assert (cut.finish_reason, cut.stop_reason) == ("stop", "STOP")
    held = SequenceDecoder(dec, stop=["xyz"])
    assert held.push(list(b"ax")) == "a" and held.push([], True, "abort") == "x" and held.finish_reason == "abort"
