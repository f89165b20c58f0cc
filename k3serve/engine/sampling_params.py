"""Per-request sampling parameters (vLLM-compatible names), validated at construction.

``SamplingParams`` is a frozen ``msgspec.Struct``: the same object the offline ``LLM`` takes crosses the
process boundary to the engine core inside ``AddRequest`` (``engine/messages.py``), and decoding it runs the
same checks. Every invalid value raises one ``ValueError`` whose message starts with the field's name.
``stop`` strings travel as data; the engine never looks at them (text is ``engine/detokenizer.py``'s job).

``fan_out`` is the one place where ``n`` samples of a request become ``n`` engine requests.
"""

from __future__ import annotations

import msgspec


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class SamplingParams(msgspec.Struct, frozen=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16  # None = up to the model's context limit
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per output token (0 = only the sampled token's)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an int >= 1, got {self.n!r}")
        _check(_is_num(self.temperature) and 0 <= self.temperature < float("inf"), "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               f"must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an int or None, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               f"must be non-empty strings, got {self.stop!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"must be non-negative ints, got {self.stop_token_ids!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               f"must be an int >= 1 or None, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be an int >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        _check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty",
               f"must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and 0 <= v <= 20), name, f"must be an int in [0, 20] or None, got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the ``index``-th of ``n`` parallel samples: n=1, and a distinct derived seed."""
        seed = None if self.seed is None else self.seed + index * SEED_STRIDE
        return msgspec.structs.replace(self, n=1, seed=seed)


SEED_STRIDE = 1_000_003  # sample k of a seeded request runs with seed + k * SEED_STRIDE


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine requests ``(id, params)`` of ``params.n`` samples: ``request_id`` itself when n = 1, else
    ``<request_id>-<k>`` with ``params.for_sample(k)``. The offline ``LLM`` and the server both use this."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}-{k}", params.for_sample(k)) for k in range(params.n)]
