"""Full-sequence training forward: packed sequences in, logits over a row subset out, autograd intact.

The model's forward reads a ``ForwardContext`` with caches; for training each step gets fresh zeroed
caches (MLA latents and KDA states are written there but never read back: every sequence starts empty),
and the differentiable KDA backend ``"train"`` replaces the in-place serving kernel for the step.

    hidden = train_forward(model, [ids_0, ids_1, ...])     # [sum(len), d]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

import k3serve.ops.kda  # noqa: F401  (registers the serving KDA ops the layers also use)
import k3serve.ops.mla  # noqa: F401
import k3serve.ops.short_conv  # noqa: F401
import training.conv_autograd  # noqa: F401  (registers short_conv/"train")
import training.fused  # noqa: F401  (registers rms_norm, gated_rms_norm, attn_res_mix, situ_and_mul/"train")
import training.kda_autograd  # noqa: F401  (registers kda_chunk/"train")
from k3serve.core.context import ForwardContext, forward_context
from k3serve.models.cache import allocate_caches, cache_spec
from k3serve.ops import registry

BLOCK = 64


@contextlib.contextmanager
def training_backend(device: torch.device) -> Iterator[None]:
    """For the duration: ``kda_chunk`` in its differentiable form, ``short_conv`` and the norms, AttnRes mixes
    and SiTU of ``fused.py`` with their hand-written backwards, and on a GPU the forms with the fewest ops (the
    host, launching them, bounds a GPU step of a model this small): the bucketed packed MLA prefill (one SDPA
    per length bucket instead of a call per sequence) and the padded grouped expert combine; then restore the
    previous ones."""
    chosen = {"kda_chunk": "train", "short_conv": "train", "rms_norm": "train", "gated_rms_norm": "train",
              "attn_res_mix": "train", "situ_and_mul": "train"}
    if device.type != "cpu":
        chosen["mla_prefill_packed"] = "bucketed"
        # under autograd the per-expert slices of the segmented form cost ~7k more ops on a 16k-token step
        # (26.2k -> 19.2k in all); on one CPU core it is as fast or faster, so CPU keeps the size rule
        chosen["expert_combine"] = "grouped"
    previous = {op: registry.forced(op) for op in chosen}  # None: back to dispatch
    for op, backend in chosen.items():
        registry.set_backend(op, backend)
    try:
        yield
    finally:
        for op, backend in previous.items():
            registry.set_backend(op, backend)


def packed_context(model: nn.Module, lens: Sequence[int], dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> ForwardContext:
    """A context for a fresh prefill of sequences of ``lens`` tokens, with just enough new caches on
    ``device`` (``cu_seqlens`` stays on the host: the layers read it as Python ints)."""
    blocks = [-(-n // BLOCK) for n in lens]
    caches = allocate_caches(cache_spec(model, dtype), num_blocks=max(1, sum(blocks)), block_size=BLOCK,
                             num_slots=len(lens), device=device)
    tables = torch.full((len(lens), max(blocks)), -1, dtype=torch.long, device="cpu")
    start = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.arange(start, start + b, device="cpu")
        start += b
    cu = torch.tensor([0, *lens], device="cpu").cumsum(0)
    return ForwardContext(cu_seqlens=cu, cached_lens=[0] * len(lens), state_slots=torch.arange(len(lens), device=device),
                          block_tables=tables.to(device), caches=caches)


def train_forward(model: nn.Module, seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Final hidden states ``[sum(len), d]`` of the packed sequences (each a 1-D long tensor, all on the
    model's device)."""
    if not seqs or any(s.dim() != 1 or s.numel() == 0 for s in seqs):
        raise ValueError("seqs must be a non-empty list of non-empty 1-D token tensors")
    ctx = packed_context(model, [s.numel() for s in seqs], device=seqs[0].device)
    with training_backend(seqs[0].device), forward_context(ctx):
        return model(torch.cat(seqs), ctx)
