"""Write checkpoints in the exact HF layout: random ones for tests and benchmarks, or a model's own weights.

``write_random_checkpoint(config, path, seed)`` initialises the module tree deterministically (same seed ->
byte-identical files), quantises routed experts to MXFP4 when the config says so (compressed-tensors
``weight_packed``/``weight_scale``), and writes ``config.json`` plus safetensors shards with an index when
there is more than one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from k3serve.core.config import ModelConfig
from k3serve.layers.attn_res import AttnResWeights
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.moe import MoEGate, RoutedExperts
from k3serve.layers.norm import GatedRMSNorm, KimiRMSNorm
from k3serve.layers.weights import collect_slots
from k3serve.models.kimi import build_model
from k3serve.ops.mx import mxfp4_quantize

INIT_STD = 0.02


def _init_module(m: nn.Module, g: torch.Generator) -> None:
    def normal(t: torch.Tensor, std: float = INIT_STD, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    if isinstance(m, (nn.Linear, nn.Embedding)):
        normal(m.weight)
    elif isinstance(m, nn.Conv1d):
        normal(m.weight, 0.3)
    elif isinstance(m, (KimiRMSNorm, GatedRMSNorm)):
        normal(m.weight, 0.1, 1.0)
    elif isinstance(m, AttnResWeights):
        normal(m.weight, 0.5)
    elif isinstance(m, MoEGate):
        normal(m.weight)
        normal(m.e_score_correction_bias, 0.01)
    elif isinstance(m, KimiDeltaAttention):
        # as in the reference init: A_log = log U(1, 16); dt = exp(U(log 1e-3, log 1e-1)), stored as softplus^-1(dt)
        m.A_log.copy_(torch.empty(m.A_log.shape).uniform_(1, 16, generator=g).log())
        dt = torch.exp(torch.empty(m.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
        m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif isinstance(m, RoutedExperts):
        E, D, I = m.num_experts, m.width, m.inter
        w13 = torch.randn(E, 2 * I, D, generator=g) * INIT_STD * 5
        w2 = torch.randn(E, D, I, generator=g) * INIT_STD * 5
        if m.mxfp4:
            m.w13_packed[:], m.w13_scale[:] = mxfp4_quantize(w13)
            m.w2_packed[:], m.w2_scale[:] = mxfp4_quantize(w2)
        else:
            m.w13.copy_(w13)
            m.w2.copy_(w2)


@torch.no_grad()
def init_random_(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        _init_module(m, g)
    return model


def save_checkpoint(model: nn.Module, config: ModelConfig, path: str | Path, *,
                    dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 30) -> Path:
    """Write ``model``'s weights under the checkpoint names, floating tensors as ``dtype`` (F32 ones stay F32)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {s.key: s.dump().to(s.dtype if s.dtype == torch.float32 or not s.dtype.is_floating_point else dtype)
               .contiguous() for s in collect_slots(model, stored_dtype=dtype)}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / name, metadata=meta)
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config.raw, indent=2))
    return path


def write_random_checkpoint(config: ModelConfig, path: str | Path, seed: int = 0, *,
                            dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 30) -> Path:
    """A deterministic random checkpoint of ``config`` at ``path`` in the exact HF layout."""
    torch.manual_seed(seed)
    model = build_model(config)
    init_random_(model, seed)
    return save_checkpoint(model, config, path, dtype=dtype, max_shard_bytes=max_shard_bytes)
