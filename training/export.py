"""Checkpoints of a training run: compact snapshots while it trains, the shipped HF layout at the end.

A *compact* snapshot (``<run>/compact/step_<k>.safetensors``) holds the training model's parameters as they
are (compact vocabulary, float master experts, fp32), a few MB: cheap to write every few hundred steps and to
carry off a remote GPU. ``export`` turns a model (or, through ``main``, a snapshot plus the run's
``used_ids.json``) into the shipped checkpoint ``model`` (full vocabulary, MXFP4 experts, bf16) and its
``bf16`` twin (experts in bf16, for the MXFP4-vs-bf16 agreement check):

    python -m training.export runs/g1 --step 2400     # -> runs/g1/step_2400/{model,bf16}
    python -m training.export runs/g1                 # the last snapshot -> runs/g1/{model,bf16}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils import parametrize

from k3serve.core.config import ModelConfig
from k3serve.models.kimi import build_model, text_model
from k3serve.models.registry import CONFIG_DIR
from k3serve.models.writer import init_random_, save_checkpoint
from training.qat import enable_qat, expert_modules, master, pack_experts
from training.vocab import CompactVocab


def compact_config(full: ModelConfig, vocab: CompactVocab) -> ModelConfig:
    cfg = dataclasses.replace(full, experts_mxfp4=False, vision=None, media_placeholder_token_id=None)
    return cfg.replace_text(vocab_size=len(vocab), bos_token_id=None, eos_token_id=(), pad_token_id=None)


def save_compact(model: nn.Module, path: Path, meta: dict[str, str] | None = None) -> Path:
    """Write every parameter (tied ones once) on the host; QAT-parametrised experts keep their master."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(path), metadata=meta or {})
    return path


def load_params(model: nn.Module, vocab: CompactVocab, path: Path) -> None:
    """Overwrite ``model``'s parameters with a compact snapshot's (QAT parametrisation restored if the
    snapshot had it). The snapshot's run must have used the same vocabulary (its ``used_ids.json``)."""
    ids_file = path.parent.parent / "used_ids.json"
    if ids_file.is_file() and json.loads(ids_file.read_text()) != vocab.ids:
        raise ValueError(f"{path}: its run used another vocabulary ({ids_file}); same data code and seed needed")
    tensors = load_file(str(path))
    if any(".parametrizations." in n for n in tensors):
        enable_qat(model)
    own = dict(model.named_parameters())
    if set(own) != set(tensors):
        missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        raise ValueError(f"{path}: snapshot does not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for n, p in own.items():
            if p.shape != tensors[n].shape:
                raise ValueError(f"{path}: {n} is {tuple(tensors[n].shape)}, the model's {tuple(p.shape)}")
            p.copy_(tensors[n])


def snapshot_shifts(path: Path) -> int:
    """How many KDA context heads (``split_shifts``) the run of a compact snapshot set up: its metadata, else
    its run's ``train_log.json`` (snapshots written before the metadata had it), else 0."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "split_shifts" in meta:
        return int(meta["split_shifts"])
    log = path.parent.parent / "train_log.json"
    if log.is_file():
        return int(json.loads(log.read_text()).get("config", {}).get("split_shifts", 0))
    return 0


def load_compact(config_path: Path, vocab: CompactVocab, path: Path) -> nn.Module:
    """The training model of a compact snapshot."""
    model = build_model(compact_config(ModelConfig.from_file(config_path), vocab))
    init_random_(model, 0)  # every parameter is overwritten
    load_params(model, vocab, path)
    return model


@torch.no_grad()
def export(model: nn.Module, vocab: CompactVocab, config_path: Path, out: Path) -> tuple[Path, Path]:
    """Write the shipped MXFP4 checkpoint and the bf16-experts twin; returns their directories. Moves
    ``model`` to the host (in place), where the export is built."""
    model = model.to("cpu")
    raw = json.loads(Path(config_path).read_text())
    packed_cfg = ModelConfig.from_dict(raw)
    bf16_cfg = ModelConfig.from_dict({k: v for k, v in raw.items() if k != "quantization_config"})
    src = text_model(model)
    dirs = []
    for cfg, name in ((packed_cfg, "model"), (bf16_cfg, "bf16")):
        dst = build_model(cfg)
        init_random_(dst, 0)  # every tensor is overwritten below; this only makes buffers defined
        tm = text_model(dst)
        tm.model.embed_tokens.weight.copy_(vocab.expand_rows(src.model.embed_tokens.weight))
        if not cfg.text.tie_word_embeddings:
            tm.lm_head.weight.copy_(vocab.expand_rows(src.lm_head.weight))
        skip = ("embed_tokens", "lm_head", ".experts.")
        own = dict(tm.named_parameters())
        for n, p in src.named_parameters():
            if not any(s in n for s in skip):
                own[n].copy_(p)
        if cfg.experts_mxfp4:
            pack_experts(model, dst)
        else:
            for s, d in zip(expert_modules(model), expert_modules(dst)):
                d.w13.copy_(master(s, "w13"))
                d.w2.copy_(master(s, "w2"))
        dirs.append(save_checkpoint(dst, cfg, out / name, dtype=torch.bfloat16))
    return dirs[0], dirs[1]


def snapshots(run: Path) -> dict[int, Path]:
    found = {}
    for p in (run / "compact").glob("step_*.safetensors"):
        if m := re.fullmatch(r"step_(\d+)\.safetensors", p.name):
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def open_run(run: Path, step: int | None = None, config: Path | None = None
             ) -> tuple[nn.Module, CompactVocab, Path, int]:
    """The training model of a run's snapshot ``step`` (default: the last), its vocabulary, its config and
    the step. Raises ValueError (one line for the user) when the run or the snapshot is missing."""
    found = snapshots(run)
    if not found or not (run / "used_ids.json").is_file():
        raise ValueError(f"{run} holds no compact snapshots or no used_ids.json")
    step = max(found) if step is None else step
    if step not in found:
        raise ValueError(f"no snapshot for step {step}; have {sorted(found)}")
    with safe_open(str(found[step]), "pt") as f:
        recorded = Path((f.metadata() or {}).get("config", ""))
    # a run made on another machine records its path there; the package's own configs are found by name
    config = config or (recorded if recorded.is_file() else CONFIG_DIR / recorded.name)
    if not config.is_file():
        raise ValueError("the snapshot records no readable config; pass --config")
    vocab = CompactVocab(json.loads((run / "used_ids.json").read_text()), ModelConfig.from_file(config).text.vocab_size)
    return load_compact(config, vocab, found[step]), vocab, config, step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a compact training snapshot in the shipped HF K3 layout.")
    p.add_argument("run", type=Path, help="run directory (holds compact/step_<k>.safetensors and used_ids.json)")
    p.add_argument("--step", type=int, help="snapshot to export (default: the last; written to <run>/step_<k>)")
    p.add_argument("--config", type=Path, help="model config (default: the one recorded in the snapshot)")
    args = p.parse_args(argv)
    try:
        model, vocab, config, step = open_run(args.run, args.step, args.config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.run if args.step is None else args.run / f"step_{step}"
    model_dir, bf16_dir = export(model, vocab, config, out)
    print(f"wrote {model_dir} and {bf16_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
