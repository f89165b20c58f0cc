"""Load an HF-style checkpoint directory (``config.json`` + safetensors, optionally sharded with an index).

The module tree is built on the meta device, materialised empty, then every checkpoint slot (see
``layers.weights``) is filled tensor by tensor from memory-mapped safetensors files, so peak memory is the
model plus one tensor. Tensors kept F32 in checkpoints (A_log, dt_bias, conv weights, o_norm,
e_score_correction_bias) stay F32 whatever ``dtype`` is. A missing, unexpected or mis-shaped tensor ends
with one ``CheckpointError`` naming it. Only safetensors are read, never pickle.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from k3serve.core.config import ModelConfig
from k3serve.core.distributed import SINGLE, Parallel
from k3serve.layers.weights import CheckpointError, WeightSlot, collect_slots
from k3serve.models.kimi import build_model, text_model

# Alternative spellings seen in published checkpoints and writers, mapped to ours.
_KEY_ALIASES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^language_model\.layers\."), "language_model.model.layers."),
    # transformers' save_pretrained writes the dense layer-0 MLP under block_sparse_moe.
    (re.compile(r"(layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$"), r"\1.mlp.\2.weight"),
]


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Map every tensor key to the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = {k: path / f for k, f in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise CheckpointError(f"shard {f.name} named in {index.name} does not exist")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise CheckpointError(f"{path} holds only pickle checkpoints (*.bin/*.pt); k3serve reads safetensors only")
        raise CheckpointError(f"no *.safetensors files in {path}")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for k in f.keys():
                files[k] = shard
    return files


def _canonical(key: str) -> str:
    for pattern, repl in _KEY_ALIASES:
        key = pattern.sub(repl, key)
    return key


def materialize(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                par: Parallel = SINGLE) -> nn.Module:
    """Build the model (this rank's shard under ``par``) without initialising it, straight on ``device``;
    floating tensors in ``dtype`` except those kept F32. The checkpoint is then copied into these tensors: no
    CPU copy of the model on the way."""
    with torch.device("meta"):
        model = build_model(config, par)
    fp32 = {n for n, p in model.named_parameters() if getattr(p, "keep_fp32", False)}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in fp32 and t.dtype.is_floating_point:
            t.data = t.data.to(dtype)  # on meta: no memory yet, so the device allocation below is the only one
    model.to_empty(device=device)  # new tensors: the keep_fp32 marks and weight ties must be put back
    text_model(model).tie_weights()
    for name, t in model.named_parameters():
        if name in fp32:
            t.keep_fp32 = True
    return model.eval()


def place_model(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Move ``model`` (in place) to ``device`` and its floating tensors to ``dtype``, except those marked
    ``keep_fp32`` (router bias, KDA decay parameters, norms kept F32). Parameter and buffer objects stay the
    same (``.data`` is replaced), so weight ties and the ``keep_fp32`` marks survive."""
    device = torch.device(device)
    for t in [*model.parameters(), *model.buffers()]:
        want = dtype if t.dtype.is_floating_point and not getattr(t, "keep_fp32", False) else t.dtype
        if t.device.type != device.type or (device.index is not None and t.device != device) or t.dtype != want:
            t.data = t.data.to(device=device, dtype=want)
    return model


def load_weights(model: nn.Module, path: Path, *, progress: bool = True) -> None:
    slots: dict[str, WeightSlot] = {s.key: s for s in collect_slots(model)}
    files = checkpoint_files(path)
    by_ours: dict[str, tuple[str, Path]] = {}
    for key, f in files.items():
        ours = _canonical(key)
        if ours not in slots:
            raise CheckpointError(f"unexpected tensor '{key}' in {f.name} (no such weight in this model)")
        by_ours[ours] = (key, f)
    missing = [k for k in slots if k not in by_ours]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is missing tensor '{missing[0]}'{more}")
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in set(files.values())}
        bar = tqdm(slots.items(), desc=f"Loading {path.name}", unit="tensor", disable=not progress, leave=False)
        for ours, slot in bar:
            if slot.load is None:  # another rank's tensor (expert parallelism): never read here
                continue
            key, f = by_ours[ours]
            slot.load(handles[f].get_tensor(key))


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, progress: bool = True,
               act_quant: str | None = None, device: torch.device | str = "cpu",
               par: Parallel = SINGLE) -> tuple[nn.Module, ModelConfig]:
    """Load a model from a checkpoint directory or a built-in name such as ``k3-tiny-random``, onto ``device``
    (each tensor is copied there from the memory-mapped file; on ``meta`` the copies are no-ops). Under a
    tensor-parallel ``par`` (see ``core.distributed.init_parallel``) each rank reads the full checkpoint
    tensors and keeps its shard; the layout is checked against the config before anything is read."""
    from k3serve.models.registry import resolve_model_path
    from k3serve.models.kimi import set_expert_act_quant

    path = resolve_model_path(path)
    config = ModelConfig.from_file(path)
    model = materialize(config, dtype, device, par)
    load_weights(model, path, progress=progress)
    set_expert_act_quant(model, act_quant)
    return model, config
