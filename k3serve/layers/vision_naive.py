"""Naive restatement of the K3 vision tower + projector (the spec in code), for tests.

``naive_vision_forward(model, pixel_patches [N, 3, P, P], grid_thw) -> [M, text_hidden]`` reads the weights of
a ``VisionEncoder`` and recomputes everything in float64, one image at a time: the patch conv as a matmul,
bilinear pos-emb resize from the align_corners=False formula, the time embedding from its closed form, RoPE
as complex multiplication, attention as an explicit softmax, the merger and projector with plain loops and
matmuls. It shares no code with ``layers/vision.py``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3serve.layers.vision import VisionEncoder


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _bilinear_1d(n_in: int, n_out: int) -> list[tuple[int, int, float]]:
    """For each output index: (i0, i1, weight of i1), the align_corners=False rule."""
    taps = []
    for i in range(n_out):
        src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = int(math.floor(src))
        i1 = min(i0 + 1, n_in - 1)
        taps.append((i0, i1, src - i0))
    return taps


def naive_pos_grid(weight: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[H0, W0, D] -> [h, w, D] by the bilinear formula, evaluated point by point."""
    h0, w0, d = weight.shape
    out = torch.empty(h, w, d, dtype=weight.dtype)
    for y, (y0, y1, ly) in enumerate(_bilinear_1d(h0, h)):
        for x, (x0, x1, lx) in enumerate(_bilinear_1d(w0, w)):
            top = (1 - lx) * weight[y0, x0] + lx * weight[y0, x1]
            bottom = (1 - lx) * weight[y1, x0] + lx * weight[y1, x1]
            out[y, x] = (1 - ly) * top + ly * bottom
    return out


def naive_time_embedding(t: int, dim: int) -> torch.Tensor:
    half = dim // 2
    table = torch.empty(t, dim, dtype=torch.float64)
    for f in range(t):
        for i in range(half):
            omega = 1.0 / 10000 ** (i / half)
            table[f, i] = math.sin(f * omega)
            table[f, half + i] = math.cos(f * omega)
    return table


def naive_rope(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, H, D_h]; complex pair p rotates by (col if p even else row) * theta^(-4*(p//2)/D_h)."""
    d = x.shape[-1]
    p = torch.arange(d // 2)
    omega = theta ** (-4.0 * (p // 2).double() / d)
    pos = torch.where(p % 2 == 0, cols[:, None], rows[:, None]).double()
    rot = torch.polar(torch.ones_like(pos), pos * omega)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot[:, None, :]).flatten(-2)


def _one_image(model: VisionEncoder, pixels: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
    cfg = model.cfg
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    eps = torch.finfo(torch.float32).eps
    d, nh, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim

    x = pixels.double().flatten(1) @ sd["vision_tower.patch_embed.proj.weight"].flatten(1).T
    pos = naive_pos_grid(sd["vision_tower.patch_embed.pos_emb.weight"], h, w).reshape(h * w, d)
    pos = pos.repeat(t, 1)
    if t > 1:
        pos = pos + naive_time_embedding(t, d).repeat_interleave(h * w, dim=0)
    x = x + pos

    rows = torch.arange(h).repeat_interleave(w).repeat(t)
    cols = torch.arange(w).repeat(h).repeat(t)
    for j in range(cfg.num_layers):
        b = f"vision_tower.encoder.blocks.{j}."
        y = _rms_norm(x, sd[b + "norm0.weight"], eps)
        wq, wk, wv = sd[b + "wqkv.weight"].split(cfg.qkv_hidden_size, dim=0)
        q = (y @ wq.T).view(-1, nh, dh)
        k = (y @ wk.T).view(-1, nh, dh)
        v = (y @ wv.T).view(-1, nh, dh)
        q, k = naive_rope(q, rows, cols, cfg.rope_theta), naive_rope(k, rows, cols, cfg.rope_theta)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
        attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(-1, nh * dh)
        x = x + attn @ sd[b + "wo.weight"].T
        y = _rms_norm(x, sd[b + "norm1.weight"], eps)
        x = x + _gelu_tanh(y @ sd[b + "mlp.fc0.weight"].T) @ sd[b + "mlp.fc1.weight"].T
    x = _rms_norm(x, sd["vision_tower.encoder.final_layernorm.weight"], eps)

    frames = x.view(t, h, w, d).mean(dim=0)
    kh, kw = cfg.merge_kernel_size
    merged = []
    for r in range(0, h, kh):
        for c in range(0, w, kw):
            merged.append(torch.cat([frames[r + i, c + j] for i in range(kh) for j in range(kw)]))
    z = torch.stack(merged)

    z = _gelu_erf(z @ sd["mm_projector.proj.0.weight"].T) @ sd["mm_projector.proj.2.weight"].T
    return _rms_norm(z, sd["mm_projector.post_norm.weight"], cfg.projector_ln_eps)


def naive_vision_forward(model: VisionEncoder, pixel_patches: torch.Tensor,
                         grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
    out, start = [], 0
    for t, h, w in grid_thw:
        out.append(_one_image(model, pixel_patches[start:start + t * h * w], t, h, w))
        start += t * h * w
    return torch.cat(out)
