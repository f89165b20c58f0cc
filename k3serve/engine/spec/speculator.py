"""The scheduler's side of speculative decoding: how many drafts a decode row gets this step, and from where.

A decode row gets ``k = num_speculative_tokens`` drafts from the drafter, capped so that its window stays
inside the request's limits (``max_tokens``, ``max_model_len``) and the step's token budget. While more than ``max_running`` requests run,
speculation backs off to k = 0: large batches are compute-bound and drafts would only cost. A row with k = 0
still takes the verify path (``rollback.Rollback``); drafts are never a special case.

Drafters without a model see only the request's tokens (``propose(token_ids, k)``); the model drafters
(``draft_model``, ``eagle3``) keep per-request state and see the request (``propose_for(req, k)``).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    return EagleDrafter.load(config.model, target.model, target.vocab_size, device=target.device)


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
        # the window appends up to k + 1 tokens: all must fit max_tokens and max_model_len
        k = min(k, req.max_tokens - req.num_output_tokens - 1, req.max_model_len - req.num_tokens - 1, budget - 1)
        return max(k, 0)

    def release(self, request_id: str) -> None:
        """``request_id`` finished: a drafter keeping per-request state (``draft_model``) drops it."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(request_id)

    def propose(self, req: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        propose_for = getattr(self.drafter, "propose_for", None)
        if propose_for is not None:
            return propose_for(req, k)[:k]
        return self.drafter.propose(req.token_ids, k)[:k]
