"""Vision-token count of one image: how many `<|media_pad|>` ids its single placeholder becomes
(chat_format_examples.md §4.1; navit rule with 14-px patches merged 2×2).

The image is scaled down (never up) to at most `patch_limit` 14-px patches and 512 patches per
side, each side truncated, then padded up to a multiple of 28; each 28×28 cell is one token.
"""

from __future__ import annotations

import math

K3_PATCH_LIMIT = 65536
K25_PATCH_LIMIT = 16384
_PATCH = 14
_MAX_SIDE = 512 * _PATCH


def vision_tokens(width: int, height: int, patch_limit: int = K3_PATCH_LIMIT) -> int:
    if width <= 0 or height <= 0 or patch_limit <= 0:
        raise ValueError(f"image size and patch limit must be positive, got {width}x{height}, {patch_limit}")
    patches = max(1, (width // _PATCH) * (height // _PATCH))
    scale = min(1.0, math.sqrt(patch_limit / patches), _MAX_SIDE / width, _MAX_SIDE / height)
    w, h = int(width * scale), int(height * scale)
    cell = 2 * _PATCH
    return math.ceil(max(w, 1) / cell) * math.ceil(max(h, 1) / cell)
