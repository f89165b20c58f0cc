"""Drafters that need no model: they propose up to ``k`` next tokens by matching the end of a request's own
tokens (prompt + output) against earlier text, which is where agentic answers copy from (tool arguments,
code being edited, JSON echoed back).

``propose(token_ids, k) -> list[int]`` (length 0..k; zero drafts is an ordinary outcome):
  * ``NgramDrafter`` (prompt lookup, vLLM's ``ngram``): for n from ``max_n`` down to ``min_n``, find the most
    recent earlier occurrence of the last n tokens and propose the k tokens after it.
  * ``SuffixDrafter`` (suffix decoding, ``suffix.py``): the longest suffix match in the request's own text and
    in a global cache of earlier responses, then a walk down the implicit suffix tree of its occurrences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from k3serve.engine.spec.suffix import SuffixDrafter


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids``."""


def match_lengths(a: np.ndarray, max_len: int) -> np.ndarray:
    """``m[e]`` for each end position ``e < L - 1``: how many tokens ending at ``e`` equal the tokens ending at
    ``L - 1`` (the current suffix), capped at ``max_len``. ``a``: the tokens ``[L]``."""
    L = len(a)
    m = np.zeros(max(L - 1, 0), dtype=np.int64)
    alive = np.ones(L - 1, dtype=bool)
    for j in range(min(max_len, L - 1)):
        # candidate end e compares a[e - j] with a[L - 1 - j]; ends with e - j < 0 have run out of tokens
        ok = np.zeros(L - 1, dtype=bool)
        ok[j:] = a[: L - 1 - j] == a[L - 1 - j]
        alive &= ok
        if not alive.any():
            break
        m += alive
    return m


class NgramDrafter:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram drafter: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        L = len(token_ids)
        if k <= 0 or L < self.min_n + 1:
            return []
        a = np.asarray(token_ids, dtype=np.int64)
        m = match_lengths(a, self.max_n)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            ends = np.flatnonzero(m >= n)
            if ends.size:
                e = int(ends[-1])  # the most recent occurrence
                return a[e + 1:e + 1 + k].tolist()
        return []


def make_drafter(method: str, *, prompt_lookup_min: int, prompt_lookup_max: int) -> Drafter:
    if method == "ngram":
        return NgramDrafter(prompt_lookup_min, prompt_lookup_max)
    if method == "suffix":
        return SuffixDrafter(max_match=max(prompt_lookup_max, 8), min_match=prompt_lookup_min)
    raise ValueError(f"speculative_config: unknown method {method!r}")
