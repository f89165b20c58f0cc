"""A KDA prefill cut at one position per sequence, for prefix-cache snapshots at arbitrary positions.

Every kda_chunk backend returns only the final fp32 state of each sequence; a snapshot at position p is
taken by ending a call there: call 1 runs tokens [0, p_i) of every sequence, its final states are the
snapshots, call 2 runs [p_i, len_i) from them. The recurrence carried across the cut is exact (the torch
chunk form and fla's kernels alike: the state hand-off is the same one they do between chunks), unlike
fla's ``return_intermediate_states`` (bf16, chunk boundaries only). Sequences with an empty piece are left
out of that call, so no backend sees a zero-length sequence.

q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, initial_state ``[N, H, K, V]`` fp32,
cu_seqlens ``[N+1]`` (B = 1) or None (N = B), split_at N positions within each sequence (0..len)
-> o ``[B, T, H, V]``, snapshots ``[N, H, K, V]`` (the state after split_at[i] tokens), final ``[N, H, K, V]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from k3serve.ops import registry
from k3serve.ops.kda.validate import check_prefill


def chunk_kda_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                    split_at: Sequence[int], scale: float | None = None, initial_state: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None,
                    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk``: the prefill function (default: the registry's "kda_chunk", dispatched per call)."""
    bounds = check_prefill(q, k, v, g, beta, initial_state, cu_seqlens)
    if len(split_at) != len(bounds) or any(not 0 <= int(p) <= e - s for p, (s, e) in zip(split_at, bounds)):
        raise ValueError(f"split_at must hold one position in [0, len] per sequence (lengths "
                         f"{[e - s for s, e in bounds]}), got {list(split_at)}")
    chunk = chunk or registry.get("kda_chunk")
    B, T, H, K = q.shape
    V, N = v.shape[-1], len(bounds)
    packed = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    state = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        state.copy_(initial_state)
    o = torch.zeros(1, B * T, H, V, dtype=v.dtype, device=q.device)
    snapshots = state
    for first in (True, False):
        pieces = [(i, s, s + int(p)) if first else (i, s + int(p), e)
                  for i, ((s, e), p) in enumerate(zip(bounds, split_at))]
        pieces = [(i, a, b) for i, a, b in pieces if b > a]
        if pieces:
            idx = torch.cat([torch.arange(a, b, device=q.device) for _, a, b in pieces])
            lens = torch.tensor([0] + [b - a for _, a, b in pieces], device=q.device)
            sel = torch.tensor([i for i, _, _ in pieces], device=q.device)
            o_p, s_p = chunk(*(x.index_select(1, idx) for x in packed), scale=scale,
                             initial_state=state.index_select(0, sel).contiguous(), cu_seqlens=lens.cumsum(0))
            o.index_copy_(1, idx, o_p)
            state.index_copy_(0, sel, s_p.float())
        if first:
            snapshots = state.clone()
    return o.view(B, T, H, V), snapshots, state
