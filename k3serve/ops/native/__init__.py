"""Native fused CPU kernels: the loader of the one extension module ``_kernels`` and the checks every wrapper makes.

setup.py builds ``_kernels`` from ``module.cpp`` here, which includes each kernel from beside its op
(``ops/kda/native/``, ``ops/mla/native/``) and the SIMD helpers they share (``simd.h``). The kernels take raw
addresses, so every caller checks its tensors with ``fits`` first and falls back to the torch ops when they do
not (no extension, CUDA, non-fp32, odd strides). The op wrappers live with their ops (``ops/mla/cpu.py``,
``ops/kda/cpu.py``) and register there as the ``"cpu"`` backend.
"""

from __future__ import annotations

import torch

try:
    from k3serve.ops.native import _kernels as kernels
except ImportError:  # not built (e.g. a source checkout without build_ext): the torch ops serve
    kernels = None


def available() -> bool:
    return kernels is not None


def fits(*tensors: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """True when every tensor is a CPU ``dtype`` tensor whose last dim is contiguous."""
    return all(t.device.type == "cpu" and t.dtype == dtype and (t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1)
               for t in tensors)


def kernels_or_none(*inputs: torch.Tensor) -> object | None:
    """The extension module when it is built and no input needs a gradient (the kernels record none)."""
    if kernels is None or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return None
    return kernels


# A native backend registers with this priority (above "torch") when the extension is built, else with None
# (used only when named): dispatch then never tries it.
PRIORITY = 10


def priority() -> int | None:
    return PRIORITY if kernels is not None else None


def accepts_fp32_cpu(*tensors: object) -> bool:
    """The registry predicate of the native backends: every tensor argument a CPU fp32 tensor. Finer
    conditions (layouts, sizes) stay in each wrapper, which falls back to the torch form."""
    return kernels is not None and all(t.device.type == "cpu" and t.dtype == torch.float32
                                       for t in tensors if isinstance(t, torch.Tensor))
