"""``EagleDrafter``: k drafts from an EAGLE-3-style head (``models/eagle.py``) over the target's hidden states.

The model runner captures the target's outputs of the head's ``feature_layers`` at each sampling position and
leaves on the request ``spec_features = (p, f [F])``: the features at the position ``p`` whose logits gave
the last sampled token ``t[p + 1]``. A proposal for a request whose tokens are ``t[:L]`` uses them when they are
fresh (``p == L - 2``; else it proposes nothing: the row verifies zero drafts, which captures fresh ones):
step 1 reads ``(embed(t[L-1]), f)``, step j > 1 reads ``(embed(draft j-1), the head's hidden of step j-1)``;
each step's argmax, mapped through ``d2t``, is the next draft; with ``min_prob`` > 0 drafting stops at the first
step whose top probability is below it (a low-confidence draft costs a verify position and is rarely accepted).
``propose_scored`` also returns sum_j prod_{i<=j} p_i over the drafts' top probabilities (the expected number
accepted if the head were calibrated), which ``eagle_suffix`` compares with the suffix drafter's score.
The head has no per-request state, so there is nothing to roll back.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from k3serve.models.eagle import EagleHead


def input_embeddings(model: nn.Module) -> torch.Tensor:
    """The target's token embedding table ``[V, d]`` (K3 wraps the text model in ``language_model``)."""
    text = getattr(model, "language_model", model)
    return text.model.embed_tokens.weight


class EagleDrafter:
    def __init__(self, head: EagleHead, embed: torch.Tensor, min_prob: float = 0.0):
        self.head = head
        self.embed = embed
        self.min_prob = min_prob
        self.capture_layers = head.cfg.feature_layers

    @classmethod
    def load(cls, path: str | Path, target: nn.Module, vocab_size: int,
             device: torch.device | str = "cpu", min_prob: float = 0.0) -> EagleDrafter:
        """The head at ``path`` for ``target``; ValueError with one line when it was trained for another shape."""
        head = EagleHead.load(path, device)
        cfg, embed = head.cfg, input_embeddings(target)
        num_layers = len(getattr(target, "language_model", target).model.layers)
        where = f"speculative_config: eagle3 head {str(path)!r}"
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"{where} has a vocabulary of {cfg.vocab_size} tokens, the target {vocab_size}")
        if cfg.hidden_size != embed.shape[1]:
            raise ValueError(f"{where} reads hidden size {cfg.hidden_size}, the target's is {embed.shape[1]}")
        if max(cfg.feature_layers) >= num_layers:
            raise ValueError(f"{where} reads layer {max(cfg.feature_layers)}, the target has {num_layers}")
        return cls(head.to(embed.dtype), embed, min_prob)

    def propose_for(self, req, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``req``'s tokens (``req``: an ``engine.request.Request``)."""
        return self.propose_scored(req, k)[0]

    @torch.inference_mode()
    def propose_scored(self, req, k: int) -> tuple[list[int], float]:
        """(drafts, score) for ``req`` (see the module docstring)."""
        kept = req.spec_features
        if k <= 0 or kept is None or kept[0] != req.num_tokens - 2:
            return [], 0.0
        tok, features, hidden = req.token_ids[-1], kept[1][None].to(self.embed.dtype), None
        drafts, score, prob = [], 0.0, 1.0
        for _ in range(k):
            logits, hidden = self.head.step(self.embed[tok][None], features, hidden)
            features = None
            top = logits[0].max(dim=-1)  # max(...).indices: one pass for value and index (argmax is slower here)
            p = float(1.0 / torch.exp(logits[0] - top.values).sum())  # the top token's softmax probability
            if p < self.min_prob:
                break
            prob *= p
            score += prob
            tok = int(self.head.d2t[int(top.indices)])
            drafts.append(tok)
        return drafts, score
