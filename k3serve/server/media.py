"""Image inputs of chat requests: `image_url` parts -> decoded images, with the server's limits.

Base64 `data:` URLs are decoded locally. Remote URLs are refused unless their host is listed in
`--allowed-media-domains` (then fetched with a timeout and a size cap). Each image is opened with
Pillow (bad data is a 400), counted against `--limit-images`, and reported by its original
width x height, which the K3 renderer writes into the prompt and which sets its vision-token count.
Pillow reads the declared width x height from the header without decompressing; the pixel limit is
checked on it first, so a small file claiming a huge image costs nothing. Decoding and preprocessing
run through `run` (the server's worker pool), off the event loop.
`engine_images` then preprocesses each image (`models.vision_preprocess`: resize, pad, normalise,
patchify) into an `ImageData` message, raw float32 pixel bytes + shape + grid, for the engine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

from k3serve.engine.messages import ImageData
from k3serve.models.vision_preprocess import MediaProcConfig

MEDIA_PAD_ID = 163605


@dataclass(frozen=True)
class MediaLimits:
    max_images: int = 8
    max_image_bytes: int = 20 << 20
    max_pixels: int = 25_000_000  # a 6000x4000 photo; decoding is ~3 bytes a pixel (and time) in the frontend
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0


def image_parts(messages: Sequence[Any]) -> list[Any]:
    """The `image_url` payloads in message order (shape errors are left to the renderer)."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("image_url", "image"):
                out.append(part.get("image_url", part.get("image")))
    return out


def _url(payload: Any, k: int) -> str:
    url = payload.get("url") if isinstance(payload, dict) else payload
    if not isinstance(url, str) or not url:
        raise ValueError(f"image {k}: image_url.url must be a non-empty string")
    return url


def _decode_data_url(url: str, k: int, limits: MediaLimits) -> bytes:
    head, sep, data = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError(f"image {k}: data URLs must look like data:image/<type>;base64,<data>")
    if len(data) * 3 // 4 > limits.max_image_bytes:
        raise ValueError(f"image {k}: larger than {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"image {k}: invalid base64 data") from None


async def _fetch(url: str, k: int, limits: MediaLimits) -> bytes:
    host = (urlparse(url).hostname or "").lower()
    if urlparse(url).scheme not in ("http", "https") or not host:
        raise ValueError(f"image {k}: only data: URLs (or http(s) URLs of allowed domains) are accepted")
    if not any(host == d or host.endswith("." + d) for d in limits.allowed_domains):
        raise ValueError(f"image {k}: remote image URLs are not allowed (host {host!r}); send a base64 data URL")
    import httpx

    try:
        async with httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=False) as client:
            r = await client.get(url)
    except httpx.HTTPError as e:
        raise ValueError(f"image {k}: could not fetch {url!r}: {type(e).__name__}") from None
    if r.status_code != 200:
        raise ValueError(f"image {k}: fetching {url!r} returned HTTP {r.status_code}")
    if len(r.content) > limits.max_image_bytes:
        raise ValueError(f"image {k}: larger than {limits.max_image_bytes} bytes")
    return r.content


def open_image(data: bytes, k: int, limits: MediaLimits) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > limits.max_pixels:
            from k3serve.server.limits import too_large

            raise too_large(f"image {k}: {w}x{h} exceeds this server's limit of {limits.max_pixels} pixels "
                            "(--max-image-pixels)", "messages")
        img.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError):
        raise ValueError(f"image {k}: not a readable image") from None
    return img


Run = Callable[..., Awaitable[Any]]


async def _inline(fn, *args):
    return fn(*args)


async def load_images(messages: Sequence[Any], limits: MediaLimits, run: Run = _inline) -> list[Image.Image]:
    """Decode the request's images; `run(fn, *args)` runs the base64 decode and the image decode (the
    server passes its worker pool, so none of it blocks the event loop)."""
    parts = image_parts(messages)
    if len(parts) > limits.max_images:
        raise ValueError(f"messages: at most {limits.max_images} images per request, got {len(parts)}")
    images = []
    for k, payload in enumerate(parts):
        url = _url(payload, k)
        data = await run(_decode_data_url, url, k, limits) if url.startswith("data:") else await _fetch(url, k, limits)
        images.append(await run(open_image, data, k, limits))
    return images


def expand_media_pads(ids: Sequence[int], counts: Sequence[int], pad_id: int = MEDIA_PAD_ID) -> list[int]:
    """Replace the k-th pad id with counts[k] copies (user text cannot contain the pad id: it is
    encoded with special tokens disallowed)."""
    return expand_media_spans(ids, counts, pad_id)[0]


def expand_media_spans(ids: Sequence[int], counts: Sequence[int],
                       pad_id: int = MEDIA_PAD_ID) -> tuple[list[int], list[tuple[int, int]]]:
    """`expand_media_pads`, plus each image's `(offset, length)` in the expanded ids."""
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    for t in ids:
        if t == pad_id:
            if len(spans) >= len(counts):
                raise ValueError("the prompt holds more image placeholders than images")
            n = counts[len(spans)]
            spans.append((len(out), n))
            out += [pad_id] * n
        else:
            out.append(t)
    if len(spans) != len(counts):
        raise ValueError("the prompt holds fewer image placeholders than images")
    return out, spans


def _image_data(image: Image.Image, span: tuple[int, int], k: int, media: MediaProcConfig) -> ImageData:
    from k3serve.models.vision_preprocess import preprocess_image

    pre = preprocess_image(image, media)
    if pre.num_tokens != span[1]:  # the renderer's count and the preprocessor's must agree
        raise ValueError(f"image {k}: {pre.num_tokens} vision tokens after preprocessing, {span[1]} in the prompt")
    px = pre.pixel_patches.contiguous()
    return ImageData(offset=span[0], length=span[1], pixels=px.numpy().tobytes(), shape=list(px.shape),
                     dtype="float32", grid_thw=[int(x) for x in pre.grid_thw[0]])


async def engine_images(images: Sequence[Image.Image], spans: Sequence[tuple[int, int]],
                        media: MediaProcConfig, run: Run | None = None) -> list[ImageData]:
    """Preprocess each image for the vision tower (through `run`, default a worker thread: resizing is
    CPU work) into the typed message the engine takes; `spans` are the images' placeholder runs."""
    if not images:
        return []
    return await (run or asyncio.to_thread)(
        lambda: [_image_data(im, span, k, media) for k, (im, span) in enumerate(zip(images, spans))])
