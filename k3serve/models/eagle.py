"""EAGLE-3-style draft head: one small decoder-like block over the target model's hidden features, trained by
``k3serve spec train`` and run by the ``eagle3`` drafter (``engine/spec/eagle.py``).

One drafting step for R rows, with ``d`` the target's hidden size:
  first step:  g = fuse(f), f = the target's residual stream after each of ``feature_layers`` at position t,
               concatenated ``[R, len(feature_layers) * d]``;  later steps: g = the head's own hidden ``[R, d]``
  x = in_proj(cat(norm_e(e), norm_g(g)))   e = the target's (frozen, not stored) embedding of token t+1 ``[R, d]``
  x = x + down(silu(gate(norm_m(x))) * up(norm_m(x)))          the block (no attention: context comes in f)
  logits = lm_head(norm_o(x))  ``[R, draft_vocab_size]``  over a reduced draft vocabulary (the tokens the
           target most often produces); ``d2t [draft_vocab_size]`` maps a draft id to the target's id
  the next step's g = x.
Saved as ``config.json`` + ``model.safetensors`` in a directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int  # the target's
    vocab_size: int  # the target's
    feature_layers: tuple[int, ...]  # target layers whose outputs are fused (low, mid, high)
    draft_vocab_size: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"eagle head config: {name} must be an integer >= 1, got {v!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"eagle head config: draft_vocab_size {self.draft_vocab_size} is above the "
                             f"vocabulary ({self.vocab_size})")
        if not self.feature_layers or any(not isinstance(i, int) or i < 0 for i in self.feature_layers):
            raise ValueError(f"eagle head config: feature_layers must be layer indices, got {self.feature_layers}")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and last layer (the last one's output is what the target's own head reads)."""
    return tuple(sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1}))


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.fuse = nn.Linear(len(cfg.feature_layers) * d, d, bias=False)
        self.norm_e, self.norm_g = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.in_proj = nn.Linear(2 * d, d, bias=False)
        self.norm_m = nn.RMSNorm(d, eps=eps)
        self.gate = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.norm_o = nn.RMSNorm(d, eps=eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size, dtype=torch.long))

    def step(self, emb: torch.Tensor, features: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocabulary logits ``[R, Vd]``, the head's hidden ``[R, d]``) from the next token's embedding
        ``emb [R, d]`` and either the target's ``features`` (first step) or the head's previous ``hidden``."""
        g = self.fuse(features) if features is not None else hidden
        x = self.in_proj(torch.cat([self.norm_e(emb), self.norm_g(g)], dim=-1))
        m = self.norm_m(x)
        x = x + self.down(nn.functional.silu(self.gate(m)) * self.up(m))
        return self.lm_head(self.norm_o(x)), x

    def save(self, out: str | Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"architecture": "eagle3", **asdict(self.cfg)}, indent=1))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(out / "model.safetensors"))

    @staticmethod
    def read_config(path: str | Path) -> EagleConfig:
        """The config of the head ``save`` wrote in ``path`` (no weights read); ValueError with one line when
        there is none."""
        path = Path(path)
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"eagle head {str(path)!r}: no readable config.json ({e.__class__.__name__})") from None
        if raw.pop("architecture", None) != "eagle3":
            raise ValueError(f"eagle head {str(path)!r}: config.json is not an eagle3 head's")
        try:
            return EagleConfig(**raw)
        except TypeError as e:
            raise ValueError(f"eagle head {str(path)!r}: bad config.json ({e})") from None

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> EagleHead:
        """From a directory ``save`` wrote; ValueError with one line when it is not one."""
        path = Path(path)
        head = cls(cls.read_config(path))
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"eagle head {str(path)!r}: model.safetensors is missing")
        head.load_state_dict(load_file(str(weights)))
        return head.to(device).eval()
