"""Pure-Python reference of the Kimi tokenizer: the oracle the native core is tested against
(together with tiktoken 0.14 itself). Slow and simple on purpose; do not use it to serve.

Semantics (the same as ``Tokenizer``):
  1. lone surrogates are replaced by U+FFFD, as tiktoken does;
  2. the text is split at *allowed* special tokens (leftmost match, longest at a position);
  3. each plain segment gets Kimi's cuts (``kimi_cuts``: every 400,000 code points, then runs of
     ``str.isspace`` / non-``isspace`` characters longer than 25,000);
  4. each cut part is pre-tokenized with the Kimi pattern on its own (``pretokenize``);
  5. each piece is looked up whole, else merged in tiktoken's order (``bpe``).
Step 4 simulates the regex alternatives with explicit backtracking; its Unicode classes come from
``unicode_data.py``, which is measured from tiktoken's own regex engine.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

from k3serve.tokenizer import unicode_data

TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000

_HAN, _L, _N, _UP, _LO, _WS = 1, 2, 4, 8, 16, 32
_FLAGS: bytearray | None = None


def _flags() -> bytearray:
    global _FLAGS
    if _FLAGS is None:
        table = bytearray(0x110000)
        for name, bit in (("HAN", _HAN), ("L", _L), ("N", _N), ("UPPER", _UP), ("LOWER", _LO), ("WS", _WS)):
            for lo, hi in unicode_data.RANGES[name]:
                for c in range(lo, hi + 1):
                    table[c] |= bit
        _FLAGS = table
    return _FLAGS


def fix_surrogates(text: str) -> str:
    """tiktoken's treatment of lone surrogates (and of split surrogate pairs)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def kimi_cuts(text: str) -> list[str]:
    """The cut pass of tokenization_kimi.py, transcribed: 400k-character chunks, then no run of
    whitespace or non-whitespace longer than 25,000 characters."""
    out: list[str] = []
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        out.extend(_split_runs(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS))
    return out or [""]


def _split_runs(s: str, max_len: int) -> Iterator[str]:
    current_len = 0
    current_is_space = s[0].isspace() if len(s) > 0 else False
    start = 0
    for i in range(len(s)):
        is_space = s[i].isspace()
        if current_is_space ^ is_space:
            current_len = 1
            current_is_space = is_space
        else:
            current_len += 1
            if current_len > max_len:
                yield s[start:i]
                start = i
                current_len = 1
    yield s[start:]


def split_specials(text: str, specials: Mapping[str, int], allowed: Collection[str]) -> list[str | int]:
    """Plain-text segments and special-token ids, in order (only ``allowed`` names are matched)."""
    names = sorted((s for s in allowed if s in specials), key=len, reverse=True)
    out: list[str | int] = []
    pos = start = 0
    while names and pos < len(text):
        hits = [(text.find(s, pos), -len(s), s) for s in names]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            break
        at, _, name = min(hits)
        out.append(text[start:at])
        out.append(specials[name])
        pos = start = at + len(name)
    out.append(text[start:])
    return [p for p in out if p != ""]


def pretokenize(text: str) -> list[str]:
    """Split text like tiktoken's find_iter over the Kimi pattern."""
    f = _flags()
    n = len(text)
    cls = [f[ord(c)] for c in text]
    pieces: list[str] = []
    i = 0
    while i < n:
        e = _match(text, cls, i)
        pieces.append(text[i:e])
        i = e
    return pieces


def _is_prefix(c: str, fl: int) -> bool:  # [^\r\n\p{L}\p{N}]
    return c not in "\r\n" and not fl & (_L | _N)


def _is_punct(fl: int) -> bool:  # [^\s\p{L}\p{N}]
    return not fl & (_WS | _L | _N)


def _contraction(s: str, e: int) -> int:
    if e + 1 < len(s) and s[e] == "'":
        folds = {k: {chr(c) for c in v} for k, v in unicode_data.FOLDS.items()}
        for alt in ("s", "t", "re", "ve", "m", "ll", "d"):
            chunk = s[e + 1:e + 1 + len(alt)]
            if len(chunk) == len(alt) and all(ch in folds[a] for ch, a in zip(chunk, alt)):
                return e + 1 + len(alt)
    return e


