"""Request bodies of the OpenAI-compatible endpoints (pydantic: they also make `/openapi.json`).

Field shapes are checked by pydantic; value rules (the request contract) by `to_sampling_params`,
which builds the engine's own `SamplingParams` (stop strings and `n` included) and raises ValueError
naming the field (HTTP 400). Two contracts:
  * `kimi`   — Moonshot's K3 API as Kimi Vendor Verifier checks it: sampling is fixed
               (temperature 0, 0.6 or 1.0; top_p 0.95; penalties 0; n 1), other values are 400s.
  * `openai` — the full OpenAI parameter space (n > 1, penalties, logit_bias, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from k3serve.engine.messages import HandoffSource
from k3serve.engine.sampling_params import SamplingParams

KIMI_TEMPERATURES = (0.0, 0.6, 1.0)
KIMI_TOP_P = 0.95
MAX_N = 16
MAX_STOP = 4
MAX_LOGIT_BIAS = 300  # entries; the engine adds each one to every step's logits
MAX_DEPTH = 64  # nesting of any JSON value in a body (json.dumps, templates and llguidance recurse on it)
INT32 = 2**31 - 1  # token ids, counts and budgets: the engine and msgspec carry them as fixed-width ints

# integers bounded to their real range, so that a 2**70 is a 400 naming the field, not an OverflowError
Count = Annotated[int, Field(ge=0, le=INT32)]
Budget = Annotated[int, Field(ge=1, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]
TopK = Annotated[int, Field(ge=-1, le=INT32)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
NumLogprobs = Annotated[int, Field(ge=0, le=20)]


def nesting_error(value: Any, limit: int = MAX_DEPTH) -> str | None:
    """The dotted path of the first place where `value` nests deeper than `limit` containers, or None.
    Iterative: a recursive walk would itself hit Python's recursion limit on the input it guards against."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, dict):
            items = ((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            items = ((f"{path}[{i}]", x) for i, x in enumerate(v))
        else:
            continue
        if depth >= limit:
            return path or "body"
        stack.extend((x, depth + 1, p) for p, x in items if isinstance(x, (dict, list)))
    return None


class _Body(BaseModel):
    # NaN / Infinity (which Python's JSON parser accepts) are never a valid sampling value
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _bounded_nesting(cls, data: Any) -> Any:
        if isinstance(data, dict):
            where = nesting_error(data, MAX_DEPTH + 1)
            if where is not None:
                field = where.split(".", 1)[0].split("[", 1)[0]
                raise ValueError(f"{field}: nested deeper than {MAX_DEPTH} levels (at {where})")
        return data


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class KVTransferParams(BaseModel):
    """Prefill/decode disaggregation: where a prefill worker holds this request's caches (the ``kv_transfer_params``
    of its response). A decode worker given these imports them instead of computing the prompt."""

    model_config = ConfigDict(extra="forbid")
    address: Annotated[str, Field(pattern=r"^tcp://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$", max_length=200)]
    request_id: Annotated[str, Field(min_length=1, max_length=200)]


class SamplingFields(_Body):
    """Sampling fields shared by chat and text completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: Budget | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras (extra_body)
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    kv_transfer_params: KVTransferParams | None = None  # k3serve route's prefill -> decode hand-off

    def handoff_source(self, n: int, role: str) -> HandoffSource | None:
        """The hand-off to import (decode side), checked against this worker's role and ``n``."""
        kv = self.kv_transfer_params
        if kv is not None and role == "prefill":
            raise ValueError("kv_transfer_params: this worker has role prefill; send hand-offs to a decode worker")
        if (kv is not None or role == "prefill") and n != 1:
            raise ValueError(f"n: prefill/decode disaggregation serves one choice per request, got {n}")
        return None if kv is None else HandoffSource(kv.address, kv.request_id)

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP or not all(stop):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings")
        return tuple(stop)

    def check_stream_options(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return bool(self.stream_options and self.stream_options.include_usage)

    def _budget(self, requested: int | None, prompt_len: int, max_model_len: int) -> int:
        room = max_model_len - prompt_len
        if requested is not None and requested < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {requested}")
        return room if requested is None else min(requested, room)

    def sampling(self, contract: str, *, thinking: bool, max_tokens: int | None, prompt_len: int,
                 max_model_len: int, logprobs: int | None) -> SamplingParams:
        n = 1 if self.n is None else self.n
        if contract == "kimi":
            temperature = self.temperature
            if temperature is not None and temperature not in KIMI_TEMPERATURES:
                raise ValueError(f"temperature: this model only accepts {', '.join(map(str, KIMI_TEMPERATURES))}, "
                                 f"got {temperature}")
            if self.top_p is not None and self.top_p != KIMI_TOP_P:
                raise ValueError(f"top_p: this model only accepts {KIMI_TOP_P}, got {self.top_p}")
            for name in ("presence_penalty", "frequency_penalty"):
                if getattr(self, name) not in (None, 0):
                    raise ValueError(f"{name}: this model only accepts 0, got {getattr(self, name)}")
            if n != 1:
                raise ValueError(f"n: this model only accepts 1, got {n}")
            if temperature is None:
                temperature = 1.0 if thinking else 0.6
            top_p = KIMI_TOP_P
        else:
            temperature = 1.0 if self.temperature is None else self.temperature
            if not 0 <= temperature <= 2:
                raise ValueError(f"temperature: must be in [0, 2], got {temperature}")
            top_p = 1.0 if self.top_p is None else self.top_p
            if not 1 <= n <= MAX_N:
                raise ValueError(f"n: must be in [1, {MAX_N}], got {n}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: must be in [0, 2**63), got {self.seed}")
        try:
            return SamplingParams(
                n=n, stop=self.stop_strings(), temperature=float(temperature), top_p=float(top_p), top_k=self.top_k or 0,
                min_p=self.min_p or 0.0, seed=self.seed, stop_token_ids=list(self.stop_token_ids or []),
                max_tokens=self._budget(max_tokens, prompt_len, max_model_len), min_tokens=self.min_tokens or 0,
                ignore_eos=bool(self.ignore_eos), presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logprobs=logprobs)
        except TypeError as e:
            raise ValueError(str(e)) from None

    def logit_bias_ids(self, contract: str) -> dict[int, float]:
        if not self.logit_bias:
            return {}
        if contract == "kimi":
            raise ValueError("logit_bias: not supported by this model's API contract")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        out = {}
        for k, v in self.logit_bias.items():
            # a token id has at most 10 digits; int() of a longer one is an overflow or a slow parse
            if not (k.isascii() and k.isdigit() and len(k) <= 10 and int(k) <= INT32) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias: keys must be token ids and values in [-100, 100], got {k!r}: {v!r}")
            out[int(k)] = float(v)
        return out


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled"] | None = None
    keep: str | None = None
    effort: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[Any] = Field(..., description="OpenAI chat messages")
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    max_completion_tokens: Budget | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    reasoning_effort: str | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def thinking_mode(self, default: bool) -> tuple[bool, str | None]:
        """(thinking on?, effort). `thinking.effort` wins over `reasoning_effort`; default effort max."""
        thinking, effort = default, None
        kwargs = self.chat_template_kwargs or {}
        if "thinking" in kwargs:
            if not isinstance(kwargs["thinking"], bool):
                raise ValueError("chat_template_kwargs.thinking: must be a boolean")
            thinking = kwargs["thinking"]
        if self.thinking is not None:
            if self.thinking.type is not None:
                thinking = self.thinking.type == "enabled"
            elif self.thinking.effort is not None or self.thinking.keep is not None:
                thinking = True
            if self.thinking.keep not in (None, "all"):
                raise ValueError(f"thinking.keep: only 'all' is supported, got {self.thinking.keep!r}")
            effort = self.thinking.effort
        effort = effort or self.reasoning_effort or kwargs.get("thinking_effort") or "max"
        return thinking, effort

    def completion_budget(self) -> int | None:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError("max_tokens: conflicts with max_completion_tokens; set one of them")
        return b if b is not None else a

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs: requires logprobs to be true")
            if not 0 <= self.top_logprobs <= 20:
                raise ValueError(f"top_logprobs: must be in [0, 20], got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, contract: str, *, thinking: bool, prompt_len: int, max_model_len: int) -> SamplingParams:
        return self.sampling(contract, thinking=thinking, max_tokens=self.completion_budget(), prompt_len=prompt_len,
                             max_model_len=max_model_len, logprobs=self.logprob_count())


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(..., description="text or token ids")
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = None
    skip_special_tokens: bool = True

    def to_sampling_params(self, contract: str, *, prompt_len: int, max_model_len: int) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: must be in [0, 20], got {self.logprobs}")
        if self.suffix:
            raise ValueError("suffix: not supported")
        budget = 16 if self.max_tokens is None else self.max_tokens
        return self.sampling(contract, thinking=False, max_tokens=budget, prompt_len=prompt_len,
                             max_model_len=max_model_len, logprobs=self.logprobs)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
