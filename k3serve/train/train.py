"""Train the default K3 model from scratch on the synthetic tasks, then export it in the HF K3 layout.

    python -m k3serve.train.train --out runs/k3-default --workers 2 --steps 900 --tokens-per-step 2048

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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from k3serve.core.config import ModelConfig
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.moe import MoEGate
from k3serve.models.kimi import build_model
from k3serve.models.registry import CONFIG_DIR
from k3serve.train import data, induction, parallel, tasks
from k3serve.train.export import compact_config, export, load_params, save_compact
from k3serve.train.forward import train_forward
from k3serve.train.grow import import_checkpoint, is_checkpoint_dir
from k3serve.train.init import context_heads, init_for_training
from k3serve.train.tok import load_tokenizer
from k3serve.train.qat import enable_qat, expert_modules
from k3serve.train.vocab import CompactVocab

DEFAULT_CONFIG = CONFIG_DIR / "k3-default.json"


@dataclass(frozen=True)
class TrainConfig:
    """A training run; every field is a flag of the same name, described in ``HELP`` (``--help``)."""

    out: Path
    config: Path = DEFAULT_CONFIG
    seed: int = 0
    steps: int = 900
    tokens_per_step: int = 4096
    lr: float = 3e-3
    warmup: int = 30
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    qat_from: float = 0.6
    bias_update: float = 1e-3
    threads: int = 1
    workers: int = 1
    log_every: int = 10
    save_every: int = 0
    device: str = "cpu"
    init_from: str = ""
    progress_from: float = 0.0
    copy_share: float = 0.0
    copy_until: float = 0.0
    copy_after: float = 0.0
    lookup_frac: float = 0.0
    recall_frac: float = 0.0
    induce_frac: float = 0.0
    induce_until: float = 0.0
    assoc_frac: float = 0.0
    induce_long: int = 0
    history_frac: float = 0.0
    lookup_objects: float = 0.0
    mix: str = ""
    request_form: str = "inline"
    reasoning: str = "plain"
    nothink: str = "bare"
    recall_form: str = "passage"
    embed_std: float = 1.0
    mla_init_std: float = 0.0
    prev_token_init: int = 0
    attn_sup: float = 0.0
    attn_miss: float = 0.0
    attn_lookup: float = 0.0
    lookup_in: str = "all"
    attn_types: float = 0.0
    split_residual: bool = False
    split_shifts: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "tokens_per_step", "threads", "workers", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.split_shifts < 0:
            raise ValueError("split_shifts must be >= 0")
        if self.lookup_in not in ("all", "values"):
            raise ValueError(f"lookup_in must be 'all' or 'values', got {self.lookup_in!r}")
        if self.save_every < 0:
            raise ValueError("save_every must be >= 0")
        if not 0.0 <= self.qat_from <= 1.0:
            raise ValueError("qat_from must be in [0, 1]")
        if not 0.0 <= self.progress_from <= 1.0:
            raise ValueError("progress_from must be in [0, 1]")
        if not 0.0 <= self.history_frac <= 1.0:
            raise ValueError("history_frac must be in [0, 1]")
        if self.init_from and not (Path(self.init_from).is_file() or is_checkpoint_dir(Path(self.init_from))):
            raise ValueError(f"init_from: no compact snapshot or checkpoint directory at {self.init_from}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device != "cpu" and self.workers != 1:
            raise ValueError("a GPU run uses one process (--workers 1)")
        self.style  # validates
        self.copy_warmup  # validates
        self.task_mix  # validates

    @property
    def task_mix(self) -> dict[str, float]:
        return data.parse_mix(self.mix)

    @property
    def style(self) -> tasks.Style:
        return tasks.Style(self.request_form, self.reasoning, self.nothink, self.recall_form)

    @property
    def copy_warmup(self) -> data.CopyWarmup:
        return data.CopyWarmup(self.copy_share, self.copy_until, self.copy_after, self.lookup_frac,
                              self.recall_frac, self.induce_frac, self.induce_until, self.assoc_frac,
                              self.induce_long, self.lookup_objects)


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
              by_kind: dict[str, list[float]] | None = None, attn_weight: float = 0.0,
              miss_weight: float = 0.0, lookup_weight: float = 0.0, lookup_in: str = "all",
              type_weight: float = 0.0) -> tuple[torch.Tensor, int]:
    """Mean loss over the answer tokens of the batch, and how many there were; ``by_kind`` (if given)
    accumulates ``[loss sum, tokens]`` per task kind, which shows which task the model has not learnt.
    ``attn_weight`` > 0 adds that times the MLA attention supervision of ``induction.py`` (logged as kind
    ``attn``), ``miss_weight`` > 0 that times its loss on the misses (kind ``miss``), ``lookup_weight``
    > 0 that times head 1's loss on the lookups (kind ``lookup_attn``; ``lookup_in="values"`` keeps them to
    ``induction.value_positions``), ``type_weight`` > 0 that times its loss pointing an argument's type at
    where the request writes the key's value (kind ``type_attn``). The batch is assembled on the host
    and moved to the model's device in one copy each."""
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
    weights = {"attn": attn_weight, "miss": miss_weight, "lookup_attn": lookup_weight, "type_attn": type_weight}
    taps = induction.MLAInputs(model) if max(weights.values()) > 0 else None
    with taps or contextlib.nullcontext():
        hidden = train_forward(model, list(flat.to(device).split(lens)))
    per_token = vocab.loss(model.compute_logits(hidden[pos_t.to(device)]), target, reduction="none")
    loss = per_token.mean()
    for name, weight in weights.items():
        if weight > 0:
            targets_of, avoid, head = induction.KINDS[name]
            values = name == "lookup_attn" and lookup_in == "values"
            targets = [targets_of(e.ids, e.answers, only=induction.value_positions(e.ids, e.kind) if values else None)
                       for e in batch]
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


