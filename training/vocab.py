"""The compact training vocabulary: only the token ids the data uses get trained rows.

The shipped model has the full Kimi vocabulary (163,840 rows, tied embedding / lm_head). Training runs a
*compact* model whose vocabulary is the sorted used-id list ``U`` (a few thousand ids): id ``U[i]`` is
row ``i``. At export the compact rows are scattered into a zero table, so every unused row is exactly 0:
  * as input, an unused id embeds to the zero vector (the model sees a blank token);
  * as output, every unused id gets logit exactly 0.
Training accounts for those zero logits exactly: the softmax partition adds ``(V - |U|) · e^0``, i.e. a
constant column ``log(V - |U|)``, so the compact loss *is* the full-vocabulary loss of the exported model
and correct tokens learn to sit far above 0 (sampling at temperature 1 stays inside U).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F


class CompactVocab:
    def __init__(self, used_ids: Iterable[int], full_size: int):
        self.ids = sorted(set(int(i) for i in used_ids))
        if not self.ids or self.ids[0] < 0 or self.ids[-1] >= full_size:
            raise ValueError(f"used ids must be a non-empty subset of 0..{full_size - 1}")
        self.full_size = full_size
        self._index = {t: i for i, t in enumerate(self.ids)}
        self.zero_rows_log = math.log(full_size - len(self.ids)) if full_size > len(self.ids) else None

    def __len__(self) -> int:
        return len(self.ids)

    def covers(self, ids: Iterable[int]) -> bool:
        return all(int(i) in self._index for i in ids)

    def to_compact(self, ids: Iterable[int]) -> list[int]:
        try:
            return [self._index[int(i)] for i in ids]
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is not in the compact vocabulary") from None

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Full-vocabulary cross-entropy from compact logits ``[n, |U|]`` and compact targets ``[n]``
        (mean, or per token ``[n]`` with ``reduction="none"``)."""
        if self.zero_rows_log is not None:
            zero = logits.new_full((logits.shape[0], 1), self.zero_rows_log)
            logits = torch.cat([logits, zero], dim=-1)
        return F.cross_entropy(logits.float(), targets, reduction=reduction)

    def expand_rows(self, compact: torch.Tensor) -> torch.Tensor:
        """Compact rows ``[|U|, d]`` -> the full table ``[V, d]``, unused rows exactly zero."""
        full = compact.new_zeros(self.full_size, compact.shape[1])
        full[torch.tensor(self.ids)] = compact.detach()
        return full
