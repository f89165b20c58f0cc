"""Training an eagle3 head (``models/eagle.py``) for a target model: what ``k3serve spec train`` runs.

1. collect: the target answers every prompt greedily through the engine (its own answers are the
   self-distillation targets), then one prefill of ``prompt + answer`` with the head's feature layers captured
   gives the features ``[T, F]`` at every answer position. Kept in ``OUT/data.safetensors``: per answer position
   p (prompt end - 1 .. end - 2) ``features [S, F]``, ``inputs [S, D]`` = tokens ``t[p+1 .. p+D]`` and
   ``labels [S, D]`` = ``t[p+2 .. p+D+1]`` (-1 past the end), D = ``depth``.
2. draft vocabulary: the ``draft_vocab_size`` tokens the answers use most (``d2t``); labels outside it are
   not learnt (those drafts are never proposed).
3. train: each sample is unrolled ``depth`` steps as the drafter runs it (step 1 from the target's features,
   step j from the head's own hidden of step j-1, the true tokens as inputs): cross-entropy over the draft
   vocabulary, AdamW. A checkpoint per epoch (``OUT/checkpoint/``: weights, optimizer moments, state.json);
   a rerun with the same OUT skips the collection and continues after the last finished epoch.
4. save: ``OUT/config.json`` + ``OUT/model.safetensors`` (loadable by ``{"method": "eagle3", "model": OUT}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from k3serve.core.context import ForwardContext, forward_context
from k3serve.engine.spec.eagle import input_embeddings
from k3serve.models.cache import allocate_caches, cache_spec
from k3serve.models.eagle import EagleConfig, EagleHead, default_feature_layers


@dataclass(frozen=True)
class TrainOptions:
    max_tokens: int = 96  # answer length cap per prompt
    depth: int = 3  # drafting steps unrolled per sample
    epochs: int = 4
    batch_size: int = 256
    lr: float = 2e-3
    draft_vocab_size: int = 4096
    intermediate_size: int = 0  # 0: 4 x hidden
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_tokens", "depth", "epochs", "batch_size", "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"spec train: {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"spec train: lr must be > 0, got {self.lr}")


def generate_answers(engine, prompts: list[list[int]], max_tokens: int, progress: bool) -> list[list[int]]:
    """The target's greedy answers (stopping at its EOS ids), through ``engine`` (an ``LLMEngine``)."""
    from k3serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    with tqdm(total=len(prompts), desc="answering", unit="prompt", disable=not progress) as bar:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
                    bar.update(1)
    return [done[str(i)] for i in range(len(prompts))]


@torch.inference_mode()
def capture_features(model, ids: list[int], layers: tuple[int, ...], block_size: int = 16) -> torch.Tensor:
    """The target's outputs of ``layers`` at every position of ``ids`` (one prefill): ``[len(ids), F]``."""
    blocks = (len(ids) + block_size - 1) // block_size
    caches = allocate_caches(cache_spec(model, torch.float32), num_blocks=blocks, block_size=block_size,
                             num_slots=1)
    ctx = ForwardContext(cu_seqlens=torch.tensor([0, len(ids)]), cached_lens=[0], state_slots=torch.tensor([0]),
                         block_tables=torch.arange(blocks)[None], caches=caches, capture=dict.fromkeys(layers))
    with forward_context(ctx):
        model(torch.tensor(ids, dtype=torch.long), ctx)
    return torch.cat([ctx.capture[i] for i in layers], dim=-1).float()


def samples(model, prompt: list[int], answer: list[int], layers: tuple[int, ...],
            depth: int) -> dict[str, torch.Tensor]:
    """One sequence's training samples (see the module docstring), or empty tensors for an empty answer."""
    t = prompt + answer
    first, last = len(prompt) - 1, len(t) - 2  # positions whose next token is known and has a successor
    feats = capture_features(model, t[:-1], layers)[first:last + 1]
    padded = torch.tensor(t + [-1] * (depth + 1))
    pos = torch.arange(first, last + 1)[:, None] + torch.arange(depth)[None]
    return {"features": feats, "inputs": padded[pos + 1], "labels": padded[pos + 2]}


def collect(model, engine, prompts: list[list[int]], layers: tuple[int, ...], opts: TrainOptions,
            progress: bool) -> dict[str, torch.Tensor]:
    answers = generate_answers(engine, prompts, opts.max_tokens, progress)
    parts = [samples(model, p, a, layers, opts.depth)
             for p, a in tqdm(list(zip(prompts, answers)), desc="hidden states", unit="seq", disable=not progress)
             if len(a) >= 2]
    if not parts:
        raise ValueError("spec train: the target gave no answer of 2 tokens or more; nothing to learn from")
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def draft_vocab(labels: torch.Tensor, inputs: torch.Tensor, size: int, vocab: int) -> torch.Tensor:
    """``d2t``: the ``size`` most frequent answer tokens (ties: lower id), most frequent first."""
    toks = torch.cat([labels.flatten(), inputs.flatten()])
    counts = torch.bincount(toks[toks >= 0], minlength=vocab)
    size = min(size, vocab)
    return torch.sort(counts, descending=True, stable=True).indices[:size]


