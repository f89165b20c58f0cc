"""The KDA decode step (``step.kda_decode_step``) with the native fused CPU kernel: one pass per sequence
from the pre-conv q|k|v to the output, conv state and recurrent state updated in place (two passes over each
head's L1-resident ``[K, V]`` state instead of ~25 batched torch ops).

Same arguments and result as ``kda_decode_step``; falls back to it when the kernel does not apply (no
extension, CUDA, non-fp32 tensors or states, layouts other than unit-stride rows, gradients recorded).
"""

from __future__ import annotations

import torch

from k3serve.ops import native
from k3serve.ops.kda.step import L2_EPS, kda_decode_step
from k3serve.ops.kda.validate import default_scale


def _rows_ok(t: torch.Tensor, dims: int) -> bool:
    """``t`` has ``dims`` dims and is contiguous within each row (any row stride)."""
    return t.dim() == dims and (t.shape[0] == 0 or t[0].is_contiguous())


def kda_decode_step_cpu(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, f: torch.Tensor,
                        dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, state: torch.Tensor, *,
                        lower_bound: float | None, scale: float | None = None,
                        l2_eps: float = L2_EPS) -> torch.Tensor:
    N, H, K = f.shape
    tensors = (qkv, conv_weight, conv_state, f, dt_bias, a_log, b, state)
    kernels = native.kernels_or_none(*tensors)
    channels = qkv.shape[-1] if qkv.dim() == 2 else -1
    V = (channels - 2 * H * K) // H if H else 0
    if (kernels is None or not native.fits(*tensors) or V <= 0 or channels != 2 * H * K + H * V
            or K > 256 or V > 256 or not _rows_ok(qkv, 2) or not _rows_ok(f, 3) or not _rows_ok(b, 2)
            or conv_weight.dim() != 2 or conv_weight.shape[0] != channels or not conv_weight.is_contiguous()
            or tuple(conv_state.shape) != (N, channels, conv_weight.shape[1] - 1) or not conv_state.is_contiguous()
            or tuple(state.shape) != (N, H, K, V) or not state.is_contiguous() or tuple(b.shape) != (N, H)
            or qkv.shape[0] != N or dt_bias.numel() != H * K or a_log.numel() != H
            or not dt_bias.is_contiguous() or not a_log.is_contiguous()):
        return kda_decode_step(qkv, conv_weight, conv_state, f, dt_bias, a_log, b, state, lower_bound=lower_bound,
                               scale=scale, l2_eps=l2_eps)
    out = torch.empty(N, H, V, dtype=torch.float32)
    if N:
        kernels.kda_decode(qkv.data_ptr(), conv_weight.data_ptr(), conv_state.data_ptr(), f.data_ptr(),
                           dt_bias.data_ptr(), a_log.data_ptr(), b.data_ptr(), state.data_ptr(), out.data_ptr(),
                           N, H, K, V, conv_weight.shape[1], qkv.stride(0), f.stride(0), b.stride(0),
                           default_scale(scale, K), l2_eps, lower_bound is not None,
                           0.0 if lower_bound is None else float(lower_bound))
    return out
