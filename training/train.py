"""Train the default K3 model from scratch on the synthetic tasks, then export it in the HF K3 layout.

    python -m training.train --out runs/k3-default --workers 2 --steps 900 --tokens-per-step 2048

Plain PyTorch on CPU, data-parallel over ``workers`` processes (``parallel.py``; ``tokens_per_step`` is per
process), deterministic for a given seed, worker count and thread count; or on one GPU (``--device cuda``,
one process, batches drawn ahead in a helper process, deterministic up to CUDA's atomic adds). Training uses a compact
float-expert copy of ``k3-default.json`` (vocabulary = used ids, see ``vocab.py``; experts as float masters
under MXFP4 fake-quant from ``qat_from`` on, see ``qat.py``). Export writes ``<out>/model`` (the shipped
checkpoint: full vocabulary, MXFP4 experts, bf16) and ``<out>/bf16`` (same weights, experts in bf16, for
the MXFP4-vs-bf16 agreement check; not shipped; ``export.py``), plus ``used_ids.json``, ``train_log.json`` and
with ``save_every`` compact snapshots ``<out>/compact/step_<k>.safetensors``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from k3serve.core.config import ModelConfig
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.moe import MoEGate
from k3serve.models.kimi import build_model
from training import data, induction, keyed, parallel
from training.config import TrainConfig, add_arguments
from training.export import compact_config, export, load_params, save_compact, snapshot_shifts
from training.forward import train_forward
from training.grow import import_checkpoint
from training.init import context_heads, init_for_training
from training.tok import load_tokenizer
from training.qat import enable_qat, expert_modules
from training.vocab import CompactVocab


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


class LoadTracker:
    """Counts routed tokens per expert for aux-loss-free balancing (bias += u · sign(mean - load))."""

    def __init__(self, model: nn.Module):
        self.gates = [m for m in model.modules() if isinstance(m, MoEGate)]
        self.loads: dict[int, torch.Tensor] = {}
        for i, g in enumerate(self.gates):
            g.register_forward_hook(lambda mod, inp, out, i=i: self.loads.__setitem__(
                i, torch.bincount(out[1].flatten(), minlength=mod.weight.shape[0]).float()))

    @torch.no_grad()
    def update(self, u: float, world: int = 1) -> None:
        """Step every router bias against its expert loads, summed over ranks so all ranks agree."""
        loads = [self.loads.get(i, g.weight.new_zeros(g.weight.shape[0])) for i, g in enumerate(self.gates)]
        parallel.sum_(loads, world)
        for g, load in zip(self.gates, loads):
            g.e_score_correction_bias += u * torch.sign(load.mean() - load)
        self.loads.clear()


def step_loss(model: nn.Module, vocab: CompactVocab, batch: list[data.Encoded],
              by_kind: dict[str, list[float]] | None = None, weights: Mapping[str, float] | None = None,
              lookup_in: str = "all") -> tuple[torch.Tensor, int]:
    """Mean loss over the answer tokens of the batch, and how many there were; ``by_kind`` (if given)
    accumulates ``[loss sum, tokens]`` per task kind, which shows which task the model has not learnt.
    ``weights`` maps the MLA attention supervisions (the names of ``induction.KINDS``) to the weight of each
    one's loss added to the language-model loss (absent or 0: off);
    ``by_kind`` logs each one under its name. ``lookup_in="values"`` keeps the lookups to
    ``keyed.value_positions``. The batch is assembled on the host and moved to the model's device in one copy
    each."""
    device = next(model.parameters()).device
    lens = [len(e.ids) for e in batch]
    flat = torch.tensor([i for e in batch for i in vocab.to_compact(e.ids)], device="cpu")
    pos, off = [], 0
    for e, n in zip(batch, lens):
        # each answer token's predecessor, for every answer span of the sample
        pos += [torch.arange(off + a - 1, off + b - 1, device="cpu") for a, b in e.answers]
        off += n
    pos_t = torch.cat(pos)
    target = flat[pos_t + 1].to(device)
    weights = {name: w for name, w in (weights or {}).items() if w > 0}
    unknown = set(weights) - set(induction.KINDS)
    if unknown:
        raise ValueError(f"unknown attention supervision {sorted(unknown)}; known: {sorted(induction.KINDS)}")
    taps = induction.MLAInputs(model) if weights else None
    with taps or contextlib.nullcontext():
        hidden = train_forward(model, list(flat.to(device).split(lens)))
    per_token = vocab.loss(model.compute_logits(hidden[pos_t.to(device)]), target, reduction="none")
    loss = per_token.mean()
    in_values = None  # each sample's keyed.value_positions, found once for every supervision kept to them
    for name, weight in weights.items():
        targets_of, avoid, head, values = induction.KINDS[name]
        if values or (name == "lookup_attn" and lookup_in == "values"):
            in_values = in_values or [keyed.value_positions(e.ids, e.kind) for e in batch]
            targets = [targets_of(e.ids, e.answers, only=only) for e, only in zip(batch, in_values)]
        else:
            targets = [targets_of(e.ids, e.answers) for e in batch]
        attn, n_attn = induction.attention_loss(taps, lens, targets, avoid, head)
        loss = loss + weight * attn
        if by_kind is not None and n_attn:
            acc = by_kind.setdefault(name, [0.0, 0])
            acc[0] += attn.item() * n_attn
            acc[1] += n_attn
    if by_kind is not None:
        host = per_token.detach().cpu().tolist()
        off = 0
        for e in batch:
            acc = by_kind.setdefault(e.kind, [0.0, 0])
            acc[0] += sum(host[off:off + e.n_answer])
            acc[1] += e.n_answer
            off += e.n_answer
    return loss, target.numel()


@torch.no_grad()
def probe_losses(model: nn.Module, vocab: CompactVocab, probe: list[data.Encoded]) -> dict[str, float]:
    """Loss on a fixed batch with the experts as float masters and as MXFP4: the measured cost of
    quantising them (before QAT that is post-training quantisation; after it, what QAT left)."""
    experts = expert_modules(model)
    was_qat = parametrize.is_parametrized(experts[0], "w13")

    def drop_qat() -> None:
        for m in experts:
            for name in ("w13", "w2"):
                parametrize.remove_parametrizations(m, name, leave_parametrized=False)

    if was_qat:
        drop_qat()
    float_loss = step_loss(model, vocab, probe)[0].item()
    enable_qat(model)
    mxfp4_loss = step_loss(model, vocab, probe)[0].item()
    if not was_qat:
        drop_qat()
    return {"probe_loss_float": round(float_loss, 4), "probe_loss_mxfp4": round(mxfp4_loss, 4)}


def training_model(cfg: TrainConfig, full: ModelConfig, vocab: CompactVocab) -> nn.Module:
    """The compact model a run starts from: initialised, then ``init_from`` loaded, then the KDA context heads
    (``split_shifts``) the source lacks."""
    model = build_model(compact_config(full, vocab))
    init_for_training(model, cfg.seed, cfg.embed_std, cfg.mla_init_std, cfg.prev_token_init, cfg.split_residual)
    source, have = Path(cfg.init_from) if cfg.init_from else None, 0
    if source is not None and source.is_dir():
        import_checkpoint(model, vocab, source)
    elif source is not None:
        load_params(model, vocab, source)
        have = snapshot_shifts(source)
    # After any import, and only the heads the source lacks: a continued snapshot's context heads have trained
    # on, and setting them again would restart the run (loss back near 11) instead of continuing it.
    if cfg.split_shifts > have:
        first_kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
        context_heads(first_kda, cfg.split_shifts, full.text.hidden_size // 2, start=have)
    return model


def train(cfg: TrainConfig, tokenizer, rank: int = 0, world: int = 1) -> tuple[nn.Module, CompactVocab, list[dict]]:
    """Train on this rank's share of the batches (``tokens_per_step`` per rank and step)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)  # decayed weights and states in the denormal range slow CPU math many-fold
    full = ModelConfig.from_file(cfg.config)
    vocab = CompactVocab(data.inventory(tokenizer, cfg.seed + 1, style=cfg.style), full.text.vocab_size)
    model = training_model(cfg, full, vocab)
    model.to(cfg.device)
    if rank == 0:  # first, so compact snapshots are usable while the run goes on
        (cfg.out / "used_ids.json").write_text(json.dumps(vocab.ids))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or "gate.weight" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), fused=True)
    tracker = LoadTracker(model)
    log: list[dict] = []
    stats: dict[str, int] = {}
    t0, toks, window, kinds = time.time(), 0, [], {}
    qat_step = int(cfg.qat_from * cfg.steps)
    # On a GPU the host is the bottleneck: the batches are drawn in a helper process, ahead of the steps.
    draw = data.batches if cfg.device == "cpu" else data.prefetched
    data_seed = cfg.seed if cfg.data_seed < 0 else cfg.data_seed
    stream = draw(tokenizer, vocab, seed=data_seed + 2 + 1000 * rank, steps=cfg.steps,
                  tokens_per_step=cfg.tokens_per_step, stats=stats, warmup=cfg.copy_warmup,
                  progress_from=cfg.progress_from, history=cfg.history_frac, mix=cfg.task_mix,
                  style=cfg.style, lookahead=cfg.pack_lookahead)
    probe = next(data.batches(tokenizer, vocab, seed=cfg.seed + 3, steps=1, tokens_per_step=cfg.tokens_per_step,
                              style=cfg.style))
    last = cfg.stop_after or cfg.steps
    for step, batch in zip(range(last), stream):  # range first: a stopped run draws no batch past its end
        if step == qat_step:
            log.append({"step": step, "before_qat": probe_losses(model, vocab, probe)})
            enable_qat(model)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        with parametrize.cached():
            loss, _ = step_loss(model, vocab, batch, kinds, cfg.attn_weights, cfg.lookup_in)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        parallel.average_grads(list(model.parameters()), world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        tracker.update(cfg.bias_update, world)
        toks += sum(len(e.ids) for e in batch) * world
        window.append(loss.detach())  # read back once per log line, not once per step
        if (step + 1) % cfg.log_every == 0 or step + 1 == last:
            entry = {"step": step + 1, "loss": torch.stack(window).mean().item(), "tokens": toks,
                     "seconds": round(time.time() - t0, 1), "tok_per_s": round(toks / (time.time() - t0), 1),
                     "qat": step >= qat_step, "skipped": stats.get("skipped", 0),
                     "kind_loss": {k: round(v[0] / max(1, v[1]), 3) for k, v in sorted(kinds.items())}}
            window, kinds = [], {}
            log.append(entry)
            if rank == 0:
                print(json.dumps(entry), flush=True)
        if rank == 0 and cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == last):
            meta = {"config": str(cfg.config), "split_shifts": str(cfg.split_shifts)}
            save_compact(model, cfg.out / "compact" / f"step_{step + 1}.safetensors", meta)
            write_log(cfg, vocab, log)
    stream.close()  # a stopped run's prefetching helper (GPU) goes now, not at garbage collection
    log.append({"step": last, "final": probe_losses(model, vocab, probe)})
    if rank == 0:
        print(json.dumps(log[-1]), flush=True)
    return model, vocab, log