def head_loss(head: EagleHead, embed: torch.Tensor, t2d: torch.Tensor, features: torch.Tensor,
              inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over the learnable steps, step-1 top-1 accuracy on them)."""
    hidden, losses, acc = None, [], None
    for j in range(inputs.shape[1]):
        tok = inputs[:, j]
        live = tok >= 0
        logits, hidden = head.step(embed[tok.clamp(min=0)], features if j == 0 else None, hidden)
        target = torch.where(live & (labels[:, j] >= 0), t2d[labels[:, j].clamp(min=0)], -1)
        losses.append(torch.nn.functional.cross_entropy(logits, target, ignore_index=-1, reduction="sum"))
        if j == 0:
            ok = target >= 0
            acc = (logits.argmax(-1)[ok] == target[ok]).float().mean() if ok.any() else torch.tensor(0.0)
    n = (labels >= 0).sum().clamp(min=1)
    return torch.stack(losses).sum() / n, acc


class Checkpoint:
    """``OUT/checkpoint``: the head's weights, AdamW's moments and ``state.json`` (epochs done)."""

    def __init__(self, out: Path):
        self.dir = out / "checkpoint"

    def epochs_done(self) -> int:
        f = self.dir / "state.json"
        return json.loads(f.read_text())["epochs_done"] if f.is_file() else 0

    def save(self, head: EagleHead, opt: torch.optim.Optimizer, epochs_done: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        head.save(self.dir)
        moments = {f"{i}.{k}": v.detach().clone() if v.dim() else v.reshape(1).clone()
                   for i, st in enumerate(opt.state[p] for g in opt.param_groups for p in g["params"])
                   for k, v in st.items()}
        save_file(moments, str(self.dir / "optim.safetensors"))
        (self.dir / "state.json").write_text(json.dumps({"epochs_done": epochs_done}))

    def restore(self, head: EagleHead, opt: torch.optim.Optimizer) -> int:
        done = self.epochs_done()
        if done == 0:
            return 0
        head.load_state_dict(load_file(str(self.dir / "model.safetensors")))
        moments = load_file(str(self.dir / "optim.safetensors"))
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
            st = {k.split(".", 1)[1]: v for k, v in moments.items() if k.split(".", 1)[0] == str(i)}
            if st:
                opt.state[p] = {k: v.reshape(()) if k == "step" else v for k, v in st.items()}
        return done


def train_head(model, engine, prompts: list[list[int]], out: str | Path, opts: TrainOptions = TrainOptions(),
               progress: bool = True, log=print) -> EagleHead:
    """Collect (or reuse ``OUT/data.safetensors``), train (resuming from ``OUT/checkpoint``), save; the head."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    embed = input_embeddings(model).detach().float()
    vocab, d = embed.shape
    layers = default_feature_layers(len(getattr(model, "language_model", model).model.layers))
    data_file = out / "data.safetensors"
    if data_file.is_file():
        data = load_file(str(data_file))
        log(f"spec train: reusing {len(data['labels'])} samples from {data_file}")
    else:
        data = collect(model, engine, prompts, layers, opts, progress)
        save_file(data, str(data_file))
    if data["features"].shape[1] != len(layers) * d or data["inputs"].shape[1] != opts.depth:
        raise ValueError(f"spec train: {data_file} was collected for another model or depth; remove it")
    d2t = draft_vocab(data["labels"], data["inputs"], opts.draft_vocab_size, vocab)
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    cfg = EagleConfig(hidden_size=d, vocab_size=vocab, feature_layers=layers, draft_vocab_size=len(d2t),
                      intermediate_size=opts.intermediate_size or 4 * d)
    torch.manual_seed(opts.seed)
    head = EagleHead(cfg)
    head.d2t.copy_(d2t)
    opt = torch.optim.AdamW(head.parameters(), lr=opts.lr, weight_decay=0.0)
    ckpt = Checkpoint(out)
    start = ckpt.restore(head, opt)
    if start:
        log(f"spec train: resuming after epoch {start} of {opts.epochs}")
    S = len(data["labels"])
    for epoch in range(start, opts.epochs):
        order = torch.randperm(S, generator=torch.Generator().manual_seed(opts.seed + epoch))
        bar = tqdm(range(0, S, opts.batch_size), desc=f"epoch {epoch + 1}/{opts.epochs}", unit="batch",
                   disable=not progress)
        for at in bar:
            idx = order[at:at + opts.batch_size]
            loss, acc = head_loss(head, embed, t2d, data["features"][idx], data["inputs"][idx], data["labels"][idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc1=f"{acc.item():.2f}")
        ckpt.save(head, opt, epoch + 1)
    head.save(out)
    return head.eval()