def _letters(s: str, cls: list[int], i: int, upper_plus: bool) -> int | None:
    """P? U* W+ c?  (upper_plus=False)   or   P? U+ W* c?  (upper_plus=True)."""
    n = len(s)
    starts = ([i + 1] if _is_prefix(s[i], cls[i]) else []) + [i]
    for j in starts:
        k = j
        while k < n and cls[k] & _UP:
            k += 1
        if upper_plus:
            if k == j:
                continue
            e = k
            while e < n and cls[e] & _LO:
                e += 1
            return _contraction(s, e)
        for m in range(k, j - 1, -1):  # backtrack U* from the longest
            if m < n and cls[m] & _LO:
                e = m
                while e < n and cls[e] & _LO:
                    e += 1
                return _contraction(s, e)
    return None


def _match(s: str, cls: list[int], i: int) -> int:
    n = len(s)
    fl = cls[i]
    if fl & _HAN:  # [\p{Han}]+
        e = i
        while e < n and cls[e] & _HAN:
            e += 1
        return e
    for upper_plus in (False, True):
        e = _letters(s, cls, i, upper_plus)
        if e is not None:
            return e
    if fl & _N:  # \p{N}{1,3}
        e = i + 1
        while e < n and e < i + 3 and cls[e] & _N:
            e += 1
        return e
    for j in ([i + 1] if s[i] == " " else []) + [i]:  #  ?[^\s\p{L}\p{N}]+[\r\n]*
        if j < n and _is_punct(cls[j]):
            e = j
            while e < n and _is_punct(cls[e]):
                e += 1
            while e < n and s[e] in "\r\n":
                e += 1
            return e
    e = i
    while e < n and cls[e] & _WS:
        e += 1
    for q in range(e, i - 1, -1):  # \s*[\r\n]+
        if q < n and s[q] in "\r\n" and q < e:
            r = q
            while r < n and s[r] in "\r\n":
                r += 1
            return r
    if e == n or e - i >= 2:  # \s+(?!\S)
        return e if e == n else e - 1
    return max(e, i + 1)  # \s+


def bpe(piece: bytes, ranks: Mapping[bytes, int]) -> list[int]:
    """tiktoken's merge order: whole-piece lookup, else merge the lowest-rank adjacent pair
    (leftmost on ties) until none is a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


class ReferenceTokenizer:
    """The whole pipeline in Python; same constructor shape and semantics as ``Tokenizer``."""

    def __init__(self, mergeable_ranks: Mapping[bytes, int], special_tokens: Mapping[str, int],
                 *, kimi_cuts: bool = True):
        self.ranks = dict(mergeable_ranks)
        self.special_tokens = dict(special_tokens)
        self.cuts = kimi_cuts
        self._decoder = {v: k for k, v in self.ranks.items()}
        self._decoder.update({v: k.encode() for k, v in self.special_tokens.items()})

    def encode(self, text: str, allowed_special: Collection[str] | str = ()) -> list[int]:
        allowed = self.special_tokens.keys() if allowed_special == "all" else allowed_special
        out: list[int] = []
        for part in split_specials(fix_surrogates(text), self.special_tokens, allowed):
            if isinstance(part, int):
                out.append(part)
                continue
            for chunk in kimi_cuts(part) if self.cuts else [part]:
                for piece in pretokenize(chunk):
                    out.extend(bpe(piece.encode("utf-8"), self.ranks))
        return out

    def encode_segments(self, segments: Iterable[tuple[str, bool]]) -> list[int]:
        out: list[int] = []
        for text, allow in segments:
            out.extend(self.encode(text, "all" if allow else ()))
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self._decoder[i] for i in ids)


def tiktoken_encode(enc, text: str, allowed_special: Collection[str] | str = ()) -> list[int]:
    """The tests' second oracle: tiktoken 0.14 (``enc`` built with the Kimi pattern) on each cut
    part of each plain segment."""
    specials = enc._special_tokens
    allowed = specials.keys() if allowed_special == "all" else allowed_special
    out: list[int] = []
    for part in split_specials(fix_surrogates(text), specials, allowed):
        if isinstance(part, int):
            out.append(part)
        else:
            for chunk in kimi_cuts(part):
                out.extend(enc.encode_ordinary(chunk))
    return out
