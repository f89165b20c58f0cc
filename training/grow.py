"""Start a training run from a shipped HF-format checkpoint, optionally with wider KDA heads.

``import_checkpoint(model, vocab, path)`` overwrites a compact training model (``export.compact_config``)
with a checkpoint's weights:
  * embedding rows: the checkpoint's rows of the compact vocabulary's ids (ids it never trained are zero
    there and stay zero here, as an exported unused row is);
  * routed experts: the MXFP4 weights dequantised into the float masters (QAT picks up from there);
  * every other parameter and buffer (router biases included) by name.

Where the model's KDA ``head_dim`` is larger than the checkpoint's (K_old -> K_new, same head count), each
head keeps its K_old key/value channels and gets K_new - K_old new ones. The new channels start near silent,
so the grown model computes what the checkpoint did: new q/k/v rows at a tenth of the fresh init (q and k
are L2-normalised per head, so the old channels still carry the scores), new forget-gate rank columns
zero, new ``o_proj`` columns zero; the output norm's old weights are scaled by sqrt(K_old / K_new),
because the RMS over K_new channels of which only K_old are live is that much smaller. Two things keep it
from being exact: the KDA score scale is K^-1/2, so the grown heads' outputs shrink by sqrt(K_old / K_new)
before the output norm, and that norm's eps is then larger against them (on the shipped model, whose KDA
outputs are small, one layer's output moves by ~7% and greedy next tokens agree on ~84% of a sample's
positions). Training recovers that within its first steps. Shapes per layer,
with P = H * K: q/k/v/g_proj ``[P, d]``, convs ``[P, 1, W]``, f_a_proj ``[K, d]``, f_b_proj ``[P, K]``,
dt_bias ``[P]``, o_norm ``[K]``, o_proj ``[d, P]``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

from k3serve.core.config import ModelConfig
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.models.kimi import build_model, text_model
from k3serve.models.loader import load_model
from k3serve.models.writer import init_random_
from k3serve.ops.mx.quant import mxfp4_dequantize
from training.export import compact_config, open_run
from training.qat import enable_qat, expert_modules
from training.vocab import CompactVocab

NEW_CHANNEL_SCALE = 0.1


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def open_model(source: Path, step: int | None = None, config: Path | None = None
               ) -> tuple[nn.Module, CompactVocab, int | None]:
    """A compact training model, its vocabulary and the snapshot's step (None for a checkpoint), for the
    probes: a run's snapshot (``export.open_run``) or an HF-format checkpoint directory (vocabulary = its
    non-zero embedding rows, i.e. the ids its run trained; experts under QAT, which on MXFP4 weights is the
    identity). ValueError for the user if neither."""
    if not is_checkpoint_dir(source):
        model, vocab, _, step = open_run(source, step, config)
        return model, vocab, step
    src, own_config = load_model(source, dtype=torch.float32, progress=False)
    full = ModelConfig.from_file(config) if config else own_config
    rows = text_model(src).model.embed_tokens.weight.abs().sum(1).nonzero().flatten().tolist()
    vocab = CompactVocab(rows, full.text.vocab_size)
    model = build_model(compact_config(full, vocab))
    init_random_(model, 0)  # every parameter is overwritten
    import_checkpoint(model, vocab, source, loaded=src)
    enable_qat(model)
    return model, vocab, None


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The probes' model arguments: what ``open_source`` reads."""
    p.add_argument("source", type=Path, help="checkpoint directory, or run directory with compact snapshots")
    p.add_argument("--step", type=int, help="run snapshot step (default: the last)")
    p.add_argument("--config", type=Path, help="model config (default: the checkpoint's, or the snapshot's)")


def add_task_arguments(p: argparse.ArgumentParser, n: int, seed: int, n_help: str) -> None:
    """A probe's ``--n`` (held-out tasks, at least 1: ``parse_source`` checks) and task ``--seed``."""
    p.add_argument("--n", type=int, default=n, help=n_help)
    p.add_argument("--seed", type=int, default=seed, help="task seed (never a training seed)")


def parse_source(p: argparse.ArgumentParser, argv: list[str] | None
                 ) -> tuple[argparse.Namespace, tuple[nn.Module, CompactVocab, str] | None]:
    """A probe's parsed arguments (``--n`` below 1 is a usage error) and ``open_source``'s answer for them."""
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("--n must be >= 1")
    return args, open_source(args)


