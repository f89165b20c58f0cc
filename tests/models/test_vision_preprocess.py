"""Image preprocessing: resize arithmetic worked by hand, padding, patch layout, alpha, token counts, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from k3serve.models.vision_preprocess import (
    K3_MEDIA_PROC,
    K25_MEDIA_PROC,
    MediaProcConfig,
    composite_on_chessboard,
    image_grid,
    image_prompt_text,
    load_image,
    num_image_tokens,
    preprocess_image,
    resize_size,
    stack_images,
)

Image = pytest.importorskip("PIL.Image")


def _norm(v: float) -> float:
    return (v / 255.0 - 0.5) / 0.5


def _unpatchify(pixel_patches: torch.Tensor, h: int, w: int) -> np.ndarray:
    """[h*w, 3, 14, 14] -> [14h, 14w, 3], the inverse of the row-major patch layout."""
    return pixel_patches.view(h, w, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(h * 14, w * 14, 3).numpy()


# (W, H, in_patch_limit) -> (W', H'), grid (h, w), tokens; each worked by hand in the comment
RESIZE_CASES = [
    # 73*54 = 3942 patches <= 65536 and 7168/1024 > 1: no resize; pad 1024 -> 37*28, 768 -> 28*28
    ((1024, 768, 65536), (1024, 768), (56, 74), 37 * 28),
    # 20*10 = 200 patches, sqrt(50/200) = 0.5: 140x70; pad 140 -> 5*28, 70 -> 3*28
    ((280, 140, 50), (140, 70), (6, 10), 5 * 3),
    # width limit 7168/10000 = 0.7168: 10000*0.7168 = 7168, int(100*0.7168 = 71.68) = 71; pad 71 -> 84
    ((10000, 100, 65536), (7168, 71), (6, 512), 256 * 3),
    # 285*214 = 60990 patches <= 65536: no resize; pad 4000 -> 143*28, 3000 -> 108*28
    ((4000, 3000, 65536), (4000, 3000), (216, 286), 143 * 108),
    # 571*571 patches: s = sqrt(65536/326041) = 256/571; int(8000*256/571 = 3586.69) = 3586 -> 129*28
    ((8000, 8000, 65536), (3586, 3586), (258, 258), 129 * 129),
    # never upscales; 1x1 pads to one 28x28 window
    ((1, 1, 65536), (1, 1), (2, 2), 1),
    ((20, 20, 65536), (20, 20), (2, 2), 1),
]


@pytest.mark.parametrize("args, size, grid, tokens", RESIZE_CASES, ids=lambda v: str(v))
def test_resize_arithmetic(args, size, grid, tokens):
    w, h, limit = args
    cfg = MediaProcConfig(in_patch_limit=limit)
    assert resize_size(w, h, cfg) == size
    assert image_grid(w, h, cfg) == grid
    assert num_image_tokens(w, h, cfg) == tokens


@pytest.mark.parametrize("w,h,cfg,n", [
    (1024, 768, K3_MEDIA_PROC, 1036), (1861, 7041, K3_MEDIA_PROC, 16817),
    (1024, 768, K25_MEDIA_PROC, 1036), (2048, 1365, K25_MEDIA_PROC, 3626), (17, 64, K25_MEDIA_PROC, 3),
    (5000, 6000, K25_MEDIA_PROC, 4189),
])
def test_token_counts_of_k3_and_k25(w, h, cfg, n):
    """The counts the chat renderer's prompts were checked against (chat_format_examples.md §4.1)."""
    assert num_image_tokens(w, h, cfg) == n


def test_side_clamp_and_patch_limit_hold_for_many_sizes():
    cfg = MediaProcConfig()
    for w, h in [(7169, 3), (3, 20000), (14 * 600, 14 * 600), (65535, 65535), (13, 13), (15000, 15001)]:
        nw, nh = resize_size(w, h, cfg)
        assert 1 <= nw <= min(w, 7168) and 1 <= nh <= min(h, 7168)
        gh, gw = image_grid(w, h, cfg)
        assert gh % 2 == 0 and gw % 2 == 0 and gh * 14 >= nh and gw * 14 >= nw
        assert gh * 14 - nh < 28 and gw * 14 - nw < 28


def test_prompt_text_uses_original_size():
    text = image_prompt_text(1024, 768)
    assert text == "<|media_begin|>image 1024x768<|media_content|>" + "<|media_pad|>" * 1036 + "<|media_end|>"


@pytest.mark.parametrize("size", [(30, 20), (333, 517), (1, 1), (56, 42)])
def test_token_count_agrees_with_pixels(size):
    out = preprocess_image(Image.new("RGB", size, (1, 2, 3)))
    h, w = image_grid(*size)
    assert out.grid_thw.tolist() == [[1, h, w]]
    assert out.pixel_patches.shape == (h * w, 3, 14, 14)
    assert out.pixel_patches.dtype == torch.float32
    assert out.num_tokens == num_image_tokens(*size) == h * w // 4
    assert (out.width, out.height) == size


def test_padding_is_black_bottom_right():
    out = preprocess_image(Image.new("RGB", (30, 20), (255, 0, 51)))
    assert out.grid_thw.tolist() == [[1, 2, 4]]
    img = _unpatchify(out.pixel_patches, 2, 4)
    assert np.allclose(img[:20, :30], [1.0, -1.0, _norm(51)], atol=1e-6)
    assert (img[20:] == -1.0).all() and (img[:, 30:] == -1.0).all()


