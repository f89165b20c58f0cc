"""The forward context: per-step batch metadata every layer reads, and the model's cache tensors.

A step runs a packed batch of ``B`` sequences, ``N`` new tokens in all (prefill chunks and decodes mixed).
Sequence ``i`` owns the new tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` and had ``cached_lens[i]`` tokens
in its caches before the step.

Caches (allocated by the engine or ``models.cache.allocate_caches``):
  * MLA, paged: ``mla[layer]`` is ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``; sequence
    ``i``'s token ``p`` lives at block ``block_tables[i, p // block_size]``, offset ``p % block_size``.
  * KDA, a slot pool: ``kda_state[layer]`` is ``[num_slots, H, K, V]`` fp32 and ``kda_conv[layer]`` is
    ``[num_slots, 3·P, W-1]`` (q|k|v channels, the last W-1 pre-conv inputs); sequence ``i`` owns slot
    ``state_slots[i]``.

With speculative decoding on, ``spec`` names the step's decode rows (1 + k tokens each: the last sampled
token and k drafts); the KDA layers run them through the per-token decode step under ``spec`` (which can roll
back the state of rejected drafts) whatever the batch's shape.

Static decode (``static``, a ``StaticDecode``): a decode step over fixed-shape device buffers, the form a CUDA
graph captures (``engine/graph_runner.py``). Every row adds one token; ``b`` rows (the padded bucket), each with
``max_blocks`` block-table columns; the lengths and cache slots live only in device tensors, so nothing is read
back to the host and no shape depends on the data. The layers then take their fixed-shape forms (MLA
``ops/mla/masked.py``, routed experts ``ops/moe/gathered.py``, KDA's decode step with gathered state rows); the
host-side fields (``cached_lens``, ``context_lens``) are placeholders that must not be read.

``ModelCaches.workspace`` hands out reusable scratch buffers for large per-step temporaries (the MLA decode
latent gather): a fresh multi-MiB tensor every step costs page faults on CPU, a kept buffer does not.

Exactly one context is active at a time, entered with ``forward_context(ctx)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch


@dataclass
class ModelCaches:
    mla: dict[int, torch.Tensor] = field(default_factory=dict)
    kda_state: dict[int, torch.Tensor] = field(default_factory=dict)
    kda_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    block_size: int = 16
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)  # reusable temporaries, not cache state

    def nbytes(self) -> int:
        """Bytes of cache state (the scratch buffers are not counted: they only hold a step's temporaries)."""
        tensors = [*self.mla.values(), *self.kda_state.values(), *self.kda_conv.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def workspace(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat ``[numel]`` buffer with undefined contents, reused across steps (grown, never shrunk).

        Valid until the next call with the same name; callers must not return views of it."""
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.scratch[name] = buf
        return buf[:numel]


@dataclass
class StaticDecode:
    """The device-side layout of a static decode step of ``b`` rows (row i of the bucket; padding rows point at
    a reserved dummy block and state slot, so their writes touch no request's cache)."""

    context_lens: torch.Tensor  # [b] int64, tokens in each row's MLA cache after the step (>= 1)
    slot_mapping: torch.Tensor  # [b] int64, flat MLA cache slot of each row's new token
    max_blocks: int  # block-table columns per row (fixed at capture: the longest context the graph serves)

    @property
    def batch(self) -> int:
        return self.context_lens.shape[0]


@dataclass
class ForwardContext:
    cu_seqlens: torch.Tensor  # [B+1] int64, offsets of each sequence's new tokens in the packed batch
    cached_lens: list[int]  # [B] tokens already cached before this step
    state_slots: torch.Tensor  # [B] int64, KDA pool slot per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64, MLA cache blocks per sequence (-1 = unused)
    caches: ModelCaches
    host_cu_seqlens: list[int] | None = None  # cu_seqlens on the host, when the caller has them (no read-back)
    host_state_slots: list[int] | None = None  # state_slots on the host, when the caller has them (no read-back)
    # speculative decoding: the step's rollback (``engine.spec.rollback.Rollback``); its ``rows`` (decode rows,
    # ascending batch indices) go through ``spec.verify`` in every KDA layer instead of the prefill path
    spec: Any = None
    # speculative decoding's eagle3 drafter: ``{layer index: None}`` asks the model to fill in each listed
    # layer's output hidden state ``[N, d]`` (the residual stream after it); None (the default): nothing kept
    capture: dict | None = None
    # a static decode step (fixed shapes, no host reads): see the module docstring; None: the ordinary step
    static: StaticDecode | None = None
    seq_lens: list[int] = field(init=False)  # [B] new tokens per sequence
    slot_mapping: torch.Tensor = field(init=False)  # [N] flat MLA cache slot of each new token
    has_initial_state: torch.Tensor = field(init=False)  # [B] bool, sequence continues cached state
    is_decode: bool = field(init=False)  # every sequence adds one token to a non-empty cache
    # values that depend only on this step's metadata, computed by the first layer that needs them and reused
    # by the others (e.g. the MLA decode chunk plan); keys are chosen by the layers
    step_memo: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.static is not None:
            self._static_layout()
            return
        cu = self.host_cu_seqlens = self.cu_seqlens.tolist() if self.host_cu_seqlens is None else self.host_cu_seqlens
        self.seq_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        if len(self.cached_lens) != len(self.seq_lens):
            raise ValueError("cached_lens and cu_seqlens disagree on the batch size")
        bs = self.caches.block_size
        device = self.block_tables.device
        lens = torch.tensor(self.seq_lens, dtype=torch.long, device=device)
        # the token count is known on the host: no device read-back (a sync on GPUs, impossible on meta)
        seq = torch.repeat_interleave(torch.arange(len(self.seq_lens), device=device), lens, output_size=cu[-1])
        # position of each new token within its sequence: cached length + offset inside this step
        starts = torch.tensor(self.cached_lens, dtype=torch.long, device=device) - self.cu_seqlens[:-1].to(device)
        pos = torch.arange(cu[-1], device=device) + starts[seq]
        self.slot_mapping = self.block_tables[seq, pos // bs] * bs + pos % bs
        self.has_initial_state = torch.tensor([c > 0 for c in self.cached_lens], dtype=torch.bool, device=device)
        # the batched single-step paths apply only when this holds
        self.is_decode = all(n == 1 for n in self.seq_lens) and all(c > 0 for c in self.cached_lens)

    def _static_layout(self) -> None:
        """The fields of a static decode step: shapes from ``static``, device data from its tensors (no syncs)."""
        b = self.static.batch
        if self.block_tables.shape != (b, self.static.max_blocks) or self.state_slots.shape != (b,):
            raise ValueError(f"static decode: block_tables must be [{b}, {self.static.max_blocks}] and "
                             f"state_slots [{b}], got {tuple(self.block_tables.shape)} and {tuple(self.state_slots.shape)}")
        if self.spec is not None or self.capture is not None:
            raise ValueError("static decode: no speculative rows or captured hidden states")
        self.host_cu_seqlens = list(range(b + 1))
        self.seq_lens = [1] * b
        self.slot_mapping = self.static.slot_mapping
        self.has_initial_state = torch.ones(b, dtype=torch.bool, device=self.block_tables.device)
        self.is_decode = True

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.host_cu_seqlens[-1]

    @cached_property
    def context_lens(self) -> list[int]:
        """[B] tokens in each sequence's caches after this step (computed once per step)."""
        if self.static is not None:
            raise RuntimeError("a static decode step keeps its lengths on the device (static.context_lens)")
        return [c + n for c, n in zip(self.cached_lens, self.seq_lens)]

    @cached_property
    def context_lens_tensor(self) -> torch.Tensor:
        """``context_lens`` as an int64 tensor on the batch's device, shared by every layer of the step."""
        if self.static is not None:
            return self.static.context_lens
        return torch.tensor(self.context_lens, dtype=torch.long, device=self.block_tables.device)

    @cached_property
    def leading_state_rows(self) -> slice | None:
        """``slice(0, B)`` when sequence i's KDA state is row i of the pool (the engine arranges this): the layers
        then update ``cache[:B]`` in place; None when they must gather ``state_slots``."""
        B = self.batch_size
        if self.static is not None:  # padding rows share the dummy slot: always gather and scatter
            return None
        if self.host_state_slots is not None:
            leading = self.host_state_slots == list(range(B))
        else:
            leading = torch.equal(self.state_slots, torch.arange(B, device=self.state_slots.device))
        return slice(0, B) if leading else None

    @cached_property
    def decode_rows(self) -> list[int]:
        """Sequences that add one token to a non-empty cache (all of them when ``is_decode``)."""
        return [i for i, (c, n) in enumerate(zip(self.cached_lens, self.seq_lens)) if n == 1 and c > 0]

    @property
    def last_token_indices(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1


_ACTIVE: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a forward context is already active (nested forwards are not supported)")
    _ACTIVE = ctx
    try:
        yield ctx
    finally:
        _ACTIVE = None


def in_static_decode() -> bool:
    """Whether the active forward (if any) is a static decode step: ops without a context argument (the routed
    experts) take their fixed-shape forms then."""
    return _ACTIVE is not None and _ACTIVE.static is not None


def get_forward_context() -> ForwardContext:
    if _ACTIVE is None:
        raise RuntimeError("no forward context is active; run the model inside `with forward_context(ctx):`")
    return _ACTIVE
