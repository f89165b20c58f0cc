"""K3 vision tower + projector against the naive restatement, plus the properties the spec pins down."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from k3serve.core.config import ModelConfig, VisionConfig
from k3serve.layers.vision import (
    PosEmbedding,
    VisionEncoder,
    apply_rope_2d,
    merge_patches,
    resize_pos_grid,
    rope_2d_cos_sin,
)
from k3serve.layers.vision_naive import naive_pos_grid, naive_rope, naive_time_embedding, naive_vision_forward

CONFIGS = Path(__file__).resolve().parents[2] / "k3serve" / "models" / "configs"


def _cfg(name: str) -> VisionConfig:
    vision = ModelConfig.from_file(CONFIGS / name).vision
    assert vision is not None
    return vision


@pytest.fixture(scope="module")
def tiny() -> VisionConfig:
    return _cfg("k3-tiny.json")


@pytest.fixture(scope="module")
def model(tiny: VisionConfig) -> VisionEncoder:
    torch.manual_seed(0)
    m = VisionEncoder(tiny).eval()
    # norms start at ones: randomise every weight so each one can show up in the comparison
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif not name.endswith("pos_emb.weight"):
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.05)
    return m


def _expected_keys(D: int, layers: int, qkv: int, mlp: int, h0: int, w0: int, text: int) -> dict[str, tuple]:
    """model.md §8.1, 'Vision and projector keys', with the sizes as parameters."""
    keys = {
        "vision_tower.patch_embed.proj.weight": (D, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (h0, w0, D),
        "vision_tower.encoder.final_layernorm.weight": (D,),
        "mm_projector.proj.0.weight": (4 * D, 4 * D),
        "mm_projector.proj.2.weight": (text, 4 * D),
        "mm_projector.post_norm.weight": (text,),
    }
    for j in range(layers):
        b = f"vision_tower.encoder.blocks.{j}."
        keys |= {b + "norm0.weight": (D,), b + "norm1.weight": (D,), b + "wqkv.weight": (3 * qkv, D),
                 b + "wo.weight": (D, qkv), b + "mlp.fc0.weight": (mlp, D), b + "mlp.fc1.weight": (D, mlp)}
    return keys


def _shapes(m: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def test_state_dict_keys_tiny(tiny):
    assert _shapes(VisionEncoder(tiny)) == _expected_keys(64, 2, 96, 256, 16, 16, 128)


def test_state_dict_keys_full_match_checkpoint_shapes():
    with torch.device("meta"):
        m = VisionEncoder(_cfg("kimi-k3.json"))
    shapes = _shapes(m)
    assert shapes == _expected_keys(1024, 27, 1536, 4096, 64, 64, 7168)
    # the literal shapes listed in model.md §8.1
    assert shapes["vision_tower.encoder.blocks.26.wqkv.weight"] == (4608, 1024)
    assert shapes["vision_tower.encoder.blocks.0.wo.weight"] == (1024, 1536)
    assert shapes["mm_projector.proj.0.weight"] == (4096, 4096)
    assert shapes["mm_projector.proj.2.weight"] == (7168, 4096)


def test_norm_eps(tiny):
    m = VisionEncoder(tiny)
    tower_norms = [mod for mod in m.vision_tower.modules() if isinstance(mod, torch.nn.RMSNorm)]
    assert len(tower_norms) == 2 * tiny.num_layers + 1
    assert all(n.eps == torch.finfo(torch.float32).eps for n in tower_norms)
    assert m.mm_projector.post_norm.eps == 1e-5


GRIDS = [(1, 4, 6), (2, 2, 4), (1, 6, 2), (1, 16, 16)]


def _pixels(grids, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=g)


def test_packed_matches_naive_per_image(model):
    px = _pixels(GRIDS)
    with torch.no_grad():
        got = model(px, torch.tensor(GRIDS))
        ref = naive_vision_forward(model, px, GRIDS)
    assert got.shape == (sum(h * w // 4 for _, h, w in GRIDS), 128)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_packed_equals_one_image_at_a_time(model):
    px = _pixels(GRIDS)
    with torch.no_grad():
        packed = model(px, GRIDS)
        singles, start = [], 0
        for t, h, w in GRIDS:
            singles.append(model(px[start:start + t * h * w], [(t, h, w)]))
            start += t * h * w
    torch.testing.assert_close(packed, torch.cat(singles), rtol=1e-5, atol=1e-5)


def test_attention_does_not_cross_images(model):
    grids = [(1, 4, 4), (1, 2, 4)]
    px = _pixels(grids)
    px2 = px.clone()
    px2[16:] = torch.randn(8, 3, 14, 14)
    with torch.no_grad():
        a, b = model(px, grids), model(px2, grids)
    torch.testing.assert_close(a[:4], b[:4], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(a[4:], b[4:], atol=1e-3)


def test_bf16_close_to_fp32(model, tiny):
    px = _pixels(GRIDS[:2])
    m16 = VisionEncoder(tiny)
    m16.load_state_dict(model.state_dict())
    m16 = m16.to(torch.bfloat16).eval()
    with torch.no_grad():
        ref, got = model(px, GRIDS[:2]), m16(px, GRIDS[:2])
    assert got.dtype == torch.bfloat16
    rel = (got.float() - ref).norm() / ref.norm()
    assert rel < 5e-2


def _dot_at(q, k, pos_q, pos_k, grid=32, head_dim=48, theta=10000.0):
    cos, sin = rope_2d_cos_sin(grid, grid, head_dim, theta)
    iq, ik = pos_q[0] * grid + pos_q[1], pos_k[0] * grid + pos_k[1]
    rq = apply_rope_2d(q, cos[iq:iq + 1], sin[iq:iq + 1])
    rk = apply_rope_2d(k, cos[ik:ik + 1], sin[ik:ik + 1])
    return (rq * rk).sum(-1)


@pytest.mark.parametrize("shift", [(0, 5), (7, 0), (3, 11)], ids=["x", "y", "xy"])
def test_rope_relative_position_invariance(shift):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 48, generator=g), torch.randn(1, 2, 48, generator=g)
    pq, pk = (2, 3), (9, 1)
    base = _dot_at(q, k, pq, pk)
    moved = _dot_at(q, k, (pq[0] + shift[0], pq[1] + shift[1]), (pk[0] + shift[0], pk[1] + shift[1]))
    torch.testing.assert_close(base, moved, rtol=1e-4, atol=1e-4)
    # moving only q changes the relative offset, so the score must change
    q_only = _dot_at(q, k, (pq[0] + shift[0], pq[1] + shift[1]), pk)
    assert not torch.allclose(base, q_only, atol=1e-3)


def test_rope_axes_and_frequencies():
    dh = 16
    cos, sin = rope_2d_cos_sin(4, 8, dh, 10000.0)
    x = torch.randn(32, 1, dh)
    out = apply_rope_2d(x, cos, sin)
    # position (row 0, col 3) = index 3: only x-pairs (dims 4j, 4j+1) rotate
    y_dims = [d for d in range(dh) if d % 4 in (2, 3)]
    torch.testing.assert_close(out[3, 0, y_dims], x[3, 0, y_dims])
    # position (row 2, col 0) = index 16: only y-pairs rotate
    x_dims = [d for d in range(dh) if d % 4 in (0, 1)]
    torch.testing.assert_close(out[16, 0, x_dims], x[16, 0, x_dims])
    # pair 2 (dims 4, 5) follows x with w_1 = theta^(-4/16): a unit vector at col 3 turns by 3*w_1
    e = torch.zeros(1, 1, dh)
    e[..., 4] = 1.0
    ang = 3 * 10000.0 ** (-4 / dh)
    r = apply_rope_2d(e, cos[3:4], sin[3:4])
    torch.testing.assert_close(r[0, 0, 4:6], torch.tensor([math.cos(ang), math.sin(ang)]))


def test_rope_matches_complex_form():
    h, w, dh = 3, 5, 48
    cos, sin = rope_2d_cos_sin(h, w, dh, 10000.0)
    x = torch.randn(h * w, 2, dh, dtype=torch.float64)
    rows = torch.arange(h).repeat_interleave(w)
    cols = torch.arange(w).repeat(h)
    torch.testing.assert_close(apply_rope_2d(x.float(), cos, sin).double(), naive_rope(x, rows, cols, 10000.0),
                               rtol=1e-5, atol=1e-5)


def test_pos_emb_identity_at_native_grid():
    pe = PosEmbedding(16, 16, 8)
    x = torch.randn(256, 8)
    with torch.no_grad():
        out = pe(x, [(1, 16, 16)])
    assert torch.equal(resize_pos_grid(pe.weight, 16, 16), pe.weight.flatten(0, 1))
    assert torch.equal(out, x + pe.weight.flatten(0, 1))


@pytest.mark.parametrize("size", [(6, 10), (20, 3), (16, 24)])
def test_pos_emb_interpolation_matches_bilinear_formula(size):
    weight = torch.randn(16, 16, 8, dtype=torch.float64)
    h, w = size
    got = resize_pos_grid(weight, h, w)
    torch.testing.assert_close(got, naive_pos_grid(weight, h, w).reshape(h * w, 8), rtol=1e-6, atol=1e-6)


def test_time_embedding_added_for_video_frames():
    pe = PosEmbedding(4, 4, 8)
    x = torch.zeros(3 * 16, 8)
    with torch.no_grad():
        out = pe(x, [(3, 4, 4)]).view(3, 16, 8)
        still = pe(torch.zeros(16, 8), [(1, 4, 4)])
    table = naive_time_embedding(3, 8).float()
    for f in range(3):
        torch.testing.assert_close(out[f], pe.weight.flatten(0, 1) + table[f], rtol=1e-5, atol=1e-5)
    # frame 0 still gets the table's row 0 (sin 0 | cos 0 = 0...0 | 1...1); a single image gets none
    assert torch.equal(table[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert torch.equal(still, pe.weight.flatten(0, 1))


def test_merger_order_hand_made():
    t, h, w = 2, 4, 4
    rows = torch.arange(h).repeat_interleave(w).float()
    cols = torch.arange(w).repeat(h).float()
    v = 100 * rows + cols
    frame0 = torch.stack([v, -v], dim=-1)
    x = torch.cat([frame0, frame0 + 2])
    out = merge_patches(x, [(t, h, w)], (2, 2))
    assert out.shape == (4, 8)

    def window(r, c):
        vals = [100 * (r + i) + (c + j) + 1 for i in range(2) for j in range(2)]
        return [f for a in vals for f in (a, -a + 2)]

    expected = torch.tensor([window(0, 0), window(0, 2), window(2, 0), window(2, 2)])
    assert torch.equal(out, expected)


def test_output_shapes_tiny(model):
    grids = [[1, 2, 2], [1, 8, 4], [4, 2, 6]]
    with torch.no_grad():
        out = model(_pixels([tuple(g) for g in grids]), torch.tensor(grids, dtype=torch.int32))
    assert out.shape == (1 + 8 + 3, 128)
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    "n, grid, match",
    [
        (15, [[1, 4, 4]], "16 patches"),
        (12, [[1, 3, 4]], "multiples of the merge kernel"),
        (80, [[5, 4, 4]], "time-embedding"),
        (16, [[1, 4, 4, 1]], r"\[n_images, 3\]"),
        (0, [], r"\[n_images, 3\]"),
        (16, [[0, 4, 4]], "positive"),
    ],
)
def test_bad_input_raises_value_error(model, n, grid, match):
    with pytest.raises(ValueError, match=match):
        model(torch.zeros(n, 3, 14, 14), grid)


def test_bad_pixel_shape_raises_value_error(model):
    with pytest.raises(ValueError, match="pixel_patches"):
        model(torch.zeros(16, 3, 16, 16), [[1, 4, 4]])
