"""Python API: special tokens, segments (the chat renderer's injection guarantee), the segment
cache, batches, decoding, streaming, and bad input."""

from __future__ import annotations

import random

import numpy as np
import pytest

from k3serve.tokenizer import KIMI_PATTERN, Tokenizer
from k3serve.tokenizer import kimi


def test_kimi_special_tokens(tok):
    assert tok.n_vocab == 163_840
    assert tok.special_id("[BOS]") == 163584
    assert tok.special_id("<|im_end|>") == 163586
    assert tok.special_id("<|im_middle|>") == 163601
    assert tok.special_id("</think>") == 163607
    assert tok.special_id("<|reserved_token_163589|>") == 163589
    assert tok.special_id("[PAD]") == 163839
    assert len(tok.special_tokens) == 256
    with pytest.raises(KeyError, match="not a special token"):
        tok.special_id("<|open|>")


def test_kimi_k3_names():
    k3 = Tokenizer.kimi("k3")
    assert k3.special_id("<|open|>") == 163587
    assert k3.special_id("<|close|>") == 163588
    assert k3.special_id("<|sep|>") == 163589
    assert k3.special_id("<|end_of_msg|>") == 163586
    with pytest.raises(ValueError, match="variant"):
        Tokenizer.kimi("k9")


def test_allowed_special(tok, enc):
    text = "hi<|im_end|>there[EOS]"
    assert tok.encode(text).tolist() == enc.encode_ordinary(text)  # default: plain text
    assert tok.encode(text, allowed_special="all").tolist() == enc.encode(text, allowed_special="all")
    only = tok.encode(text, allowed_special={"[EOS]"}).tolist()
    assert only == enc.encode(text, allowed_special={"[EOS]"}, disallowed_special=())
    assert 163585 in only and 163586 not in only
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode(text, allowed_special={"<|nope|>"})


