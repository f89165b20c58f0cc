"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): drafts from the longest suffix match of a request's
tokens in its own text (prompt + output so far) and in a **global response cache**, the outputs of earlier
requests of every client. Agentic traffic repeats itself across requests (the same tool-call scaffolding, JSON
keys, code being re-emitted), so the global cache finds continuations the request's own text does not hold.

Shapes: a request's tokens ``a [L]`` (int64); the cache is its responses concatenated with a ``-1`` separator
after each ``[C]``; a match never crosses a separator, and a continuation stops at one.

One proposal, for each source (own text, cache):
  1. ``suffix_match(hay, query, max_len)``: for each end position e of ``hay``, how many tokens ending at e
     equal the tokens ending the query (capped at ``max_len``) -- a vectorised scan, ``max_len`` numpy passes
     at most, stopping as soon as no end is still matching;
  2. from the ends with the longest match (>= ``min_match``), walk down their continuations: at each depth
     the token most of the surviving occurrences agree on (ties: the most recent), its share ``p_d`` of them,
     stopping when ``p_d < min_support``; the drafts' score is sum_d prod_{i<=d} p_i (the expected number of
     accepted drafts if each share were the acceptance probability).
The source with the higher score wins (ties: the request's own text). Drafts only cost speed, never
correctness: the target verifies each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

SEP = -1  # never a token id


def suffix_match(hay: np.ndarray, query: np.ndarray, max_len: int) -> np.ndarray:
    """``m [len(hay)]``: ``m[e]`` = how many tokens ending at ``hay[e]`` equal the last tokens of ``query``
    (at most ``max_len``). Ends whose run reaches the start of ``hay`` stop matching there."""
    H = len(hay)
    m = np.zeros(H, dtype=np.int64)
    alive = np.ones(H, dtype=bool)
    for j in range(min(max_len, len(query))):
        # end e compares hay[e - j] with query[-1 - j]
        ok = np.zeros(H, dtype=bool)
        ok[j:] = hay[: H - j] == query[-1 - j]
        alive &= ok
        if not alive.any():
            break
        m += alive
    return m


def walk(cont: np.ndarray, ends: np.ndarray, k: int, min_support: float) -> tuple[list[int], float]:
    """(drafts, score) from the occurrences ending at ``ends`` in ``cont`` (see the module docstring)."""
    out: list[int] = []
    score, prob = 0.0, 1.0
    for d in range(k):
        nxt = ends + 1 + d
        nxt = nxt[nxt < len(cont)]
        tokens = cont[nxt]
        keep = tokens != SEP
        nxt, tokens = nxt[keep], tokens[keep]
        if not tokens.size:
            break
        values, counts = np.unique(tokens, return_counts=True)
        top = counts.max()
        share = top / tokens.size
        if share < min_support:
            break
        tied = values[counts == top]
        tok = int(tokens[np.isin(tokens, tied)][-1])  # among the most agreed, the most recent
        out.append(tok)
        prob *= share
        score += prob
        ends = nxt[tokens == tok] - 1 - d
    return out, score


class ResponseCache:
    """The global cache: finished responses' tokens, oldest evicted first once more than ``max_tokens`` are held."""

    def __init__(self, max_tokens: int = 1 << 16):
        if max_tokens < 1:
            raise ValueError(f"suffix drafter: response cache size must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.parts: deque[np.ndarray] = deque()
        self.size = 0
        self._flat: np.ndarray | None = None

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) < 2:
            return
        part = np.append(np.asarray(tokens[-self.max_tokens + 1:], dtype=np.int64), SEP)
        self.parts.append(part)
        self.size += len(part)
        while self.size > self.max_tokens:
            self.size -= len(self.parts.popleft())
        self._flat = None

    @property
    def tokens(self) -> np.ndarray:
        """The held responses, each followed by ``SEP`` ``[C]``."""
        if self._flat is None:
            self._flat = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64)
        return self._flat


class SuffixDrafter:
    def __init__(self, max_match: int = 32, min_match: int = 1, min_support: float = 0.5,
                 cache_tokens: int = 1 << 16, use_cache: bool = True):
        if not 1 <= min_match <= max_match or not 0 < min_support <= 1:
            raise ValueError("suffix drafter: need 1 <= min_match <= max_match and 0 < min_support <= 1")
        self.max_match, self.min_match, self.min_support = max_match, min_match, min_support
        self.cache = ResponseCache(cache_tokens) if use_cache else None

    def finished(self, output_token_ids: Sequence[int]) -> None:
        """A request's response, for the global cache."""
        if self.cache is not None:
            self.cache.add(output_token_ids)

    def _from(self, hay: np.ndarray, cont: np.ndarray, query: np.ndarray, k: int) -> tuple[list[int], float]:
        if not hay.size:
            return [], 0.0
        m = suffix_match(hay, query, self.max_match)
        best = int(m.max())
        if best < self.min_match:
            return [], 0.0
        return walk(cont, np.flatnonzero(m == best), k, self.min_support)

    def propose_scored(self, token_ids: Sequence[int], k: int) -> tuple[list[int], float]:
        """(drafts, score): the better of the request's own text and the response cache."""
        if k <= 0 or len(token_ids) < 2:
            return [], 0.0
        a = np.asarray(token_ids, dtype=np.int64)
        best = self._from(a[:-1], a, a, k)  # own text: every end but the last position itself
        if self.cache is not None and self.cache.size:
            c = self.cache.tokens
            other = self._from(c, c, a, k)
            if other[1] > best[1]:
                best = other
        return best

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return self.propose_scored(token_ids, k)[0]
