"""Typed messages between an engine client (``engine/client.py``; the HTTP server is one) and the
engine-core process (``engine/core.py``), msgpack via msgspec.

One tagged union per direction; nothing else crosses the ZMQ sockets (no pickle):

    client -> engine   ``ToEngine``   = AddRequest | AbortRequest | Shutdown
    engine -> client   ``FromEngine`` = Ready | Outputs | Fatal

Token ids travel, text does not: the client tokenizes and detokenizes (``engine/detokenizer.py``).
``SamplingParams`` crosses as itself (its checks run again on decode). Images travel preprocessed, as
raw pixel bytes with their shape and dtype (``ImageData``).
"""

from __future__ import annotations

import msgspec

from k3serve.core.kv_events import KVEventsInfo
from k3serve.engine.sampling_params import SamplingParams


class ImageData(msgspec.Struct, frozen=True):
    """One preprocessed image filling the prompt positions ``[offset, offset + length)`` (media placeholder
    ids): ``pixels`` are the raw bytes of ``pixel_patches [t*h*w, 3, P, P]`` (C order, ``dtype`` one of
    float32 / float16 / bfloat16), ``grid_thw = [t, h, w]``."""

    offset: int
    length: int
    pixels: bytes
    shape: list[int]
    dtype: str
    grid_thw: list[int]


class HandoffSource(msgspec.Struct, frozen=True):
    """Where a prefill worker holds a request's caches for hand-off (``engine/pd``): its sender address and
    the request's id there."""

    address: str
    request_id: str


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # one sample (n = 1); ``fan_out`` expands n before this
    grammar: str | None = None  # an llguidance grammar (Lark text); the engine masks logits with it
    logit_bias: dict[int, float] = {}
    images: list[ImageData] = []
    handoff: HandoffSource | None = None  # decode role: import the prompt's caches from there, then decode


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


class Wake(msgspec.Struct, tag="wake", frozen=True):
    """Carries nothing: ends an idle core's wait, because another core got a request and the cores step in
    lockstep (engine/dp_sync.py)."""


ToEngine = AddRequest | AbortRequest | Shutdown | Wake


class Stats(msgspec.Struct, frozen=True):
    """``EngineStats`` as data; ``num_requests`` counts requests the core holds (running + waiting)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 1
    num_blocks_used: int = 0
    num_blocks_cached: int = 0
    num_snapshot_slots: int = 0
    num_snapshots: int = 0
    num_admitted_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_free_slots: int = 0
    num_slots: int = 0
    num_held: int = 0  # requests holding caches outside the running set (hand-offs in progress)
    handoff_transfers: int = 0  # prefill: manifests sent; decode: manifests imported
    handoff_failures: int = 0
    handoff_bytes: int = 0
    handoff_transfer_s: float = 0.0
    handoff_queue_s: float = 0.0  # prefill: held until acked; decode: waiting for room before fetching
    handoff_cached_tokens: int = 0  # prompt positions not sent: the decode side's prefix cache held them
    num_expert_replicas: int = 0  # EPLB: expert copies beyond the first, over every MoE layer
    num_spec_rows: int = 0  # speculative decoding: verify rows, drafts proposed, drafts accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_dummy_steps: int = 0  # forwards for no request (lockstep with other data-parallel cores)


class Ready(msgspec.Struct, tag="ready", frozen=True):
    model_type: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    media_placeholder_token_id: int | None
    stats: Stats
    kv_events: KVEventsInfo | None = None  # where the engine publishes KV cache events (None: off)
    supports_images: bool = False  # the model has a vision tower


class Output(msgspec.Struct, frozen=True):
    """One request's new tokens of one step. ``logprobs`` has one ``{id: logprob}`` per new token
    (the sampled id first). ``finish_reason`` / ``stop_reason`` are the engine's token-level reason (the
    scheduler's); what a client reports comes from its ``SequenceDecoder``. ``error`` is set (and the
    request finished) when the engine refused or lost the request."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[dict[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    handoff: HandoffSource | None = None  # prefill role: the request's caches wait there for a decode worker


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    items: list[Output]
    stats: Stats


class Fatal(msgspec.Struct, tag="fatal", frozen=True):
    message: str


FromEngine = Ready | Outputs | Fatal

def to_output(o, handoff: HandoffSource | None = None) -> Output:
    """The wire form of one step's ``engine.outputs.RequestOutput``: its new tokens and their logprobs."""
    n = len(o.delta_token_ids)
    lps = o.logprobs[-n:] if o.logprobs is not None and n else None
    stop = o.stop_reason if isinstance(o.stop_reason, int) else None
    return Output(o.request_id, list(o.delta_token_ids), finished=o.finished, finish_reason=o.finish_reason,
                  stop_reason=stop, logprobs=lps, num_prompt_tokens=len(o.prompt_token_ids),
                  num_cached_tokens=o.num_cached_tokens, handoff=handoff)


_enc = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _enc.encode(msg)
