"""The engine's shared vocabulary: a request's state and the batch the scheduler hands the model runner.

Lengths of a request (the scheduling arithmetic, as in mini-sglang's ``Req``)::

    token_ids          = prompt + outputs                      (num_tokens)
    num_computed_tokens  tokens whose MLA latents and KDA state are in the caches (the forward's cached_len)
    num_prefix_hit_tokens  prompt tokens that came from the prefix cache at the first admission (always
                         < the prompt length; a recompute after preemption does not change it)
    extend_len         = num_tokens - num_computed_tokens      tokens still to feed to the model

A request samples a token in a step only when that step computes its last token (``extend_len`` reaches 0).
Preemption by recompute resets ``num_computed_tokens`` to 0 and keeps the outputs, which then are re-fed
as if they were prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from k3serve.engine.logits_processor import LogitsProcessor
from k3serve.engine.multimodal import ImageInput
from k3serve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # holds its slot and blocks outside the running set: a prefill hand-off awaiting its ack,
    # or a decode-side import awaiting its manifest (engine/pd)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    arrival: int = 0  # FCFS order
    images: tuple[ImageInput, ...] = ()  # sorted by offset, checked against the prompt
    logits_processor: LogitsProcessor | None = None
    prefill_only: bool = False  # prefill role: stop after the first token and hold the caches for hand-off
    image_embeds: list[torch.Tensor] | None = field(init=False, default=None)  # per image, computed once
    token_ids: list[int] = field(init=False)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_computed_tokens: int = field(init=False, default=0)
    num_prefix_hit_tokens: int = field(init=False, default=0)
    prefill_target: int = field(init=False, default=0)  # num_tokens when last admitted: prefill ends there
    block_ids: list[int] = field(init=False, default_factory=list)  # MLA block table
    block_hashes: list[int] = field(init=False, default_factory=list)  # chain hash of each full block
    num_registered_blocks: int = field(init=False, default=0)  # full blocks already offered to the cache
    slot: int | None = field(init=False, default=None)  # KDA state slot while running
    pending_snapshot: tuple[int, int] | None = field(init=False, default=None)  # (slot, position) during decode
    finish_reason: str | None = field(init=False, default=None)
    stop_reason: int | str | None = field(init=False, default=None)
    logprobs: list[dict[int, float]] = field(init=False, default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(init=False, default_factory=list)
    generator: torch.Generator | None = field(init=False, default=None)
    num_preemptions: int = field(init=False, default=0)
    # eagle3 speculation: (position p, the target's captured hidden features at p [F]) of the last sampled
    # token's predecessor, i.e. p = num_tokens - 2 when fresh (the model runner sets it, the drafter reads it)
    spec_features: tuple[int, torch.Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def extend_len(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: ``max_tokens`` capped by the model's context length."""
        room = self.max_model_len - self.num_prompt_tokens
        return room if self.params.max_tokens is None else min(self.params.max_tokens, room)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None


@dataclass
class Batch:
    """One step's work: ``requests[i]`` computes ``num_new_tokens[i]`` tokens starting at ``cached_lens[i]``.

    ``state_copies`` are KDA slot copies (src, dst) done before the forward (prefix hits: snapshot -> slot);
    ``snapshots`` are copies done after it (running slot -> snapshot slot), published under
    ``snapshot_keys`` (None: a request's pending decode snapshot, published when it leaves).

    Speculative decoding: ``drafts[i]`` is None for a row outside speculation, else the row's draft tokens
    (possibly none): it feeds its last token and the drafts (``num_new_tokens[i] = 1 + len(drafts[i])``).
    ``spec_snapshots[i] = (slot, position, fresh)``: at the commit, copy row i's state at ``position`` (a block
    boundary inside its window) to ``slot`` if the accepted tokens reach it (``fresh``: the slot is new).
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    cached_lens: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    snapshot_keys: list[int | None] = field(default_factory=list)
    drafts: list[list[int] | None] = field(default_factory=list)
    spec_snapshots: dict[int, tuple[int, int, bool]] = field(default_factory=dict)

    def add(self, req: Request, num_new: int, drafts: list[int] | None = None) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(num_new)
        self.cached_lens.append(req.num_computed_tokens)
        self.drafts.append(drafts)

    @property
    def spec_rows(self) -> list[int]:
        """Rows that verify drafts (k = 0 included), ascending."""
        return [i for i, d in enumerate(self.drafts) if d is not None]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)

    def samples(self, i: int) -> bool:
        """Whether request ``i`` reaches its last token in this step (and so samples the next one)."""
        drafts = (self.drafts[i] or ()) if self.drafts else ()
        return self.cached_lens[i] + self.num_new_tokens[i] - len(drafts) == self.requests[i].num_tokens
