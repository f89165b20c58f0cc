"""flash-linear-attention's KDA kernels behind our op contracts (backends "fla" of "kda_chunk" and "kda_decode",
"fla_recurrent" of "kda_chunk"); imported by ``ops/kda`` only where fla is installed (the ``[gpu]`` extra).

Our ops take q, k already L2-normalised, g the log decay (gate applied) and beta already sigmoid-ed, so fla runs
with every in-kernel transform off (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``,
``use_beta_sigmoid_in_kernel`` False) and the same default scale K^-0.5. States stay fp32 ``[N, H, K, V]``
(fla's layout with ``state_v_first=False``) in and out; fla asserts an fp32 ``initial_state``.

  fla_chunk_kda       q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, cu_seqlens ``[N+1]`` (B = 1)
                      -> o ``[B, T, H, V]`` (v's dtype), final state ``[N, H, K, V]``: ``fla.ops.kda.chunk_kda``
  fla_recurrent_kda   the same contract through ``fused_recurrent_kda`` (token loop in one kernel: short prefills)
  fla_kda_decode      one token of N sequences (``decode.py``'s contract, ``out_state`` written when given)

fla's chunk kernel keeps intermediate states only at chunk boundaries and in bf16, so prefix-cache snapshots
never come from it: a snapshot position ends a call (``split.py``: two calls, the fp32 state carried).
Under ``TRITON_INTERPRET=1`` (CPU) ``fused_recurrent_kda`` runs; ``chunk_kda`` does not (its autotuner needs a
GPU driver to time configs, and with that patched out ``chunk_delta_h.py`` calls ``.to`` on a ``range`` index,
a Python int in the interpreter), so its parity test runs on a GPU only.
"""

from __future__ import annotations

import torch
from fla.ops.kda import chunk_kda, fused_recurrent_kda

from k3serve.ops.kda.validate import check_prefill, check_state, default_scale

_OFF = dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)


def _prefill(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
             scale: float | None, initial_state: torch.Tensor | None,
             cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = check_prefill(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V, N = v.shape[-1], len(bounds)
    if T == 0:
        state = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
        return v.new_zeros(B, T, H, V), state if initial_state is None else initial_state.clone()
    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long)
    o, final = fn(q, k, v, g, beta, scale=default_scale(scale, K),
                  initial_state=None if initial_state is None else initial_state.contiguous(),
                  output_final_state=True, cu_seqlens=cu, **_OFF)
    if final is None:  # no sequences at all
        final = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    return o.to(v.dtype), final.float()


def fla_chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                  scale: float | None = None, initial_state: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_size`` (our torch form's knob) is accepted and ignored: fla picks its own (64)."""
    return _prefill(chunk_kda, q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)


def fla_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                      scale: float | None = None, initial_state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _prefill(fused_recurrent_kda, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    cu_seqlens=cu_seqlens)


def fla_kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, *, scale: float | None = None,
                   out_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g ``[N, H, K]``, v ``[N, H, V]``, beta ``[N, H]``, state ``[N, H, K, V]`` fp32: each sequence a
    batch row of one token."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [N, H, K], got {getattr(q, 'shape', type(q).__name__)}")
    N, H, K = q.shape
    if state is None:
        raise ValueError("state must be a float32 tensor [N, H, K, V], got None")
    check_state("state", state, (N, H, K, v.shape[-1]))
    check_state("out_state", out_state, (N, H, K, v.shape[-1]))
    # fla directly, not through _prefill: its log-decay check reads a value back to the host, which a decode
    # step captured in a CUDA graph must not do
    o, final = fused_recurrent_kda(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                   scale=default_scale(scale, K), initial_state=state.contiguous(),
                                   output_final_state=True, **_OFF)
    o = o.to(v.dtype)
    if out_state is not None:
        final = out_state.copy_(final)
    return o[:, 0], final


def on_cuda(q: torch.Tensor, *args, **kwargs) -> bool:
    """Dispatch predicate: fla's kernels for CUDA tensors only."""
    return isinstance(q, torch.Tensor) and q.is_cuda