def test_patches_are_row_major():
    w, h = 56, 42
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[:, :, 0] = np.arange(w)[None, :]
    arr[:, :, 1] = np.arange(h)[:, None]
    out = preprocess_image(Image.fromarray(arr))
    assert out.grid_thw.tolist() == [[1, 4, 4]]
    # patch r*4 + c holds rows 14r.., columns 14c..; channel 0 encodes the column, 1 the row
    p = out.pixel_patches
    for r in range(3):
        for c in range(4):
            torch.testing.assert_close(p[r * 4 + c, 0, 5], torch.tensor([_norm(14 * c + i) for i in range(14)]))
            torch.testing.assert_close(p[r * 4 + c, 1, :, 7], torch.tensor([_norm(14 * r + i) for i in range(14)]))
    assert (p[12:, :, :, :] == -1.0).all()


def test_resize_is_pil_bicubic_on_uint8():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))
    cfg = MediaProcConfig(in_patch_limit=12)  # 8*6 = 48 patches -> scale 0.5 -> 60x45
    assert resize_size(120, 90, cfg) == (60, 45)
    out = preprocess_image(img, cfg)
    expected = np.asarray(img.resize((60, 45), Image.Resampling.BICUBIC)).astype(np.float64)
    h, w = out.grid_thw[0, 1:].tolist()
    got = _unpatchify(out.pixel_patches, h, w)[:45, :60]
    assert np.allclose(got, (expected / 255 - 0.5) / 0.5, atol=1e-6)


def test_alpha_composited_on_chessboard():
    rgba = np.zeros((20, 20, 4), dtype=np.uint8)
    rgba[:, :, :3] = (10, 20, 30)
    rgba[0, 0, 3] = 128
    rgba[0, 15, 3] = 128
    rgba[19, 19, 3] = 255
    # a = 128/255: 10a + 255(1-a) = 132.02 -> 132; 20a + 127 = 137.04 -> 137; 30a + 127 = 142.06 -> 142
    comp = composite_on_chessboard(rgba)
    assert comp[0, 0].tolist() == [132, 137, 142]
    # over gray, 180(1-a) = 89.647: 94.67 -> 94, 99.69 -> 99, 104.71 -> 104 (floor, not round)
    assert comp[0, 15].tolist() == [94, 99, 104]
    assert comp[0, 1].tolist() == [255, 255, 255]  # transparent, white square at the top-left
    assert comp[0, 8].tolist() == [180, 180, 180]  # next 8-px square is gray
    assert comp[8, 0].tolist() == [180, 180, 180]
    assert comp[8, 8].tolist() == [255, 255, 255]
    assert comp[19, 19].tolist() == [10, 20, 30]  # opaque pixel untouched

    out = preprocess_image(Image.fromarray(rgba, "RGBA"))
    img = _unpatchify(out.pixel_patches, 2, 2)
    assert np.allclose(img[0, 0], [_norm(132), _norm(137), _norm(142)], atol=1e-6)
    assert np.allclose(img[0, 9], _norm(180), atol=1e-6)
    assert (img[20:] == -1.0).all()  # padding stays black, not chessboard


def test_palette_transparency_uses_chessboard():
    img = Image.new("P", (16, 16), 0)
    img.putpalette([10, 20, 30] * 256)
    img.info["transparency"] = 0
    pix = _unpatchify(preprocess_image(img).pixel_patches, 2, 2)
    assert np.allclose(pix[0, 0], 1.0) and np.allclose(pix[0, 8], _norm(180), atol=1e-6)


def _png(size=(100, 100)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (5, 6, 7)).save(buf, format="PNG")
    return buf.getvalue()


def test_bytes_input_decodes():
    out = preprocess_image(_png((50, 40)))
    assert (out.width, out.height) == (50, 40)
    assert np.allclose(_unpatchify(out.pixel_patches, 4, 4)[0, 0], [_norm(5), _norm(6), _norm(7)], atol=1e-6)


@pytest.mark.parametrize("data", [b"not an image", b"", _png()[:60]], ids=["garbage", "empty", "truncated"])
def test_undecodable_raises_value_error(data):
    with pytest.raises(ValueError, match="cannot decode"):
        preprocess_image(data)


def test_oversized_raises_value_error():
    with pytest.raises(ValueError, match="limit"):
        load_image(_png((100, 100)), MediaProcConfig(max_image_pixels=5000))
    with pytest.raises(ValueError, match="limit"):
        preprocess_image(Image.new("RGB", (100, 100)), MediaProcConfig(max_image_pixels=5000))


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="width"):
        num_image_tokens(0, 10)
    with pytest.raises(ValueError, match="height"):
        image_prompt_text(10, -3)
    with pytest.raises(ValueError, match="expected encoded bytes or a PIL image"):
        preprocess_image(np.zeros((4, 4, 3)))
    with pytest.raises(ValueError, match="in_patch_limit"):
        MediaProcConfig(in_patch_limit=0)
    with pytest.raises(ValueError, match="no images"):
        stack_images([])


def test_stack_images_packs_in_order():
    a = preprocess_image(Image.new("RGB", (30, 20)))
    b = preprocess_image(Image.new("RGB", (28, 56), (255, 255, 255)))
    pixels, grid = stack_images([a, b])
    assert grid.tolist() == [[1, 2, 4], [1, 4, 2]]
    assert torch.equal(pixels[:8], a.pixel_patches) and torch.equal(pixels[8:], b.pixel_patches)
