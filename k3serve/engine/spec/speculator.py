"""The scheduler's side of speculative decoding: how many drafts a decode row gets this step, and from where.

A decode row gets ``k = num_speculative_tokens`` drafts from the drafter, capped so that its window stays
inside the request's limits (``max_tokens``, ``max_model_len``) and the step's token budget. While more than ``max_running`` requests run,
speculation backs off to k = 0: large batches are compute-bound and drafts would only cost. A row with k = 0
still takes the verify path (``rollback.Rollback``); drafts are never a special case.

Drafters without a model see only the request's tokens (``propose(token_ids, k)``); the model drafters
(``draft_model``, ``eagle3``) keep per-request state and see the request (``propose_for(req, k)``).
``eagle_suffix`` asks both the eagle3 head and the suffix drafter and keeps the drafts with the higher score
(expected accepted drafts, ``suffix.py`` / ``eagle.py``); above ``eagle_max_running`` running requests only the
suffix drafter is asked (its cost per row is a numpy scan, the head's k small forwards).
Finished requests' outputs go to the drafter's ``finished`` hook (the suffix drafter's global response cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from k3serve.engine.request import Request
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.drafters import make_drafter


@dataclass(frozen=True)
class Target:
    """What a model drafter needs to know of the model it drafts for."""
    model: nn.Module
    vocab_size: int
    max_model_len: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    max_num_seqs: int = 1024
    model_dir: str | Path | None = None  # the target's name or checkpoint path (where a shipped head lives)


def default_head(target: Target) -> Path:
    """The eagle3 head shipped with the target (``<checkpoint>/eagle3``); ValueError when there is none."""
    from k3serve.models.registry import resolve_model_path

    head = resolve_model_path(target.model_dir) / "eagle3" if target.model_dir is not None else None
    if head is None or not (head / "config.json").is_file():
        raise ValueError("speculative_config: no eagle3 head ships with this model; give 'model' (a head from "
                         "k3serve spec train)")
    return head


def check_fits(config: SpeculativeConfig, vocab_size: int, hidden_size: int, num_layers: int) -> None:
    """ValueError with one line when ``config``'s draft model or eagle3 head does not fit a target of this
    shape (another vocabulary; a head reading another hidden size or layers the target lacks). Reads config
    files only: the server runs it before any process starts."""
    if config.method == "draft_model":
        from k3serve.core.config import ModelConfig
        from k3serve.models.registry import resolve_model_path

        vocab = ModelConfig.from_file(resolve_model_path(config.model)).text.vocab_size
        if vocab != vocab_size:
            raise ValueError(f"speculative_config: draft model {config.model!r} has a vocabulary of {vocab} "
                             f"tokens, the target {vocab_size}: they must share the tokenizer")
    elif config.method == "eagle3":
        from k3serve.models.eagle import EagleHead

        try:
            cfg = EagleHead.read_config(config.model)
        except ValueError as e:
            raise ValueError(f"speculative_config: {e}") from None
        where = f"speculative_config: eagle3 head {config.model!r}"
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"{where} has a vocabulary of {cfg.vocab_size} tokens, the target {vocab_size}")
        if cfg.hidden_size != hidden_size:
            raise ValueError(f"{where} reads hidden size {cfg.hidden_size}, the target's is {hidden_size}")
        if max(cfg.feature_layers) >= num_layers:
            raise ValueError(f"{where} reads layer {max(cfg.feature_layers)}, the target has {num_layers}")


def make_model_drafter(config: SpeculativeConfig, target: Target):
    """The ``draft_model`` or ``eagle3`` drafter of ``config``; ValueError with one line when its model does
    not fit the target (another vocabulary)."""
    if config.method == "draft_model":
        from k3serve.engine.spec.draft_model import DraftModelDrafter
        from k3serve.models.loader import load_model
        from k3serve.models.registry import resolve_model_path

        path = resolve_model_path(config.model)
        check_fits(config, target.vocab_size, 0, 0)  # before any weight is read
        model, _ = load_model(path, dtype=target.dtype, progress=False, device=target.device)
        return DraftModelDrafter(model, max_requests=min(config.max_running, target.max_num_seqs), max_len=target.max_model_len,
                                 max_drafts=config.num_speculative_tokens, dtype=target.dtype, device=target.device)
    from k3serve.engine.spec.eagle import EagleDrafter

    path = config.model if config.model is not None else default_head(target)
    return EagleDrafter.load(path, target.model, target.vocab_size, device=target.device,
                             min_prob=config.min_draft_prob)


class EagleSuffixDrafter:
    """``eagle_suffix``: per row, the better-scored drafts of an eagle3 head and a suffix drafter."""

    def __init__(self, eagle, suffix, eagle_max_running: int):
        self.eagle, self.suffix, self.eagle_max_running = eagle, suffix, eagle_max_running
        self.capture_layers = eagle.capture_layers
        self.num_running = 0  # set by ``Speculator.limit`` each step

    def propose_for(self, req, k: int) -> list[int]:
        drafts, score = self.suffix.propose_scored(req.token_ids, k)
        if self.num_running <= self.eagle_max_running:
            other = self.eagle.propose_scored(req, k)
            if other[1] > score:
                drafts = other[0]
        return drafts

    def finished(self, output_token_ids) -> None:
        self.suffix.finished(output_token_ids)


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: Target | None = None):
        self.config = config
        if config.method in ("ngram", "suffix"):
            self.drafter = make_drafter(config.method, prompt_lookup_min=config.prompt_lookup_min,
                                        prompt_lookup_max=config.prompt_lookup_max)
        else:
            if target is None:
                raise ValueError(f"speculative_config: method {config.method!r} needs the target model")
            self.drafter = make_model_drafter(config, target)
            if config.method == "eagle_suffix":
                suffix = make_drafter("suffix", prompt_lookup_min=config.prompt_lookup_min,
                                      prompt_lookup_max=config.prompt_lookup_max)
                self.drafter = EagleSuffixDrafter(self.drafter, suffix, config.eagle_max_running)
        self.num_backoff_steps = 0  # steps in which the batch size turned speculation off

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads (eagle3), else ()."""
        return getattr(self.drafter, "capture_layers", ())

    def limit(self, req: Request, budget: int, num_running: int) -> int:
        """The most drafts ``req`` (a decode row) may get now."""
        k = self.config.num_speculative_tokens
        if k == 0:
            return 0
        if num_running > self.config.max_running:
            return 0
        if isinstance(self.drafter, EagleSuffixDrafter):
            self.drafter.num_running = num_running
        # the window appends up to k + 1 tokens: all must fit max_tokens and max_model_len
        k = min(k, req.max_tokens - req.num_output_tokens - 1, req.max_model_len - req.num_tokens - 1, budget - 1)
        return max(k, 0)

    def propose(self, req: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        propose_for = getattr(self.drafter, "propose_for", None)
        if propose_for is not None:
            return propose_for(req, k)[:k]
        return self.drafter.propose(req.token_ids, k)[:k]

    def finished(self, req: Request) -> None:
        """``req`` left the engine: a model drafter gives its seat back; its output feeds drafters that learn
        from responses (suffix's cache)."""
        release = getattr(self.drafter, "release", None)  # drafters keeping per-request state (draft_model)
        if release is not None:
            release(req.request_id)
        hook = getattr(self.drafter, "finished", None)
        if hook is not None and req.output_token_ids:
            hook(req.output_token_ids)
