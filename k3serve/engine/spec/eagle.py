"""``EagleDrafter``: k drafts from an EAGLE-3-style head (``models/eagle.py``) over the target's hidden states.

The model runner captures the target's outputs of the head's ``feature_layers`` at each sampling position and
leaves on the request ``spec_features = (p, f [F])``: the features at the position ``p`` whose logits gave
the last sampled token ``t[p + 1]``. A proposal for a request whose tokens are ``t[:L]`` uses them when they are
fresh (``p == L - 2``; else it proposes nothing: the row verifies zero drafts, which captures fresh ones):
step 1 reads ``(embed(t[L-1]), f)``, step j > 1 reads ``(embed(draft j-1), the head's hidden of step j-1)``;
each step's argmax, mapped through ``d2t``, is the next draft. The head has no per-request state, so there is
nothing to roll back.
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
    def __init__(self, head: EagleHead, embed: torch.Tensor):
        self.head = head
        self.embed = embed
        self.capture_layers = head.cfg.feature_layers

    @classmethod
    def load(cls, path: str | Path, target: nn.Module, vocab_size: int,
             device: torch.device | str = "cpu") -> EagleDrafter:
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
        return cls(head.to(embed.dtype), embed)

    @torch.inference_mode()
    def propose_for(self, req, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``req``'s tokens (``req``: an ``engine.request.Request``)."""
        kept = req.spec_features
        if k <= 0 or kept is None or kept[0] != req.num_tokens - 2:
            return []
        tok, features, hidden = req.token_ids[-1], kept[1][None].to(self.embed.dtype), None
        drafts = []
        for _ in range(k):
            logits, hidden = self.head.step(self.embed[tok][None], features, hidden)
            features = None
            tok = int(self.head.d2t[int(logits.argmax(-1))])
            drafts.append(tok)
        return drafts
