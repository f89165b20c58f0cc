"""Image preprocessing for the K3 vision tower, and how an image is framed in the prompt (model.md §6, §11.5).

  load_image(data: bytes) -> PIL image                 decode, refusing undecodable or oversized input
  resize_size(W, H) -> (W', H')                         navit rule, truncating, never upscaling
  image_grid(W, H) -> (h, w)                            patch grid after padding to a multiple of 28 px
  num_image_tokens(W, H) -> (h/2)*(w/2)                 number of <|media_pad|> tokens (the only copy of this count:
                                                        the server expands prompt placeholders with it)
  image_prompt_text(W, H) -> "<|media_begin|>image {W}x{H}<|media_content|>" + N*"<|media_pad|>" + "<|media_end|>"
  preprocess_image(image) -> PreprocessedImage          pixel_patches [h*w, 3, 14, 14] fp32, grid_thw [1, 3]
  stack_images(items) -> (pixel_patches [sum h*w, 3, 14, 14], grid_thw [n, 3])   the tower's packed input

W x H is always the original (decoded) size. Pixels: resize with PIL BICUBIC in the image's own mode; images
with alpha keep it through the resize and are then composited onto a chessboard (8 px squares, 255 at the
top-left square, 180 on the others, the same value on R, G, B) as floor(a*rgb + (1-a)*bg) with a = A/255;
pad bottom/right with 0; scale by 1/255 and normalise with mean = std = 0.5 (pad pixels become -1);
patchify row-major. Only math is imported at module load: numpy, torch and Pillow (an optional dependency)
are imported by the functions that touch pixels, so token counting stays cheap for the server.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"

# PIL resamples these modes itself (palette and 1-bit images with NEAREST, as the reference processor does);
# anything else is converted to RGB(A) first.
_RESAMPLABLE_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr", "I", "F")


@dataclass(frozen=True)
class MediaProcConfig:
    """The ``media_proc_cfg`` values of K3's ``preprocessor_config.json`` that shape an image."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: float = 0.5
    image_std: float = 0.5
    chessboard_square_size: int = 8
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 180
    max_image_pixels: int = 1 << 27

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                     "chessboard_square_size", "max_image_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"media_proc_cfg.{name}: must be positive, got {getattr(self, name)}")
        if self.image_std <= 0:
            raise ValueError(f"media_proc_cfg.image_std: must be positive, got {self.image_std}")


K3_MEDIA_PROC = MediaProcConfig()
K25_MEDIA_PROC = MediaProcConfig(in_patch_limit=16384)  # K2.5's preprocessor_config: a quarter of K3's patches


@dataclass(frozen=True)
class PreprocessedImage:
    pixel_patches: torch.Tensor  # [h*w, 3, P, P] float32
    grid_thw: torch.Tensor  # [1, 3] int64: (1, h, w)
    width: int  # original size, as written in the prompt
    height: int
    num_tokens: int  # (h/2)*(w/2) merged tokens = <|media_pad|> count


def _check_size(width: Any, height: Any) -> None:
    for name, v in (("width", width), ("height", height)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"image {name}: must be a positive integer, got {v!r}")