def train(cfg: TrainConfig, tokenizer, rank: int = 0, world: int = 1) -> tuple[nn.Module, CompactVocab, list[dict]]:
    """Train on this rank's share of the batches (``tokens_per_step`` per rank and step)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)  # decayed weights and states in the denormal range slow CPU math many-fold
    full = ModelConfig.from_file(cfg.config)
    vocab = CompactVocab(data.inventory(tokenizer, cfg.seed + 1, style=cfg.style), full.text.vocab_size)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, cfg.seed, cfg.embed_std, cfg.mla_init_std, cfg.prev_token_init, cfg.split_residual)
    if cfg.init_from and Path(cfg.init_from).is_dir():
        import_checkpoint(model, vocab, Path(cfg.init_from))
    elif cfg.init_from:
        load_params(model, vocab, Path(cfg.init_from))
    if cfg.split_shifts:  # after any import: a run may continue a checkpoint with more context heads
        first_kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
        context_heads(first_kda, cfg.split_shifts, full.text.hidden_size // 2)
    model.to(cfg.device)
    if rank == 0:  # first, so compact snapshots are usable while the run goes on
        (cfg.out / "used_ids.json").write_text(json.dumps(vocab.ids))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or "gate.weight" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    tracker = LoadTracker(model)
    log: list[dict] = []
    stats: dict[str, int] = {}
    t0, toks, window, kinds = time.time(), 0, [], {}
    qat_step = int(cfg.qat_from * cfg.steps)
    # On a GPU the host is the bottleneck: the batches are drawn in a helper process, ahead of the steps.
    draw = data.batches if cfg.device == "cpu" else data.prefetched
    stream = draw(tokenizer, vocab, seed=cfg.seed + 2 + 1000 * rank, steps=cfg.steps,
                  tokens_per_step=cfg.tokens_per_step, stats=stats, warmup=cfg.copy_warmup,
                  progress_from=cfg.progress_from, history=cfg.history_frac, mix=cfg.task_mix,
                  style=cfg.style)
    probe = next(data.batches(tokenizer, vocab, seed=cfg.seed + 3, steps=1, tokens_per_step=cfg.tokens_per_step,
                              style=cfg.style))
    for step, batch in enumerate(stream):
        if step == qat_step:
            log.append({"step": step, "before_qat": probe_losses(model, vocab, probe)})
            enable_qat(model)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        with parametrize.cached():
            loss, _ = step_loss(model, vocab, batch, kinds, cfg.attn_sup, cfg.attn_miss, cfg.attn_lookup,
                                cfg.lookup_in, cfg.attn_types)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        parallel.average_grads(list(model.parameters()), world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        tracker.update(cfg.bias_update, world)
        toks += sum(len(e.ids) for e in batch) * world
        window.append(loss.detach())  # read back once per log line, not once per step
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            entry = {"step": step + 1, "loss": torch.stack(window).mean().item(), "tokens": toks,
                     "seconds": round(time.time() - t0, 1), "tok_per_s": round(toks / (time.time() - t0), 1),
                     "qat": step >= qat_step, "skipped": stats.get("skipped", 0),
                     "kind_loss": {k: round(v[0] / max(1, v[1]), 3) for k, v in sorted(kinds.items())}}
            window, kinds = [], {}
            log.append(entry)
            if rank == 0:
                print(json.dumps(entry), flush=True)
        if rank == 0 and cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
            save_compact(model, cfg.out / "compact" / f"step_{step + 1}.safetensors", {"config": str(cfg.config)})
            write_log(cfg, vocab, log)
    log.append({"step": cfg.steps, "final": probe_losses(model, vocab, probe)})
    if rank == 0:
        print(json.dumps(log[-1]), flush=True)
    return model, vocab, log


def write_log(cfg: TrainConfig, vocab: CompactVocab, log: list[dict]) -> None:
    meta = {"config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()}, "used_ids": len(vocab), "log": log}
    (cfg.out / "train_log.json").write_text(json.dumps(meta, indent=1))


HELP = {
    "config": "model config of the full-vocabulary model to train (HF K3 config.json)",
    "seed": "seed of the data, the init and the run (same seed, workers, threads -> same run)",
    "steps": "optimizer steps",
    "tokens_per_step": "tokens per step and per worker (whole samples, packed)",
    "lr": "peak AdamW learning rate",
    "warmup": "steps of linear learning-rate warm-up (then cosine decay)",
    "min_lr_frac": "final learning rate as a fraction of --lr",
    "weight_decay": "AdamW weight decay",
    "clip": "gradient-norm clip",
    "qat_from": "fraction of the steps after which experts train under MXFP4 fake-quant (1.0: never)",
    "bias_update": "step of the aux-loss-free expert balancing bias (e_score_correction_bias)",
    "threads": "torch threads per process",
    "workers": "data-parallel processes on the CPU (one per core; a GPU run uses 1)",
    "log_every": "steps between log lines (loss, tokens/s, per-kind answer loss)",
    "save_every": "also write a compact snapshot <out>/compact/step_<k>.safetensors every this many steps (0: off)",
    "device": "cpu, or cuda[:N] to train on one GPU",
    "init_from": "continue from this compact snapshot (same data code and seed), or start from an HF-format "
                 "checkpoint directory (KDA heads may grow wider: train/grow.py), instead of a fresh init",
    "progress_from": "start the curriculum at this fraction of its course (1.0: the final task mix throughout)",
    "copy_share": "share of warm-up samples (plain copies, lookups, short recall lists) until --copy-until",
    "copy_until": "fraction of the steps until which --copy-share holds",
    "copy_after": "share of warm-up samples after --copy-until",
    "lookup_frac": "fraction of the warm-up samples that are key -> value lookups",
    "recall_frac": "fraction of the warm-up samples that are recall lists",
    "induce_frac": "fraction of the warm-up samples that are synthetic token copies (raw ids, not chats)",
    "induce_until": "fraction of the steps at the start in which every sample is a synthetic token copy",
    "assoc_frac": "fraction of the synthetic samples that are associative recall (keyed values asked back) instead of copies",
    "induce_long": "synthetic copies lengthen with the recall lists up to this many tokens (0: 4-24 throughout)",
    "history_frac": "fraction of the samples (not recall lists) with 1-3 earlier short exchanges in front",
    "lookup_objects": "fraction of the lookups that ask keys in quotes and are answered as an object (the "
                      "call's key tokens; run wk5: 0.5)",
    "mix": "task weights after the warm-up, each replacing its default (recall's is scaled down as its lists "
           "lengthen, to keep its token share): e.g. recall=0,choose=0.3; defaults: "
           + ",".join(f"{k}={v}" for k, v in data.MIX.items()),
    "request_form": "how requests write the values to use: inline ('city \"Paris\"; unit ...') or lines (one "
                    "'city: \"Paris\"' per line: the key is the token the call writes)",
    "reasoning": "how a decline's reasoning decides: plain ('No tool does that.') or check (names the tool that "
                 "would do it, then 'is not offered', as a call's reasoning names the tool it calls)",
    "nothink": "what tool, choose and decline answers say without thinking: bare (a call's content is empty) or "
               "decide (the content opens with the reasoning's sentences, so the name comes before the decision)",
    "recall_form": "how recall lists write records and the answer copies one: passage ('Record 237: \"w1 ...\"', "
                   "answered 'w1 ...') or restate ('Record 237 w1 ...', answered with that line)",
    "embed_std": "std of the initial embedding rows (tied with lm_head)",
    "prev_token_init": "start head 0 of this many leading KDA layers as a previous-token head (0: none)",
    "attn_sup": "weight of the loss that teaches head 0 of each MLA layer to attend where an induction head "
                "would (train/induction.py; 0: off)",
    "attn_miss": "weight of the loss that teaches the same heads not to copy where an induction copy would be "
                 "wrong (the token occurred before in the same answer, never followed by the next token; 0: off)",
    "attn_lookup": "weight of the loss that teaches head 1 of each MLA layer to attend to the prompt positions "
                   "holding the next answer token where no induction step gives it (train/induction.py; 0: off)",
    "lookup_in": "where the lookups are supervised: all (every answer token) or values (a call's argument blocks "
                 "and a JSON answer; warm-ups and recall whole: the reasoning and the tool's name are left alone)",
    "attn_types": "weight of the loss that points head 1's query at an argument's type to where the request "
                  "writes that key's value (its first token shows the type; train/induction.py; 0: off)",
    "split_residual": "start token embeddings in the first half of the residual and a previous-token KDA head "
                      "writing the second half, for MLA keys to match on (train/init.py)",
    "split_shifts": "make heads 0..N-1 of the first KDA layer previous-token heads for the N tokens before, "
                    "written into the residual's second half with halving gains (train/init.py context_heads; "
                    "0: leave them)",
    "mla_init_std": "std of the initial MLA q_b/kv_a/kv_b/o projections (0: the writer's flat 0.02)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="run directory (checkpoints, logs)")
    for f in dataclasses.fields(TrainConfig):
        if isinstance(f.default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true", help=HELP[f.name])
        elif f.name != "out":
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default) if f.name != "config" else Path,
                           default=f.default, help=HELP[f.name] + " (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3serve.train.train", description=__doc__.splitlines()[0])
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
