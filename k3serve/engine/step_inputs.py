"""``StepInputs``: everything one forward needs, as plain ids, so every tensor-parallel rank runs the same step.

Rank 0 (the engine core, which owns the scheduler) builds it from a ``Batch``; the worker ranks receive it
(``engine/tp_group.py``) and run exactly the same ``ModelRunner.execute``. Slots are the scheduler's logical
KDA slots and blocks its MLA block ids: each rank keeps its own caches with the same numbering.

For B sequences and N new tokens:
  input_ids ``[N]``, cu_seqlens ``[B+1]``, cached_lens ``[B]``, slots ``[B]``, block_tables ``[B * width]``
  (row-major, -1 padded), copies_before / copies_after ``[(src, dst)]`` KDA slot copies (prefix hits before
  the forward, snapshots after), logit_rows: hidden rows whose logits are computed for sampling, prompt_spans
  ``[(first_row, num)]`` hidden rows whose logits give prompt logprobs, image_embeds ``[n, d]`` or None.

On the wire (``pack`` / ``unpack``, no pickle): a 12-entry int64 header (kind and the lengths above), one int64
payload with the lists concatenated in that order, and the image embeddings as a float tensor when present.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NOOP, STEP, SHUTDOWN = 0, 1, 2
# a request's KDA rows out of / into every rank, between steps (engine/pd/rank_rows.py: the hand-off under tp)
ROWS_OUT, ROWS_IN = 3, 4
HEADER_LEN = 12
_FLOAT_CODES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class StepInputs:
    input_ids: list[int]
    cu_seqlens: list[int]
    cached_lens: list[int]
    slots: list[int]
    block_tables: list[int]
    width: int
    copies_before: list[tuple[int, int]] = field(default_factory=list)
    copies_after: list[tuple[int, int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[int, int]] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = len(self.slots)
        if len(self.cu_seqlens) != b + 1 or len(self.cached_lens) != b or len(self.block_tables) != b * self.width:
            raise ValueError(f"step inputs disagree on the batch size: {b} slots, {len(self.cu_seqlens)} offsets, "
                             f"{len(self.cached_lens)} cached lengths, {len(self.block_tables)} table entries")
        if self.cu_seqlens[-1] != len(self.input_ids):
            raise ValueError(f"cu_seqlens ends at {self.cu_seqlens[-1]} but there are {len(self.input_ids)} ids")


def _flat(pairs: list[tuple[int, int]]) -> list[int]:
    return [x for p in pairs for x in p]


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[0::2], flat[1::2]))


def header(kind: int, s: StepInputs | None = None) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.long)
    h[0] = kind
    if s is not None:
        e = s.image_embeds
        h[1:11] = torch.tensor([len(s.input_ids), len(s.slots), s.width, len(s.copies_before), len(s.copies_after),
                                len(s.logit_rows), len(s.prompt_spans), 0 if e is None else e.shape[0],
                                0 if e is None else e.shape[1],
                                0 if e is None else _FLOAT_CODES.index(e.dtype)])
    return h


def pack(s: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(header ``[12]``, payload ``[L]``) int64 CPU tensors."""
    values = [*s.input_ids, *s.cu_seqlens, *s.cached_lens, *s.slots, *s.block_tables, *_flat(s.copies_before),
              *_flat(s.copies_after), *s.logit_rows, *_flat(s.prompt_spans)]
    return header(STEP, s), torch.tensor(values, dtype=torch.long)


def payload_len(h: torch.Tensor) -> int:
    n, b, w, cb, ca, lr, ps = h[1:8].tolist()
    return n + (b + 1) + b + b + b * w + 2 * cb + 2 * ca + lr + 2 * ps


def embeds_shape(h: torch.Tensor) -> tuple[tuple[int, int], torch.dtype] | None:
    rows, dim, code = h[8:11].tolist()
    return None if rows == 0 else ((rows, dim), _FLOAT_CODES[code])


def unpack(h: torch.Tensor, payload: torch.Tensor, image_embeds: torch.Tensor | None = None) -> StepInputs:
    n, b, w, cb, ca, lr, ps = h[1:8].tolist()
    flat = payload.tolist()
    out, at = [], 0
    for size in (n, b + 1, b, b, b * w, 2 * cb, 2 * ca, lr, 2 * ps):
        out.append(flat[at:at + size])
        at += size
    ids, cu, cached, slots, tables, before, after, rows, spans = out
    return StepInputs(ids, cu, cached, slots, tables, w, _pairs(before), _pairs(after), rows, _pairs(spans),
                      image_embeds)
