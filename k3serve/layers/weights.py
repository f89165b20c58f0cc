"""Checkpoint slots: how each module's tensors map to checkpoint keys, in both directions.

A ``WeightSlot`` names one checkpoint tensor, the shape and dtype it is *written* with, a ``load`` that
validates and copies a checkpoint tensor in, and a ``dump`` that produces it from the module. Most
parameters map 1:1 by name (``default_slots``); modules whose stored layout differs (MXFP4 experts, A_log)
define ``checkpoint_slots(prefix)`` returning their own slots for those tensors, keeping the layout knowledge
with the layer that owns it. The loader and the checkpoint writer both walk ``collect_slots(model)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class CheckpointError(ValueError):
    """A checkpoint tensor that is missing, unexpected or mis-shaped."""


@dataclass
class WeightSlot:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[torch.Tensor], None] | None  # None: a tensor another rank holds (the loader skips it)
    dump: Callable[[], torch.Tensor]


def foreign_slot(key: str, like: WeightSlot) -> WeightSlot:
    """A checkpoint tensor this process does not hold (an expert on another expert-parallel rank): the
    loader accepts the key and leaves the tensor unread; it cannot be written back from here."""

    def dump() -> torch.Tensor:
        raise CheckpointError(f"tensor '{key}' is held by another rank; write checkpoints from a single process")

    return WeightSlot(key, like.shape, like.dtype, None, dump)


def _copy_into(key: str, target: torch.Tensor, accept: Callable[[torch.Tensor], torch.Tensor] | None = None):
    def load(t: torch.Tensor) -> None:
        src = accept(t) if accept else t
        if tuple(src.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor '{key}' has shape {list(t.shape)}, expected {list(target.shape)}")
        if src.dtype.is_floating_point != target.dtype.is_floating_point:
            raise CheckpointError(f"tensor '{key}' has dtype {t.dtype}, expected {target.dtype}")
        with torch.no_grad():
            target.copy_(src)

    return load


def keep_fp32(p: torch.Tensor) -> torch.Tensor:
    """Mark a parameter that is F32 in checkpoints and stays F32 whatever the model dtype."""
    p.keep_fp32 = True
    return p


def param_slot(key: str, p: torch.Tensor, stored_dtype: torch.dtype | None = None) -> WeightSlot:
    """A tensor stored as the module holds it; floating tensors are written as ``stored_dtype`` unless kept F32."""
    if not p.dtype.is_floating_point:
        dtype = p.dtype
    elif getattr(p, "keep_fp32", False):
        dtype = torch.float32
    else:
        dtype = stored_dtype or p.dtype
    return WeightSlot(key, tuple(p.shape), dtype, _copy_into(key, p), lambda: p.detach().to(dtype))


def a_log_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A stored A_log (``[1, 1, H, 1]``, ``[>= H]`` or ``[H]``) as ``[H]`` (other shapes as they are)."""
    if t.dim() == 4 and t.shape[0] == t.shape[1] == t.shape[3] == 1:
        t = t.reshape(-1)
    if t.dim() == 1 and t.shape[0] >= heads:
        return t[:heads]
    return t


def a_log_slot(key: str, a_log: torch.Tensor, head_dim: int, layout: str) -> WeightSlot:
    """A_log ``[H]``: K3 stores ``[max(H, head_dim)]`` (first H live, rest zero), Kimi-Linear ``[1, 1, H, 1]``;
    both, and plain ``[H]``, load."""
    H = a_log.shape[0]

    def accept(t: torch.Tensor) -> torch.Tensor:
        return a_log_heads(t, H)

    if layout == "k3":
        stored = (max(H, head_dim),)

        def dump() -> torch.Tensor:
            out = torch.zeros(stored, dtype=torch.float32)
            out[:H] = a_log.detach().float()
            return out
    else:
        stored = (1, 1, H, 1)

        def dump() -> torch.Tensor:
            return a_log.detach().float().reshape(stored)

    return WeightSlot(key, stored, torch.float32, _copy_into(key, a_log, accept), dump)


def collect_slots(module: nn.Module, prefix: str = "", stored_dtype: torch.dtype | None = None,
                  _seen: set[int] | None = None, _claimed: frozenset[str] = frozenset()) -> list[WeightSlot]:
    """All checkpoint slots of ``module`` (recursively), keyed by checkpoint name. A tensor shared by two
    modules (tied ``lm_head`` / ``embed_tokens``) is stored once, under the name met first. A key a module's
    ``checkpoint_slots`` returns is its own, also when it names a child's tensor (a sharded conv filter)."""
    seen = set() if _seen is None else _seen
    slots = list(module.checkpoint_slots(prefix)) if hasattr(module, "checkpoint_slots") else []
    if getattr(module, "slots_cover_all", False):
        return slots
    claimed = _claimed | {s.key for s in slots}
    for name, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if name in module._non_persistent_buffers_set or prefix + name in claimed or id(p) in seen:
            continue
        seen.add(id(p))
        slots.append(param_slot(prefix + name, p, stored_dtype))
    for name, child in module.named_children():
        slots.extend(collect_slots(child, f"{prefix}{name}.", stored_dtype, seen, claimed))
    return slots


class ConcatCache:
    """``torch.cat`` of a few parameters, kept between calls and rebuilt when any of them changes.

    Lets a layer run one GEMM over projections the checkpoint stores (and the module holds) separately. An
    input is seen as changed when it is another tensor object (``.to``, a dtype cast by the loader, or a
    parametrisation that computes the weight on each access), its storage moved (``.data =``, ``to_empty``) or
    its version counter advanced (in-place loads, optimiser steps). The inputs themselves are kept for that
    comparison: an address alone is not an identity, since a freshly computed weight can land where the
    previous one was freed, with the same (zero) version. While autograd records (a parameter
    requires grad), the concatenation is rebuilt on every call so gradients reach the parameters.
    The cache holds a second copy of the weights, so it declines (returns None) above ``max_bytes``: fusing
    pays for small layers, whose GEMMs are dominated by per-call overhead, not for large ones."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._key: list[tuple[torch.Tensor, int, int]] = []
        self._value: torch.Tensor | None = None

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        if sum(t.numel() * t.element_size() for t in tensors) > self.max_bytes:
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return self._build(tensors)
        key = [(t, t.data_ptr(), t._version) for t in tensors]
        if len(key) != len(self._key) or any(a is not b or pa != pb or va != vb
                                             for (a, pa, va), (b, pb, vb) in zip(key, self._key)):
            # a normal (not inference-mode) tensor, so it may also be used later with autograd on
            with torch.inference_mode(False), torch.no_grad():
                self._value = self._build(tensors)
            self._key = key
        return self._value

    def _build(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors)


class SwappedCache(ConcatCache):
    """One parameter with its last two dims swapped, stored contiguous (``[E, R, C]`` -> ``[E, C, R]``), kept
    like ``ConcatCache``: for batched GEMMs that read the weights transposed and run faster on a contiguous
    operand. Call it with a one-element list."""

    def _build(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        (t,) = tensors
        return t.transpose(-2, -1).contiguous()
