"""The typed prefill -> decode hand-off manifest (msgspec), and the checks that make it fail closed.

A prefill worker runs a request's prompt (``P`` tokens) and samples its first token; the decode worker resumes
from exactly there. What crosses is one ``Manifest`` header plus one raw byte payload per ``Item``:

    mla.<layer>        [P - start, D_latent]   the latents of prompt positions [start, P) (the decode side holds
                                               [0, start) already: its prefix-cache hit, ask-then-send)
    kda_state.<layer>  [H, K, V]               recurrent state after exactly P tokens
    kda_conv.<layer>   [3P', W-1]              short-conv window after exactly P tokens
    generator          [n] uint8               the seeded sampler's generator state after the first token

Every payload has a BLAKE2b checksum in the header; ``verify`` refuses a manifest whose items are missing,
extra, of another shape or dtype, or whose bytes do not hash to their checksum, and one made for another
model (``fingerprint``). Nothing is partially imported: the caller imports only a verified manifest.
"""

from __future__ import annotations

import hashlib

import msgspec
import torch

from k3serve.engine.sampling_params import SamplingParams


class HandoffError(Exception):
    """A hand-off that cannot be completed; the request fails with this message (never a silent answer)."""


class Item(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    checksum: str  # blake2b-128 hex of the raw payload bytes


class Manifest(msgspec.Struct, frozen=True):
    request_id: str  # the prefill side's engine request id
    fingerprint: str  # model + cache layout identity (``fingerprint``); both sides must agree
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: int  # sampled by the prefill side from the logits at position P - 1
    first_logprobs: dict[int, float] | None  # its logprobs when the request asked for them
    start: int  # first position whose MLA latents are sent; [0, start) is the decode side's prefix hit
    items: list[Item]
    num_cached_tokens: int = 0  # prompt tokens the prefill side's prefix cache served (reported in usage)
    images: list[str] = []  # "offset:length:content hash" of each image in the prompt (``handoff.image_keys``)


def checksum(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def tensor_item(name: str, t: torch.Tensor) -> tuple[Item, bytes]:
    """An item and its payload: ``t``'s raw bytes (C order, on the host)."""
    t = t.detach().contiguous().cpu()
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return Item(name, str(t.dtype).removeprefix("torch."), list(t.shape), checksum(data)), data


def item_tensor(item: Item, data: bytes) -> torch.Tensor:
    """The tensor of a verified item (a copy: payload buffers may be reused by the transport)."""
    dtype = getattr(torch, item.dtype)
    if not data:
        return torch.empty(item.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(item.shape)


def fingerprint(model_config, dtype: torch.dtype, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
    """Identity of what a manifest's bytes mean: the model config, the compute dtype, and every cache item's
    per-token or per-slot shape and dtype."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(model_config).encode())
    h.update(str(dtype).encode())
    for name in sorted(layout):
        shape, dt = layout[name]
        h.update(f"{name}:{tuple(shape)}:{dt};".encode())
    return h.hexdigest()


def verify(manifest: Manifest, payloads: list[bytes], *, fingerprint: str,
           expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """The manifest's tensors by name, after every check; raises ``HandoffError`` naming the first failure.

    ``expected``: every item the receiver needs, with its shape and dtype (MLA items: the shape for the
    positions the manifest says it carries)."""
    rid = manifest.request_id
    if manifest.fingerprint != fingerprint:
        raise HandoffError(f"hand-off {rid}: made for another model or cache layout "
                           f"(fingerprint {manifest.fingerprint[:12]} != {fingerprint[:12]})")
    if len(payloads) != len(manifest.items):
        raise HandoffError(f"hand-off {rid}: {len(manifest.items)} items listed, {len(payloads)} payloads arrived")
    names = [it.name for it in manifest.items]
    missing = sorted(set(expected) - set(names))
    extra = sorted(set(names) - set(expected))
    if missing or extra or len(set(names)) != len(names):
        raise HandoffError(f"hand-off {rid}: items do not match (missing {missing}, unexpected {extra})")
    out = {}
    for it, data in zip(manifest.items, payloads):
        shape, dtype = expected[it.name]
        if list(shape) != it.shape or str(dtype).removeprefix("torch.") != it.dtype:
            raise HandoffError(f"hand-off {rid}: item {it.name} is {it.dtype}{it.shape}, "
                               f"expected {str(dtype).removeprefix('torch.')}{list(shape)}")
        if checksum(data) != it.checksum:
            raise HandoffError(f"hand-off {rid}: item {it.name} is corrupt (checksum mismatch)")
        out[it.name] = item_tensor(it, data)
    return out