def write_log(cfg: TrainConfig, vocab: CompactVocab, log: list[dict]) -> None:
    meta = {"config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()}, "used_ids": len(vocab), "log": log}
    (cfg.out / "train_log.json").write_text(json.dumps(meta, indent=1))



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.splitlines()[0])
    add_arguments(p)
    try:
        cfg = TrainConfig(**vars(p.parse_args(argv)))
    except ValueError as e:  # a bad value: one line and exit status 2, as argparse does for its own checks
        p.error(str(e))
    cfg.out.mkdir(parents=True, exist_ok=True)
    rendezvous = cfg.out / ".rendezvous"
    rendezvous.unlink(missing_ok=True)
    parallel.launch(_worker, cfg.workers, cfg)
    return 0


def _worker(rank: int, world: int, cfg: TrainConfig) -> None:
    parallel.init(rank, world, cfg.out / ".rendezvous")
    try:
        model, vocab, log = train(cfg, load_tokenizer(), rank, world)
    finally:
        parallel.finish(world)
    if rank == 0:
        write_log(cfg, vocab, log)
        model_dir, bf16_dir = export(model, vocab, cfg.config, cfg.out)
        print(f"wrote {model_dir} and {bf16_dir}")


if __name__ == "__main__":
    raise SystemExit(main())
