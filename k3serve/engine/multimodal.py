"""Image inputs of a request: validation, content hashes for the prefix cache, and the per-step embeddings.

An ``ImageInput`` fills the prompt positions ``[offset, offset + length)``, every one of them the model's
media placeholder id (``<|media_pad|>``). It carries either preprocessed pixels (``pixel_patches
[t*h*w, 3, P, P]`` with ``grid_thw = (t, h, w)``, ``length = (h/2)*(w/2)``) or precomputed embeddings
``[length, hidden]``, and a content hash (BLAKE2b of the tensor bytes, shape and dtype unless given).

Embeddings: the first step whose chunk overlaps one of a request's images runs the vision tower once for
all of that request's pixel images (``embed_images``) and keeps the rows on the request, so a preemption
by recompute reuses them. Each step then scatters, for every placeholder position it computes, either the
matching image row or (a placeholder id outside any image) the placeholder's own text embedding, which is
what the text-only forward would use. A chunked prefill may split an image anywhere.

Prefix cache: a full block that overlaps an image mixes (content hash, offset of the block inside the
image) into its chain hash as ``core.hashing`` extra bytes, so equal token ids with different images never
share blocks or KDA snapshots, and the hashes stay the same in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from k3serve.core.config import ModelConfig
from k3serve.core.hashing import hash_block, hash_blocks

_PERSON = b"k3serve-img-v1"


def content_hash(t: torch.Tensor, kind: bytes = b"pixels") -> bytes:
    """16-byte BLAKE2b of a tensor's kind, dtype, shape and bytes (deterministic across processes)."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(kind + b"|" + str(t.dtype).encode() + b"|" + ",".join(map(str, t.shape)).encode() + b"|")
    h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy())
    return h.digest()


@dataclass(frozen=True, eq=False)
class ImageInput:
    offset: int  # first placeholder position in the prompt
    length: int  # placeholder positions = embedding rows
    pixel_patches: torch.Tensor | None = None  # [t*h*w, 3, P, P]
    grid_thw: tuple[int, int, int] | None = None
    embeds: torch.Tensor | None = None  # [length, hidden], instead of pixels
    hash: bytes = b""  # identity for the prefix cache; computed from the content when empty

    def __post_init__(self) -> None:
        if (self.pixel_patches is None) == (self.embeds is None):
            raise ValueError("images: give either pixel_patches (with grid_thw) or embeds, not both or neither")
        if not all(v is None or isinstance(v, torch.Tensor) for v in (self.pixel_patches, self.embeds)):
            raise ValueError("images: pixel_patches and embeds must be tensors")
        if self.pixel_patches is not None and (self.grid_thw is None or len(self.grid_thw) != 3):
            raise ValueError("images: pixel_patches need grid_thw = (t, h, w)")
        if self.grid_thw is not None:
            object.__setattr__(self, "grid_thw", tuple(int(x) for x in self.grid_thw))
        if not self.hash:
            data = self.pixel_patches if self.pixel_patches is not None else self.embeds
            kind = b"pixels" + repr(self.grid_thw).encode() if self.pixel_patches is not None else b"embeds"
            object.__setattr__(self, "hash", content_hash(data, kind))

    @property
    def end(self) -> int:
        return self.offset + self.length


