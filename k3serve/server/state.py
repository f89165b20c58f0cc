"""Server configuration and the per-app state the handlers share (built by the app factory, never
at import time)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from k3serve.server.limits import FrontendPool, RequestLimits
from k3serve.server.media import MediaLimits

CONTRACTS = ("kimi", "openai")


@dataclass(frozen=True)
class ServerConfig:
    model: str
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    api_contract: str | None = None  # None: kimi for K3 models, openai otherwise
    chat_format: str | None = None  # None: from the model's model_type
    max_queued_requests: int = 1024
    media: MediaLimits = field(default_factory=MediaLimits)
    limits: RequestLimits = field(default_factory=RequestLimits)  # body, messages, characters, worker threads
    engine: dict[str, Any] = field(default_factory=dict)  # CoreSpec fields except the model and addresses
    startup_timeout_s: float = 300.0
    access_log: bool = True  # one line per request (server/access_log.py)
    max_engine_restarts: int = 3  # a dead engine process is restarted this often; then the server exits 1
    data_parallel_size: int = 1  # engine replicas behind this server (engine/dp_client.py)

    def __post_init__(self) -> None:
        if self.api_contract not in (None, *CONTRACTS):
            raise ValueError(f"--api-contract must be one of {', '.join(CONTRACTS)}, got {self.api_contract!r}")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.max_engine_restarts < 0:
            raise ValueError(f"--max-engine-restarts must be >= 0, got {self.max_engine_restarts}")

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)


@dataclass
class ServerState:
    """Everything a handler needs; filled in by the app's startup."""

    config: ServerConfig
    client: Any = None  # EngineClient
    tokenizer: Any = None
    fmt: Any = None  # ChatFormat
    contract: str = "openai"
    metrics: Any = None
    started: float = field(default_factory=time.time)
    startup_error: str | None = None
    no_chat: str | None = None  # why this model cannot serve chat (its vocabulary lacks the control tokens)
    pool: FrontendPool = field(init=False)  # rendering, tokenizing, image decoding: off the event loop

    def __post_init__(self) -> None:
        self.pool = FrontendPool(self.config.limits.frontend_workers)

    def check_api_key(self, header: str | None) -> bool:
        key = self.config.api_key
        if key is None:
            return True
        if not header or not header.startswith("Bearer "):
            return False
        return secrets.compare_digest(header[len("Bearer "):].encode(), key.encode())

    def check_model(self, name: str | None) -> None:
        from k3serve.server.errors import APIError

        if name is not None and name not in self.config.names:
            raise APIError(404, f"model {name!r} does not exist; this server serves {', '.join(self.config.names)}",
                           code="model_not_found", param="model")

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.ready.vocab_size

    def check_chat_vocabulary(self) -> str | None:
        """Why the chat endpoints cannot work for this model, or None: every chat prompt holds the format's
        control tokens (ids from 163,584 on), which a small-vocabulary test model (e.g. 2,048 ids) lacks."""
        token = self.fmt.stop_token
        tid = self.tokenizer.special_id(token)
        if tid < self.vocab_size:
            return None
        return f"its vocabulary of {self.vocab_size} ids lacks the chat format's control tokens ({token} is id {tid})"

    def check_chat(self) -> None:
        from k3serve.server.errors import APIError

        if self.no_chat is not None:
            raise APIError(400, f"model {self.config.names[0]!r} cannot serve chat: {self.no_chat}; use "
                           "/v1/completions with token ids, or a model with the Kimi vocabulary",
                           code="model_cannot_chat", param="model")

    def admit(self, count: int, what: str = "n") -> None:
        """Room for `count` sequences now (else EngineBusy, 429), after a 400 naming the field `what` for a
        count no wait could fit: retrying that (KVV clients retry 429s forever) would never succeed."""
        limit = self.config.max_queued_requests
        if count > limit:
            raise ValueError(f"{what}: {count} sequences exceed what this server holds at once "
                             f"(--max-queued-requests {limit})")
        self.client.check_admission(count)

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside this model's vocabulary of {self.vocab_size} ids")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room in the model's context length "
                             f"(max_model_len={self.max_model_len})")
