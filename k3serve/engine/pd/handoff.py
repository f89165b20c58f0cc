"""A request's caches out of one engine and into another: ``export`` (prefill side), ``reserve`` and
``import_manifest`` (decode side). Pure functions over an ``LLMEngine``; the processes and the transport
around them are ``engine/pd/worker.py``.

Positions, not blocks, cross: MLA latents travel as ``[positions, D_latent]`` gathered from the prefill side's
block table and are scattered into blocks the decode side allocated itself (its block ids, even its block
size, may differ). KDA states are read from the slot's current cache row (``StateRows`` moves rows between
steps, so the slot recorded at admission is resolved only now, in the engine's own thread). Under tensor
parallelism each rank holds its heads' rows: they travel in the full (tp 1) layout, gathered from every rank
by the prefill side's rank 0 and scattered to its ranks by the decode side's (``rank_rows``, ``reshard``), so
the two sides may run different tp sizes; checksums and the fingerprint cover the full layout.

Images: the decode side gets the request's images too, never runs the vision tower (the latents of their
positions arrive), but hashes them into its block keys exactly as the prefill side did, so its prefix-cache hit
(and the positions it asks the sender to skip) never mixes up two images behind the same placeholder tokens.
Structured outputs: the decode side's logits processor starts with nothing consumed; the first token (sampled
under the grammar by the prefill side) is the first thing it consumes, as in a colocated run.
"""

from __future__ import annotations

import torch

from k3serve.engine.logits_processor import LogitsProcessor
from k3serve.engine.multimodal import ImageInput
from k3serve.engine.pd import rank_rows, reshard
from k3serve.engine.pd.manifest import HandoffError, Manifest, fingerprint, tensor_item, verify
from k3serve.engine.prefix_cache import update_block_hashes
from k3serve.engine.request import Request, RequestStatus
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.scheduler import stop_reason

_GENERATOR_BYTES = torch.Generator().get_state().numel()


def _tp(engine) -> int:
    par = getattr(engine, "par", None)
    return 1 if par is None else par.tp


def cache_layout(engine) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-token (MLA) and per-slot (KDA) shape and dtype of every cache item, by item name, in the full (tp 1)
    layout that every hand-off carries whatever the tp of either side (``reshard``)."""
    c, tp = engine.runner.caches, _tp(engine)
    out = {f"mla.{i}": (tuple(t.shape[2:]), t.dtype) for i, t in c.mla.items()}
    out |= {f"kda_state.{i}": (reshard.full_shape(f"kda_state.{i}", tuple(t.shape[1:]), tp), t.dtype)
            for i, t in c.kda_state.items()}
    out |= {f"kda_conv.{i}": (reshard.full_shape(f"kda_conv.{i}", tuple(t.shape[1:]), tp), t.dtype)
            for i, t in c.kda_conv.items()}
    return out


def _kda_rows(engine, slot: int) -> dict[str, torch.Tensor]:
    """The full-layout KDA state and conv window of ``slot``: this process's rows, or every rank's gathered
    (rank 0 of a tp group asks its workers over the step channel)."""
    group = engine.runner.group
    if group is None:
        return rank_rows.local_rows(engine, slot)
    return reshard.gather_all(rank_rows.gather_rows(engine, group, slot))


def engine_fingerprint(engine) -> str:
    fp = getattr(engine, "_pd_fingerprint", None)
    if fp is None:
        dtype = next(iter(engine.runner.model.parameters())).dtype
        fp = engine._pd_fingerprint = fingerprint(engine.model_config, dtype, cache_layout(engine))
    return fp


def image_keys(images) -> list[str]:
    return [f"{im.offset}:{im.length}:{im.hash.hex()}" for im in images]


def _flat_positions(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Row of each position in ``[start, end)`` in a cache viewed as ``[num_blocks * block_size, D]``."""
    pos = torch.arange(start, end)
    return torch.tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def _zeroed_layers(tensors: dict[str, torch.Tensor]) -> list[str]:
    """KDA layers whose state looks lost (ATOM#2154's "decode ran from a zeroed state"), by value:

    * a recurrent state of all zeros beside a conv window that is not: the window holds the last tokens'
      inputs, and nonzero inputs always leave a nonzero state, so this state was never written or was lost;
    * some layers all zero (state and window) while others are not: zero inputs (a prompt of tokens whose
      embeddings are zero) zero every layer at once, never some.
    A prompt whose every layer is all zero is legitimate (such a prompt exists for a trained model with
    unused vocabulary rows) and passes; losing every layer's state and window at once is left to the
    checksums (in transit) and the parity tests (tests/pd)."""
    layers = [n.removeprefix("kda_state.") for n in tensors if n.startswith("kda_state.")]
    state_zero = {i: not bool(tensors[f"kda_state.{i}"].any()) for i in layers}
    conv_zero = {i: not bool(tensors[f"kda_conv.{i}"].any()) for i in layers}
    bad = [i for i in layers if state_zero[i] and not conv_zero[i]]
    silent = [i for i in layers if state_zero[i] and conv_zero[i]]
    if silent and len(silent) < len(layers):
        bad += silent
    return [f"kda_state.{i}" for i in sorted(set(bad), key=int)]


