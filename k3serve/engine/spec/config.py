"""``SpeculativeConfig``: what ``--speculative-config '<json>'`` asks for, validated in one place.

Keys (vLLM's names where vLLM has one):
  method                 "ngram" (prompt lookup), "suffix" (suffix matching over prompt + output),
                         "draft_model" (a small model sharing the tokenizer) or "eagle3" (a head trained by
                         ``k3serve spec train`` on the target's hidden states) or "eagle_suffix" (per row, the
                         better-scored of the eagle3 head's and the suffix drafter's drafts; suffix alone while
                         more than ``eagle_max_running`` requests run)
  model                  draft_model: the draft model's name or path; eagle3 / eagle_suffix: the head's
                         directory (default: the head shipped with the target, ``<weights>/eagle3``)
  num_speculative_tokens k, drafts per decode row and step (0 runs the verify path with no drafts)
  prompt_lookup_max/min  n-gram lengths tried, longest first (ngram; suffix uses max as its match cap)
  rollback               "slots" (per-position state snapshots, the default) or "replay" (the reference:
                         checkpoint + replay of the accepted tokens through the decode step)
  min_draft_prob         eagle heads stop drafting at a step whose top probability is below this (default 0.2
                         for eagle_suffix, 0 for eagle3: always k drafts)
  eagle_max_running      eagle_suffix: the head drafts only while at most this many requests run (default 4)
  max_running            speculation backs off (k = 0) while more requests than this are running; default 32
                         for ngram/suffix/eagle_suffix, 4 for the model drafters, which propose one request at a time (a
                         batch of 32 then pays 32 x k head steps per step: RESULTS "eagle3 ... quiet box")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model", "eagle3", "eagle_suffix")
MODEL_METHODS = ("draft_model", "eagle3", "eagle_suffix")  # the methods that load a model (``model`` names it)
EAGLE_METHODS = ("eagle3", "eagle_suffix")  # ``model`` may be left out: the target's shipped head
ROLLBACKS = ("slots", "replay")
DEFAULT_MAX_RUNNING = {"ngram": 32, "suffix": 32, "draft_model": 4, "eagle3": 4, "eagle_suffix": 32}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    rollback: str = "slots"
    max_running: int | None = None  # None: the method's default (DEFAULT_MAX_RUNNING)
    min_draft_prob: float | None = None  # None: 0.2 for eagle_suffix, else 0
    eagle_max_running: int = 4

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"speculative_config: {msg}")

        check(self.method in METHODS, f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.max_running is None:
            object.__setattr__(self, "max_running", DEFAULT_MAX_RUNNING[self.method])
        if self.min_draft_prob is None:
            object.__setattr__(self, "min_draft_prob", 0.2 if self.method == "eagle_suffix" else 0.0)
        p = self.min_draft_prob
        check(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1,
              f"min_draft_prob must be a number in [0, 1), got {p!r}")
        k = self.num_speculative_tokens
        check(isinstance(k, int) and not isinstance(k, bool) and k >= 0,
              f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min", "max_running", "eagle_max_running"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                  f"{name} must be an integer >= 1, got {v!r}")
        check(self.prompt_lookup_min <= self.prompt_lookup_max,
              f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method in EAGLE_METHODS:
            check(self.model is None or (isinstance(self.model, str) and self.model != ""),
                  f"'model' must be the head's directory, got {self.model!r}")
        elif self.method in MODEL_METHODS:
            check(isinstance(self.model, str) and self.model != "",
                  f"method {self.method!r} needs 'model' (a name or path)")
        else:
            check(self.model is None, f"'model' applies to {', '.join(MODEL_METHODS)} only, not {self.method!r}")
        check(self.rollback in ROLLBACKS, f"unknown rollback {self.rollback!r} (choose from {', '.join(ROLLBACKS)})")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON object; ValueError with one clear line on bad JSON or keys."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg} at char {e.pos})") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config: must be a JSON object, e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "method" not in raw:
            raise ValueError(f"speculative_config: 'method' is required (one of {', '.join(METHODS)})")
        return cls(**raw)