def placeholder_runs(token_ids: Sequence[int], placeholder_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each maximal run of ``placeholder_id`` (one per image in Kimi prompts, whose
    images are framed by ``<|media_begin|>`` ... ``<|media_end|>``)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*token_ids, None]):
        if t == placeholder_id and start is None:
            start = i
        elif t != placeholder_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def check_images(images: Sequence[ImageInput], prompt: Sequence[int], config: ModelConfig) -> tuple[ImageInput, ...]:
    """The images sorted by offset; ValueError naming the problem when they do not fit the prompt or model."""
    if not images:
        return ()
    vision, pad = config.vision, config.media_placeholder_token_id
    if vision is None or pad is None:
        raise ValueError(f"images: this model ({config.model_type}) has no vision tower and takes text only")
    bad = next((type(im).__name__ for im in images if not isinstance(im, ImageInput)), None)
    if bad is not None:
        raise ValueError(f"images: expected ImageInput items, got {bad}")
    out = tuple(sorted(images, key=lambda im: im.offset))
    prev_end = 0
    kh, kw = vision.merge_kernel_size
    for k, im in enumerate(out):
        if not (0 <= im.offset and im.length >= 1 and im.end <= len(prompt)):
            raise ValueError(f"images[{k}]: span [{im.offset}, {im.end}) is not inside the {len(prompt)}-token "
                             "prompt")
        if im.offset < prev_end:
            raise ValueError(f"images[{k}]: span starting at {im.offset} overlaps the previous image")
        prev_end = im.end
        if any(t != pad for t in prompt[im.offset:im.end]):
            raise ValueError(f"images[{k}]: prompt positions [{im.offset}, {im.end}) must all be the media "
                             f"placeholder id {pad}")
        if im.embeds is not None:
            if tuple(im.embeds.shape) != (im.length, config.text.hidden_size):
                raise ValueError(f"images[{k}]: embeds must be [{im.length}, {config.text.hidden_size}], "
                                 f"got {list(im.embeds.shape)}")
            continue
        t, h, w = im.grid_thw
        p = vision.patch_size
        if min(t, h, w) < 1 or h % kh or w % kw:
            raise ValueError(f"images[{k}]: grid_thw {im.grid_thw} must be positive with h, w multiples of "
                             f"the merge kernel {kh}x{kw}")
        if tuple(im.pixel_patches.shape) != (t * h * w, 3, p, p):
            raise ValueError(f"images[{k}]: pixel_patches must be [{t * h * w}, 3, {p}, {p}] for grid_thw "
                             f"{im.grid_thw}, got {list(im.pixel_patches.shape)}")
        if im.length != (h // kh) * (w // kw):
            raise ValueError(f"images[{k}]: grid_thw {im.grid_thw} gives {(h // kh) * (w // kw)} vision tokens "
                             f"but the prompt span holds {im.length} placeholders")
    return out


def block_extra(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """Extra hash bytes of the block ``[start, end)``: each overlapping image's hash and the block's offset
    inside it (empty when no image overlaps)."""
    parts = [b"img" + im.hash + (start - im.offset).to_bytes(8, "little", signed=True)
             for im in images if im.offset < end and start < im.end]
    return b"".join(parts)


def chain_hashes(token_ids: Sequence[int], first_block: int, block_size: int, parent: int | None,
                 images: Sequence[ImageInput], key: bytes = b"") -> list[int]:
    """Chain hashes of the full blocks ``first_block, ...`` of ``token_ids``; blocks overlapping an image
    carry its ``block_extra``, runs of text-only blocks are hashed in one ``hash_blocks`` call."""
    n_full = len(token_ids) // block_size
    out: list[int] = []
    b = first_block
    while b < n_full:
        s = b * block_size
        extra = block_extra(images, s, s + block_size) if images else b""
        if extra:
            parent = hash_block(parent, token_ids[s:s + block_size], extra, key=key)
            out.append(parent)
            b += 1
            continue
        nxt = min([n_full] + [im.offset // block_size for im in images if im.offset // block_size > b])
        hs = hash_blocks(token_ids[s:nxt * block_size], block_size, parent=parent, key=key)
        out += hs
        parent = hs[-1]
        b = nxt
    return out


@dataclass
class ImageEmbedder:
    """Builds a step's ``image_embeds`` (one row per placeholder position of the packed batch, in order)."""

    model: nn.Module
    placeholder_id: int
    pad_row: torch.Tensor = field(init=False)  # the placeholder's text embedding [hidden]

    def __post_init__(self) -> None:
        from k3serve.models.kimi import text_model

        embed = text_model(self.model).model.embed_tokens
        dev = next(embed.parameters()).device
        # through the module, not its weight: a vocab-parallel rank holds only its slice of the table (the
        # lookup's all-reduce runs on every rank, as each builds its runner at the same point)
        with torch.no_grad():
            self.pad_row = embed(torch.tensor([self.placeholder_id], device=dev))[0]

    def __call__(self, requests: Sequence, starts: Sequence[int], counts: Sequence[int]) -> torch.Tensor | None:
        """``image_embeds [n_placeholders, hidden]`` for a packed batch in which request ``i`` computes
        positions ``starts[i] : starts[i] + counts[i]``; None when no placeholder is in it. Decided from the
        token lists on the host, so a text-only step costs no device sync."""
        pad = self.placeholder_id
        pieces = []
        for req, start, n in zip(requests, starts, counts):
            chunk = req.token_ids[start:start + n]
            if pad not in chunk:
                continue
            pos = [start + j for j, t in enumerate(chunk) if t == pad]
            table, idx, base = [self.pad_row[None]], [0] * len(pos), 1  # row 0: the placeholder's own embedding
            for im, rows in zip(req.images, self._embeds(req, start, start + n)):
                if rows is None:
                    continue
                lo, hi = max(start, im.offset), min(start + n, im.end)  # the image's part in this chunk
                for j, p in enumerate(pos):
                    if lo <= p < hi:
                        idx[j] = base + p - lo
                table.append(rows[lo - im.offset:hi - im.offset])
                base += hi - lo
            if base == 1:
                pieces.append(self.pad_row.expand(len(pos), -1))
            else:
                pieces.append(torch.cat(table)[torch.tensor(idx, device=self.pad_row.device)])
        return torch.cat(pieces) if pieces else None

    def _embeds(self, req, start: int, end: int) -> list[torch.Tensor | None]:
        """Per image of ``req``: its embedding rows when it overlaps ``[start, end)``, else None."""
        wanted = [im.offset < end and start < im.end for im in req.images]
        if not any(wanted):
            return [None] * len(req.images)
        if req.image_embeds is None:
            req.image_embeds = self._compute(req.images)
        return [rows if w else None for rows, w in zip(req.image_embeds, wanted)]

    def _compute(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Every image's rows; all pixel images of the request go through the tower in one call."""
        dev = self.pad_row.device
        px = [im for im in images if im.pixel_patches is not None]
        rows: dict[int, torch.Tensor] = {}
        if px:
            dtype = next(self.model.vision_tower.parameters()).dtype
            patches = torch.cat([im.pixel_patches for im in px]).to(dev, dtype)
            grids = torch.tensor([im.grid_thw for im in px], dtype=torch.int64)
            out = self.model.embed_images(patches, grids)
            for im, r in zip(px, out.split([im.length for im in px])):
                rows[id(im)] = r
        dtype = self.pad_row.dtype
        return [rows[id(im)] if im.embeds is None else im.embeds.to(dev, dtype) for im in images]