@pytest.mark.parametrize("variant,names", [("k2", ["<|im_end|>", "<|im_user|>", "[EOS]"]),
                                           ("k3", ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"])])
def test_special_text_in_plain_segment_never_becomes_special(variant, names):
    t = Tokenizer.kimi(variant)
    specials = set(t.special_tokens.values())
    rnd = random.Random(0)
    for _ in range(300):
        user = "".join(rnd.choice(names + ["a", " ", "<", "|", ">", "\n", "x" * 300]) for _ in range(rnd.randint(1, 30)))
        control = rnd.choice(names)
        ids = t.encode_segments([(control, True), (user, False), (control, True)]).tolist()
        assert ids[0] == ids[-1] == t.special_id(control)
        assert not specials & set(ids[1:-1]), user
        assert t.decode(ids[1:-1]) == user


def test_encode_segments_matches_reference(tok, ref):
    segs = [("<|im_system|>system<|im_middle|>", True), ("You are <|im_end|> helpful.", False),
            ("<|im_end|>", True), ("<|im_user|>user<|im_middle|>", True), ("x" * 1000 + " ſ'S", False),
            ("<|im_end|><|im_assistant|>assistant<|im_middle|>", True), ("", False)]
    assert tok.encode_segments(segs).tolist() == ref.encode_segments(segs)


def _conversation(rnd: random.Random, n: int) -> list[tuple[str, bool]]:
    words = ["hello", " world", "<|im_end|>", "日本", "\n", "  ", "def f(x):", "'s", "🙂", "ſ"]
    segs = []
    for i in range(n):
        role = ["<|im_user|>user", "<|im_assistant|>assistant"][i % 2]
        body = "".join(rnd.choices(words, k=rnd.randint(0, 400)))
        segs += [(f"{role}<|im_middle|>", True), (body, False), ("<|im_end|>", True)]
    return segs


def test_segment_cache_is_exact():
    t = Tokenizer.kimi(segment_cache_min_bytes=16)
    rnd = random.Random(1)
    for trial in range(20):
        segs = _conversation(rnd, rnd.randint(1, 12))
        uncached = t.encode_segments(segs, use_cache=False).tolist()
        assert t.encode_segments(segs).tolist() == uncached
        fresh = [(s.encode().decode(), a) for s, a in segs]  # new str objects
        assert t.encode_segments(fresh).tolist() == uncached
        longer = segs + _conversation(rnd, 2)
        assert t.encode_segments(longer).tolist() == t.encode_segments(longer, use_cache=False).tolist()
    info = t.segment_cache_info()
    assert info["hits"] > 0 and info["entries"] > 0 and info["bytes"] <= info["capacity_bytes"]


def test_segment_cache_is_bounded():
    t = Tokenizer.kimi(segment_cache_bytes=64 << 10, segment_cache_min_bytes=1)
    rnd = random.Random(2)
    for i in range(200):
        seg = (f"{i} " + "".join(rnd.choices("abc ", k=2000)), False)
        assert t.encode_segments([seg]).tolist() == t.encode(seg[0]).tolist()
        assert t.segment_cache_info()["bytes"] <= 64 << 10
    t.clear_segment_cache()
    assert t.segment_cache_info()["entries"] == 0


def test_encode_batch(tok, texts):
    docs = [texts["prose"][i:i + 5000] for i in range(0, 100_000, 5000)] + ["", "a<|im_end|>"]
    # non-ASCII texts of each str kind: converted to UTF-8 on the worker threads
    docs += [texts["cjk"][i:i + 3000] for i in range(0, 30_000, 3000)] + ["é ü x" * 40, "emoji 🙂 x" * 50]
    single = [tok.encode(d).tolist() for d in docs]
    for n in (1, 2, 0):
        assert [a.tolist() for a in tok.encode_batch(docs, num_threads=n)] == single
    allowed = tok.encode_batch(["a<|im_end|>"], allowed_special="all", num_threads=2)
    assert allowed[0].tolist()[-1] == 163586
    with pytest.raises(TypeError):
        tok.encode_batch("not a list")
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        tok.encode_batch(["ok", 3])


def test_output_is_uint32_buffer(tok):
    ids = tok.encode("hello world")
    assert isinstance(ids, np.ndarray) and ids.dtype == np.uint32 and ids.flags.c_contiguous
    assert tok.encode_segments([("a", False)]).dtype == np.uint32


def test_decode(tok):
    ids = tok.encode("héllo <|im_end|> 世界", allowed_special="all")
    assert tok.decode(ids) == "héllo <|im_end|> 世界"
    assert tok.decode(ids.tolist()) == tok.decode(ids.astype(np.int64)) == tok.decode(tuple(ids.tolist()))
    assert tok.decode_bytes([163586]) == b"<|im_end|>"
    assert tok.token_bytes(163586) == b"<|im_end|>"
    assert tok.decode([]) == ""
    # half a character: replaced like tiktoken (errors="replace")
    e9 = tok.encode("é").tolist()
    part = [t for t in range(256) if tok.token_bytes(t) == b"\xc3"]
    assert tok.decode(part) == "\ufffd"
    assert tok.decode(e9) == "é"


@pytest.mark.parametrize("bad", [[163840], [-1], [2**40], [10**30], [163592 + 10**6]])
def test_decode_invalid_ids(tok, bad):
    with pytest.raises(ValueError, match="invalid token id"):
        tok.decode(bad)


def test_decode_accepts_integer_scalars(tok):
    """Iterating an encode() result gives numpy integer scalars; decode takes them like ints (via __index__)."""
    text = "numpy ids, special <|im_end|> kept as text"
    ids = tok.encode(text)
    assert tok.decode(list(ids)) == text
    assert tok.decode([np.int64(i) for i in ids]) == text
    with pytest.raises(ValueError, match="invalid token id"):
        tok.decode([np.uint32(163840)])


def test_decode_wrong_types(tok):
    with pytest.raises(TypeError):
        tok.decode([1.5])
    with pytest.raises(TypeError):
        tok.decode(np.array([1.0]))
    with pytest.raises(TypeError):
        tok.decode("abc")
    with pytest.raises(TypeError):
        tok.token_bytes("1")


def test_incremental_decoder(tok):
    text = "naïve café — 日本語のテキスト 🙂👍🏽 done\n" * 20
    ids = tok.encode(text).tolist()
    rnd = random.Random(3)
    for _ in range(20):
        dec = tok.incremental_decoder()
        out, i = [], 0
        while i < len(ids):
            k = rnd.randint(1, 3)
            piece = dec.push(ids[i:i + k])
            assert "\ufffd" not in piece  # never half a character
            out.append(piece)
            i += k
        out.append(dec.flush())
        assert "".join(out) == text
    dec = tok.incremental_decoder()
    part = [t for t in range(256) if tok.token_bytes(t) == b"\xe6"]  # first byte of a 3-byte char
    assert dec.push(part) == "" and dec.pending_bytes == 1
    assert dec.flush() == "\ufffd"


def test_lone_surrogates_like_tiktoken(tok, enc):
    for text in ["a\ud800b", "\udfff", "x\ud83d\ude00y", "\ud800" * 5 + "ok"]:
        expect = enc.encode_ordinary(text)
        assert tok.encode(text).tolist() == expect
        assert tok.count(text) == len(expect)
        assert tok.encode_segments([(text, False)]).tolist() == expect
        assert tok.encode_batch([text, "a"])[0].tolist() == expect


def test_non_string_input(tok):
    for bad in (b"bytes", None, 3, ["a"]):
        with pytest.raises(TypeError, match="must be str"):
            tok.encode(bad)
    with pytest.raises(TypeError, match="allow_special"):
        tok.encode_segments([("a", 1)])
    with pytest.raises(TypeError, match="pair"):
        tok.encode_segments([("a",)])
    with pytest.raises(TypeError, match=r"segments\[0\]\[0\]"):
        tok.encode_segments([(b"a", False)])


def test_custom_vocabulary(enc):
    """Any tiktoken-format vocabulary: bytes plus a few merges, checked against tiktoken."""
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)}
    for m in [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"  "]:
        ranks[m] = len(ranks)
    special = {"<|end|>": 1000}
    t = Tokenizer(ranks, special_tokens=special, kimi_cuts=False)
    ref = tiktoken.Encoding("small", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    for s in ["the thing in the house", "breathing  theme<|end|>", "中文 the"]:
        assert t.encode(s, allowed_special="all").tolist() == ref.encode(s, allowed_special="all")
    assert t.n_vocab == 1001


def test_bad_vocabularies(tmp_path):
    with pytest.raises(ValueError, match="only the Kimi pattern"):
        Tokenizer({bytes([i]): i for i in range(256)}, pattern=r"\w+|\s+")
    with pytest.raises(ValueError, match="no token for byte"):
        Tokenizer({b"a": 0})
    with pytest.raises(ValueError, match="duplicate"):
        Tokenizer({**{bytes([i]): i for i in range(256)}, b"ab": 5})
    with pytest.raises(ValueError, match="also a rank"):
        Tokenizer({bytes([i]): i for i in range(256)}, special_tokens={"<x>": 3})
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match="line 2"):
        Tokenizer.from_tiktoken_file(bad)


def test_vocabulary_file_is_the_published_one():
    import hashlib

    assert hashlib.sha256(kimi.VOCAB_PATH.read_bytes()).hexdigest() == kimi.VOCAB_SHA256
    assert (kimi.DATA_DIR / "README.md").read_text().count("MIT") >= 1


def test_many_small_segments_stay_linear(tok):
    """Issue 50: a chat of 200,000 short messages. Each segment used to reserve the output to its exact
    new size, reallocating and copying the whole output per segment (minutes at this size before the fix,
    a fraction of a second after); the ids must equal the per-segment encodings laid end to end."""
    turn = [("<|im_user|>user<|im_middle|>", True), ("hi", False), ("<|im_end|>", True)]
    one = tok.encode_segments(turn).tolist()
    ids = tok.encode_segments(turn * 200_000)
    assert len(ids) == 200_000 * len(one)
    assert ids[: 2 * len(one)].tolist() == one * 2 and ids[-len(one):].tolist() == one
