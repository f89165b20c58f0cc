"""The Kimi tokenizer's Python API over the native core (``_native``, built by ``pip install``).

Token ids come back as numpy ``uint32`` arrays (a Python list costs 15-24 ns per token); call
``.tolist()`` where a list is needed. Semantics are those of ``reference.py`` (the oracle):
special-token split, then Kimi's 400k/25k cuts per plain segment, then the Kimi pattern, then
tiktoken-order BPE.

Bad input:
* lone surrogates in text are replaced by U+FFFD before encoding, exactly as tiktoken does;
* special-token text that is not in ``allowed_special`` is encoded as ordinary text (tiktoken's
  ``encode`` raises by default instead; its ``disallowed_special=()`` behaves like this);
* ``decode`` of an id outside the vocabulary raises ``ValueError`` (tiktoken: ``KeyError``);
  invalid UTF-8 in the decoded bytes becomes U+FFFD (``errors="replace"``, as tiktoken);
* non-``str`` text raises ``TypeError``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from k3serve.tokenizer import kimi
from k3serve.tokenizer._native import Core
from k3serve.tokenizer.decoder import IncrementalDecoder
from k3serve.tokenizer.reference import fix_surrogates

AllowedSpecial = Collection[str] | str  # "all" or a collection of special-token names


class Tokenizer:
    """A tiktoken-format BPE with the Kimi pre-tokenizer, special tokens and cut rules.

    ``mergeable_ranks`` maps token bytes to rank (= id); ``pattern`` must be the Kimi pattern (the
    native pre-tokenizer is hand-written for it); ``special_tokens`` maps name to id.
    ``kimi_cuts`` applies tokenization_kimi.py's 400,000/25,000-character cuts (on by default;
    off gives plain tiktoken ``encode_ordinary`` results). The segment cache holds up to
    ``segment_cache_bytes`` of (text + ids) for ``encode_segments``; segments shorter than
    ``segment_cache_min_bytes`` UTF-8 bytes are always encoded directly. ``prebuild`` builds the
    linear-time BPE tables for long pieces (~0.3 s for Kimi) on a background thread right away
    instead of on the first piece of 128 bytes or more.
    """

    def __init__(self, mergeable_ranks: Mapping[bytes, int] | None = None, *,
                 pattern: str = kimi.KIMI_PATTERN, special_tokens: Mapping[str, int] | None = None,
                 kimi_cuts: bool = True, name: str = "custom",
                 segment_cache_bytes: int = 256 << 20, segment_cache_min_bytes: int = 256,
                 prebuild: bool = True, _core: Core | None = None):
        if pattern != kimi.KIMI_PATTERN:
            raise ValueError("the native pre-tokenizer implements only the Kimi pattern "
                             "(k3serve.tokenizer.KIMI_PATTERN); got a different pattern")
        self.name = name
        self.pattern = pattern
        self.kimi_cuts = kimi_cuts
        self._special = dict(special_tokens or {})
        for tok, i in self._special.items():
            if not isinstance(tok, str) or not tok:
                raise ValueError(f"special token names must be non-empty str, got {tok!r}")
            if not isinstance(i, int) or i < 0:
                raise ValueError(f"special token {tok!r} has invalid id {i!r}")
        if _core is not None:
            self._core = _core
        elif mergeable_ranks is None:
            raise TypeError("Tokenizer() needs mergeable_ranks (or use from_tiktoken_file / kimi)")
        else:
            self._core = Core.from_ranks(dict(mergeable_ranks), list(self._special.items()), kimi_cuts,
                                         int(segment_cache_bytes), int(segment_cache_min_bytes))
        self._by_id = {i: t for t, i in self._special.items()}
        if prebuild:
            self._core.prebuild()

    # construction -------------------------------------------------------------------------------

    @classmethod
    def from_tiktoken_file(cls, path: str | os.PathLike, *, pattern: str = kimi.KIMI_PATTERN,
                           special_tokens: Mapping[str, int] | None = None, **kwargs) -> Tokenizer:
        """Load a tiktoken ``.tiktoken``/``tiktoken.model`` file ("base64 rank" per line)."""
        with open(path, "rb") as f:
            data = f.read()
        special = dict(special_tokens or {})
        if pattern != kimi.KIMI_PATTERN:  # checked again by __init__; fail before parsing the file
            raise ValueError("the native pre-tokenizer implements only the Kimi pattern")
        core = Core.from_tiktoken(data, list(special.items()), kwargs.get("kimi_cuts", True),
                                  int(kwargs.get("segment_cache_bytes", 256 << 20)),
                                  int(kwargs.get("segment_cache_min_bytes", 256)))
        kwargs.setdefault("name", os.path.basename(os.fspath(path)))
        return cls(pattern=pattern, special_tokens=special, _core=core, **kwargs)

    @classmethod
    def kimi(cls, variant: str = "k2", **kwargs) -> Tokenizer:
        """The Kimi tokenizer from the vocabulary shipped in this package.

        ``variant`` picks the special-token names: "k2" (tokenizer_config.json, K2/K2.5: ``[BOS]``,
        ``<|im_end|>``, ...) or "k3" (``<|open|>``, ``<|close|>``, ``<|sep|>``, ...). Ids are the
        same: 163584..163839, unnamed ones ``<|reserved_token_{id}|>``.
        """
        kwargs.setdefault("name", f"kimi-{variant}")
        return cls.from_tiktoken_file(kimi.VOCAB_PATH, special_tokens=kimi.special_tokens(variant), **kwargs)

    # vocabulary ---------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        """Highest id + 1 over ranks and special tokens (163,840 for Kimi)."""
        return max([self._core.n_ranks - 1, *self._special.values()]) + 1

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def special_id(self, name: str) -> int:
        """Id of a special token by name, e.g. ``special_id("<|im_end|>")``."""
        try:
            return self._special[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a special token of {self.name}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._by_id

    def token_bytes(self, token_id: int) -> bytes:
        return self._core.token_bytes(_int_id(token_id))

    # encoding -----------------------------------------------------------------------------------

    def _allowed(self, allowed_special: AllowedSpecial | None):
        if allowed_special is None or allowed_special == ():
            return None
        if isinstance(allowed_special, str):
            if allowed_special == "all":
                return True
            raise ValueError(f"allowed_special must be 'all' or a collection of names, got {allowed_special!r}")
        names = list(allowed_special)
        unknown = [n for n in names if n not in self._special]
        if unknown:
            raise ValueError(f"not special tokens of {self.name}: {unknown[:5]!r}")
        return names

    def encode(self, text: str, allowed_special: AllowedSpecial = ()) -> np.ndarray:
        """Token ids (uint32 array). Special-token text becomes a special id only if allowed."""
        allowed = self._allowed(allowed_special)
        try:
            return self._core.encode(text, allowed)
        except UnicodeEncodeError:
            return self._core.encode(fix_surrogates(text), allowed)

    def count(self, text: str, allowed_special: AllowedSpecial = ()) -> int:
        """Number of tokens ``encode`` would return."""
        allowed = self._allowed(allowed_special)
        try:
            return self._core.count(text, allowed)
        except UnicodeEncodeError:
            return self._core.count(fix_surrogates(text), allowed)

    def encode_segments(self, segments: Sequence[tuple[str, bool]], *, use_cache: bool = True) -> np.ndarray:
        """Encode ``[(text, allow_special), ...]`` as one id array, each segment on its own.

        The chat renderer passes control text with ``allow_special=True`` and user/tool text with
        ``False``, so ``<|im_end|>`` typed by a user never becomes a control token. Segments of at
        least ``segment_cache_min_bytes`` go through the exact segment cache: a conversation's
        earlier turns are looked up, not re-tokenized.
        """
        if not isinstance(segments, (list, tuple)):
            segments = list(segments)
        try:
            return self._core.encode_segments(segments, use_cache)
        except UnicodeEncodeError:
            fixed = [(fix_surrogates(t) if isinstance(t, str) else t, a) for t, a in segments]
            return self._core.encode_segments(fixed, use_cache)

    def encode_batch(self, texts: Sequence[str], allowed_special: AllowedSpecial = (), *,
                     num_threads: int = 0) -> list[np.ndarray]:
        """Encode many texts with the GIL released on ``num_threads`` threads (0 = all cores)."""
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a sequence of str, not a str")
        if not isinstance(texts, (list, tuple)):
            texts = list(texts)
        allowed = self._allowed(allowed_special)
        try:
            return self._core.encode_batch(texts, allowed, int(num_threads))
        except UnicodeEncodeError:
            fixed = [fix_surrogates(t) if isinstance(t, str) else t for t in texts]
            return self._core.encode_batch(fixed, allowed, int(num_threads))

    # segment cache ------------------------------------------------------------------------------

    def segment_cache_info(self) -> dict[str, int]:
        """hits, misses, entries, bytes, capacity_bytes."""
        return self._core.cache_stats()

    def clear_segment_cache(self) -> None:
        self._core.cache_clear()

    # decoding -----------------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int] | np.ndarray) -> bytes:
        if not isinstance(ids, (list, tuple, np.ndarray)):
            ids = list(ids)
        return self._core.decode_bytes(ids)

    def decode(self, ids: Iterable[int] | np.ndarray, errors: str = "replace") -> str:
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def incremental_decoder(self) -> IncrementalDecoder:
        """A streaming decoder that never emits half of a UTF-8 character."""
        return IncrementalDecoder(self)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, specials={len(self._special)})"


def _int_id(token_id) -> int:
    if isinstance(token_id, (bool, float)) or not isinstance(token_id, (int, np.integer)):
        raise TypeError(f"token id must be int, got {type(token_id).__name__}")
    return int(token_id)