def export(engine, request_id: str, held_hashes: list[int], block_size: int) -> tuple[Manifest, list[bytes]]:
    """The manifest of a held prefill-only request. ``held_hashes``: the chain hashes of the leading blocks the
    decode side already holds (in its ``block_size``); the latents of those positions are not sent."""
    req = engine.scheduler.held.get(request_id)
    if req is None or not req.prefill_only:
        raise HandoffError(f"hand-off {request_id}: no such request is waiting for its hand-off "
                           "(unknown, already taken, or timed out)")
    n, bs = req.num_prompt_tokens, engine.blocks.block_size
    if req.num_computed_tokens != n or req.num_tokens != n + 1:
        raise HandoffError(f"hand-off {request_id}: the request is not at its first token")
    skip = 0
    if block_size == bs:
        ours = update_block_hashes(req, bs)[: n // bs]
        while skip < min(len(ours), len(held_hashes)) and ours[skip] == held_hashes[skip]:
            skip += 1
    start = skip * bs
    caches = engine.runner.caches
    items, payloads = [], []

    def add(name: str, t: torch.Tensor) -> None:
        item, data = tensor_item(name, t)
        items.append(item)
        payloads.append(data)

    rows = _flat_positions(req.block_ids, bs, start, n).to(engine.runner.device)
    for i, cache in caches.mla.items():
        add(f"mla.{i}", cache.view(-1, cache.shape[-1]).index_select(0, rows))
    states = _kda_rows(engine, req.slot)
    if bad := _zeroed_layers(states):
        raise HandoffError(f"hand-off {request_id}: KDA state of {', '.join(bad)} is all zeros after {n} tokens "
                           "while the rest is not (never written?); refusing to hand it off")
    for name, t in states.items():
        add(name, t)
    if req.generator is not None:
        add("generator", req.generator.get_state())
    first_lp = req.logprobs[0] if req.params.logprobs is not None and req.logprobs else None
    manifest = Manifest(request_id, engine_fingerprint(engine), list(req.prompt_token_ids), req.params,
                        req.token_ids[n], first_lp, start, items, req.num_prefix_hit_tokens, image_keys(req.images))
    return manifest, payloads


def reserve(engine, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
            images: tuple[ImageInput, ...] = (), logits_processor: LogitsProcessor | None = None) -> Request | None:
    """Reserve a running slot and the blocks of the prompt for an import (the decode side's prefix-cache hit
    is acquired, the rest allocated); None when there is no room yet. The request is held until
    ``import_manifest`` or ``engine.abort_request``. ``held_hashes(req)`` says what to ask the sender to skip.
    ``images`` (checked, ``check_images``) key the blocks; ``logits_processor`` runs from the second token."""
    engine.validate_prompt(prompt_token_ids, params)
    check = engine.scheduler
    if not check.has_room() or engine.states.num_running_free < 1:
        return None
    req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=engine.eos_token_ids,
                  max_model_len=engine.max_model_len, images=tuple(images), logits_processor=logits_processor)
    n, bs = req.num_prompt_tokens, engine.blocks.block_size
    hit = []
    if check.cache.enabled:
        hit = engine.blocks.match(update_block_hashes(req, bs)[: n // bs])
    newly_held = sum(engine.blocks.ref_count[b] == 0 for b in hit)
    need = -(-n // bs) - len(hit)
    if need > engine.blocks.num_free - newly_held:
        return None
    engine.blocks.acquire(hit)
    req.block_ids = hit + engine.blocks.allocate(need)
    req.num_registered_blocks = len(hit)
    req.slot = engine.states.allocate_running()
    check.hold_import(req)
    return req


def held_hashes(req: Request) -> list[int]:
    return req.block_hashes[: req.num_registered_blocks]


def import_manifest(engine, req: Request, manifest: Manifest, payloads: list[bytes]):
    """Fill a reserved request's caches from a manifest and let it decode; returns the first token's
    ``RequestOutput``. Any failed check raises ``HandoffError`` before anything is written; the caller then
    aborts the request (which frees what ``reserve`` took)."""
    rid, n, bs = req.request_id, req.num_prompt_tokens, engine.blocks.block_size
    if manifest.prompt_token_ids != req.prompt_token_ids:
        raise HandoffError(f"hand-off {manifest.request_id}: its prompt differs from this request's")
    if manifest.params != req.params:
        raise HandoffError(f"hand-off {manifest.request_id}: its sampling parameters differ from this request's")
    if manifest.images != image_keys(req.images):
        raise HandoffError(f"hand-off {manifest.request_id}: its images differ from this request's")
    held = req.num_registered_blocks * bs
    if not 0 <= manifest.start <= held:
        raise HandoffError(f"hand-off {manifest.request_id}: sends positions from {manifest.start}, "
                           f"but this side holds only [0, {held})")
    if not 0 <= manifest.first_token < engine.vocab_size:
        raise HandoffError(f"hand-off {manifest.request_id}: first token {manifest.first_token} is outside the vocabulary")
    layout = cache_layout(engine)
    expected = {k: ((n - manifest.start, *s) if k.startswith("mla.") else s, dt) for k, (s, dt) in layout.items()}
    if req.generator is not None:
        expected["generator"] = ((_GENERATOR_BYTES,), torch.uint8)
    tensors = verify(manifest, payloads, fingerprint=engine_fingerprint(engine), expected=expected)
    if bad := _zeroed_layers(tensors):
        raise HandoffError(f"hand-off {manifest.request_id}: KDA state of {', '.join(bad)} arrived all zeros "
                           f"after {n} tokens while the rest did not; refusing to decode from it")
    caches, device = engine.runner.caches, engine.runner.device
    rows = _flat_positions(req.block_ids, bs, held, n).to(device)
    for i, cache in caches.mla.items():
        fresh = tensors[f"mla.{i}"][held - manifest.start:].to(device)
        cache.view(-1, cache.shape[-1]).index_copy_(0, rows, fresh)
    kda = {k: t for k, t in tensors.items() if k.startswith(("kda_state.", "kda_conv."))}
    per_rank = reshard.scatter(kda, _tp(engine))  # this rank's heads, in full head order (q|k|v by segment)
    rank_rows.write_rows(engine, req.slot, per_rank[0])
    if engine.runner.group is not None:  # the other ranks' heads, and the latents every rank keeps
        fresh = {i: tensors[f"mla.{i}"][held - manifest.start:] for i in caches.mla}
        rank_rows.scatter_rows(engine, engine.runner.group, req.slot, per_rank, rows.cpu(), fresh)
    if req.generator is not None:
        req.generator.set_state(tensors["generator"])
    req.num_computed_tokens = req.prefill_target = n
    req.num_prefix_hit_tokens = manifest.num_cached_tokens
    req.token_ids.append(manifest.first_token)
    if manifest.first_logprobs is not None:
        req.logprobs.append(dict(manifest.first_logprobs))
    engine.scheduler.cache.cache_blocks(req)
    engine.num_generated_tokens += 1
    engine.scheduler.resume(req)
    if (reason := stop_reason(req)) is not None:
        engine.scheduler.finish(req, reason)
    return engine._output(req, [manifest.first_token])