def open_source(args: argparse.Namespace) -> tuple[nn.Module, CompactVocab, str] | None:
    """``open_model`` for a probe's parsed arguments, with a label ("runs/x step 425") for its report; on a
    bad source, one line on stderr and None. Probes run on one thread (a tiny model's forwards gain nothing
    from more, and a probe often runs beside training)."""
    torch.set_num_threads(1)
    try:
        model, vocab, step = open_model(args.source, args.step, args.config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return model, vocab, f"{args.source}" + ("" if step is None else f" step {step}")


@torch.no_grad()
def import_checkpoint(model: nn.Module, vocab: CompactVocab, path: Path, loaded: nn.Module | None = None
                      ) -> dict[str, int]:
    """Overwrite ``model`` (freshly initialised: new KDA channels keep a scaled copy of that init) with the
    checkpoint at ``path`` (or ``loaded``, that checkpoint already loaded in fp32); returns counts of what was
    copied, grown and left untrained."""
    src = loaded if loaded is not None else load_model(path, dtype=torch.float32, progress=False)[0]
    src_tm, dst_tm = text_model(src), text_model(model)
    counts = {"copied": 0, "grown": 0, "untrained_rows": 0}
    table = src_tm.model.embed_tokens.weight
    if table.shape[0] != vocab.full_size or table.shape[1] != dst_tm.model.embed_tokens.weight.shape[1]:
        raise ValueError(f"{path}: embedding {tuple(table.shape)} does not fit this model's vocabulary and width")
    rows = table[torch.tensor(vocab.ids)]
    dst_tm.model.embed_tokens.weight.copy_(rows)
    counts["untrained_rows"] = int((rows.abs().sum(1) == 0).sum())
    for s, d in zip(expert_modules(src), expert_modules(model), strict=True):
        d.w13.copy_(mxfp4_dequantize(s.w13_packed, s.w13_scale, torch.float32))
        d.w2.copy_(mxfp4_dequantize(s.w2_packed, s.w2_scale, torch.float32))
    src_kda = {n: m for n, m in src_tm.named_modules() if isinstance(m, KimiDeltaAttention)}
    growing = {n: (src_kda[n], m) for n, m in dst_tm.named_modules()
               if isinstance(m, KimiDeltaAttention) and n in src_kda and src_kda[n].head_dim != m.head_dim}
    own = dict(dst_tm.named_parameters()) | dict(dst_tm.named_buffers())
    skip = ("embed_tokens", "lm_head", ".experts.")  # copied above
    for name, tensor in list(src_tm.named_parameters()) + list(src_tm.named_buffers()):
        if any(s in name for s in skip) or name not in own or any(name.startswith(g + ".") for g in growing):
            continue
        if own[name].shape != tensor.shape:
            raise ValueError(f"{path}: {name} is {tuple(tensor.shape)}, the model's {tuple(own[name].shape)} "
                             "(only KDA heads can grow)")
        own[name].copy_(tensor)
        counts["copied"] += 1
    for old, new in growing.values():
        _grow_kda(old, new)
        counts["grown"] += 1
    return counts


def _grow_kda(old: KimiDeltaAttention, new: KimiDeltaAttention) -> None:
    H, Ko, Kn = old.num_heads, old.head_dim, new.head_dim
    if new.num_heads != H or Kn < Ko:
        raise ValueError(f"KDA heads can only widen: {H} x {Ko} -> {new.num_heads} x {Kn}")

    def by_head(w: torch.Tensor, K: int) -> torch.Tensor:  # [P, ...] -> [H, K, ...]
        return w.view(H, K, *w.shape[1:])

    for proj in ("q_proj", "k_proj", "v_proj"):
        w = by_head(getattr(new, proj).weight, Kn)
        w[:, Ko:] *= NEW_CHANNEL_SCALE
        w[:, :Ko] = by_head(getattr(old, proj).weight, Ko)
    for dst, src in ((new.q_conv1d.weight, old.q_conv1d.weight), (new.k_conv1d.weight, old.k_conv1d.weight),
                     (new.v_conv1d.weight, old.v_conv1d.weight), (new.g_proj.weight, old.g_proj.weight),
                     (new.dt_bias, old.dt_bias)):
        by_head(dst, Kn)[:, :Ko] = by_head(src, Ko)
    new.f_a_proj.weight[:Ko] = old.f_a_proj.weight
    f_b = by_head(new.f_b_proj.weight, Kn)       # [H, Kn, Kn]: rows key channels, columns gate rank
    f_b[:, :, Ko:] = 0.0                        # the new rank is silent until it learns
    f_b[:, :Ko, :Ko] = by_head(old.f_b_proj.weight, Ko)
    new.A_log.copy_(old.A_log)
    new.b_proj.weight.copy_(old.b_proj.weight)
    new.o_norm.weight[:Ko] = old.o_norm.weight * math.sqrt(Ko / Kn)
    new.o_norm.weight[Ko:] = old.o_norm.weight.mean() * math.sqrt(Ko / Kn)
    o = new.o_proj.weight.view(-1, H, Kn)
    o[:, :, Ko:] = 0.0
    o[:, :, :Ko] = old.o_proj.weight.view(-1, H, Ko)