def resize_size(width: int, height: int, cfg: MediaProcConfig = K3_MEDIA_PROC) -> tuple[int, int]:
    """Target (W', H'): scale down to at most in_patch_limit patches and patch_limit_on_one_side per side."""
    _check_size(width, height)
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(1.0,
                math.sqrt(cfg.in_patch_limit / (max(1, width // p) * max(1, height // p))),
                side * p / width,
                side * p / height)
    # int() truncates, exactly as every reference port does, so token counts agree
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    return new_w, new_h


def image_grid(width: int, height: int, cfg: MediaProcConfig = K3_MEDIA_PROC) -> tuple[int, int]:
    """(h, w) in patches after padding the resized image up to a multiple of merge*patch pixels."""
    new_w, new_h = resize_size(width, height, cfg)
    f = cfg.patch_size * cfg.merge_kernel_size
    return -(-new_h // f) * cfg.merge_kernel_size, -(-new_w // f) * cfg.merge_kernel_size


def num_image_tokens(width: int, height: int, cfg: MediaProcConfig = K3_MEDIA_PROC) -> int:
    h, w = image_grid(width, height, cfg)
    return (h // cfg.merge_kernel_size) * (w // cfg.merge_kernel_size)


def image_prompt_text(width: int, height: int, cfg: MediaProcConfig = K3_MEDIA_PROC) -> str:
    n = num_image_tokens(width, height, cfg)
    return f"{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}{MEDIA_PAD * n}{MEDIA_END}"


def _pil() -> Any:
    try:
        from PIL import Image
    except ModuleNotFoundError:
        raise ModuleNotFoundError("image input needs Pillow: pip install pillow") from None
    return Image


def load_image(data: bytes, cfg: MediaProcConfig = K3_MEDIA_PROC) -> Image.Image:
    """Decode an encoded image (PNG, JPEG, ...); ValueError if it cannot be decoded or is too large."""
    pil = _pil()
    try:
        with warnings.catch_warnings():
            # size is checked below against our own limit
            warnings.simplefilter("ignore", pil.DecompressionBombWarning)
            img = pil.open(io.BytesIO(data))
    except pil.DecompressionBombError as e:
        raise ValueError(f"image: too large to decode ({e})") from None
    except Exception as e:
        raise ValueError(f"image: cannot decode ({type(e).__name__}: {e})") from None
    w, h = img.size
    if w * h > cfg.max_image_pixels:
        raise ValueError(f"image: {w}x{h} has {w * h} pixels, more than the limit of {cfg.max_image_pixels}")
    try:
        img.load()
    except Exception as e:
        raise ValueError(f"image: cannot decode ({type(e).__name__}: {e})") from None
    return img


def chessboard(height: int, width: int, cfg: MediaProcConfig = K3_MEDIA_PROC) -> np.ndarray:
    """[height, width, 3] uint8 background: white square at the top-left, alternating with gray."""
    import numpy as np

    s = cfg.chessboard_square_size
    parity = (np.arange(height)[:, None] // s + np.arange(width)[None, :] // s) % 2
    board = np.where(parity == 0, cfg.chessboard_white_value, cfg.chessboard_gray_value).astype(np.uint8)
    return np.repeat(board[:, :, None], 3, axis=2)


def composite_on_chessboard(rgba: np.ndarray, cfg: MediaProcConfig = K3_MEDIA_PROC) -> np.ndarray:
    """[H, W, 4] uint8 -> [H, W, 3] uint8: floor(a*rgb + (1-a)*bg) in float32, a = A/255."""
    import numpy as np

    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    bg = chessboard(rgba.shape[0], rgba.shape[1], cfg)
    out = alpha * rgba[:, :, :3] + (1 - alpha) * bg
    return np.clip(out, 0, 255).astype(np.uint8)


def preprocess_image(image: Image.Image | bytes, cfg: MediaProcConfig = K3_MEDIA_PROC) -> PreprocessedImage:
    import numpy as np
    import torch

    pil = _pil()
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = load_image(bytes(image), cfg)
    elif not isinstance(image, pil.Image):
        raise ValueError(f"image: expected encoded bytes or a PIL image, got {type(image).__name__}")
    width, height = image.size
    if width * height > cfg.max_image_pixels:
        raise ValueError(f"image: {width}x{height} has more pixels than the limit of {cfg.max_image_pixels}")
    new_w, new_h = resize_size(width, height, cfg)
    grid_h, grid_w = image_grid(width, height, cfg)

    has_alpha = "A" in image.getbands() or "transparency" in image.info
    if image.mode not in _RESAMPLABLE_MODES:
        try:
            image = image.convert("RGBA" if has_alpha else "RGB")
        except ValueError as e:
            raise ValueError(f"image: unsupported pixel mode {image.mode!r} ({e})") from None
    image = image.resize((new_w, new_h), pil.Resampling.BICUBIC)
    if has_alpha:
        rgb = composite_on_chessboard(np.asarray(image.convert("RGBA")), cfg)
    else:
        rgb = np.asarray(image.convert("RGB"))

    p = cfg.patch_size
    padded = np.zeros((grid_h * p, grid_w * p, 3), dtype=np.uint8)
    padded[:new_h, :new_w] = rgb
    # scaled in float64 then stored as float32, like the reference processor
    x = ((padded / 255.0).astype(np.float32) - cfg.image_mean) * (1.0 / cfg.image_std)
    patches = x.astype(np.float32).reshape(grid_h, p, grid_w, p, 3).transpose(0, 2, 4, 1, 3)
    pixel_patches = torch.from_numpy(np.ascontiguousarray(patches.reshape(grid_h * grid_w, 3, p, p)))
    grid_thw = torch.tensor([[1, grid_h, grid_w]], dtype=torch.int64)
    n_tokens = (grid_h // cfg.merge_kernel_size) * (grid_w // cfg.merge_kernel_size)
    return PreprocessedImage(pixel_patches, grid_thw, width, height, n_tokens)


def stack_images(items: list[PreprocessedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack images for one tower call: ([sum h*w, 3, P, P], [n, 3]) in the given order."""
    import torch

    if not items:
        raise ValueError("stack_images: no images")
    return torch.cat([it.pixel_patches for it in items]), torch.cat([it.grid_thw for it in items])
