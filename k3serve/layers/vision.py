"""The K3 vision tower (MoonViT, RMSNorm flavour, no biases) and its patch-merger projector.

Input: ``pixel_patches [N, 3, P, P]`` (P = 14) and ``grid_thw [n_images, 3]`` = (t, h, w) in patches. Each
image's patches come in (frame, row, column) order and images are packed one after another, so
N = sum_i t_i*h_i*w_i. Output: ``[M, text_hidden]`` with M = sum_i (h_i/2)*(w_i/2), in image order; these
rows replace the ``<|media_pad|>`` positions of the prompt.

  vision_tower.patch_embed   Conv2d(3 -> D, k = s = P) + pos-emb grid [H0, W0, D] resized to (h, w)
                             + sin|cos time embedding when t > 1                          [N, D]
  vision_tower.encoder       blocks: x += wo(attn(rope(q), rope(k), v)) on norm0(x),
                             x += fc1(gelu_tanh(fc0(norm1(x)))); then final_layernorm      [N, D]
  merger (no weights)        mean over t, then 2x2 windows (0,0),(0,1),(1,0),(1,1)         [M, 4D]
  mm_projector               proj.0 Linear(4D, 4D) -> GELU(erf) -> proj.2 Linear(4D, text_hidden)
                             -> post_norm RMSNorm                                          [M, text_hidden]

Attention is bidirectional and restricted to each image (all t*h*w patches of one image see each other),
with scale head_dim^-0.5. ``wqkv`` output rows are [q | k | v], each heads x head_dim, head-major. Module
and parameter names equal the checkpoint keys under ``vision_tower.`` and ``mm_projector.``.

2-D RoPE (interleaved, non-neox, fp32): per head the D_h dims form D_h/2 complex pairs (dims 2p, 2p+1). For
j in [0, D_h/4), with w_j = theta^(-4j/D_h), pair 2j rotates by x*w_j (column) and pair 2j+1 by y*w_j (row),
so dims (4j, 4j+1) follow x and (4j+2, 4j+3) follow y. The checkpoint's ``wqkv`` rows are already in this
layout: never combine it with a rotate-half permutation.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.core.config import VisionConfig

Grid = tuple[int, int, int]


def rope_2d_cos_sin(h: int, w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the rotation angles, each [h*w, head_dim/2] fp32, row-major over the patch grid."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                            indexing="ij")
    x_ang = xs.reshape(-1, 1) * freqs
    y_ang = ys.reshape(-1, 1) * freqs
    # pairs interleave as (x_0, y_0, x_1, y_1, ...)
    angles = torch.stack([x_ang, y_ang], dim=-1).flatten(1)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [N, H, D_h] by the angles of ``rope_2d_cos_sin`` [N, D_h/2], in fp32."""
    xf = x.float().unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2)
    return out.to(x.dtype)


def resize_pos_grid(weight: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[H0, W0, D] -> [h*w, D]: bilinear, align_corners=False; the grid itself when (h, w) = (H0, W0)."""
    if (h, w) == tuple(weight.shape[:2]):
        return weight.flatten(0, 1)
    grid = weight.to(torch.promote_types(weight.dtype, torch.float32)).permute(2, 0, 1).unsqueeze(0)
    grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False)
    return grid.squeeze(0).permute(1, 2, 0).flatten(0, 1).to(weight.dtype)


def time_sincos(t: int, dim: int) -> torch.Tensor:
    """Fixed [t, dim] table for frames 0..t-1: sin(f*w_i) then cos(f*w_i), w_i = 10000^(-i/(dim/2))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim / 2))
    ang = torch.arange(t, dtype=torch.float32).unsqueeze(1) * omega
    return torch.cat([ang.sin(), ang.cos()], dim=1)


def vision_norm(dim: int) -> nn.RMSNorm:
    # The engines build nn.RMSNorm(dim) without eps, which resolves to float32's eps for fp32/bf16/fp16
    # inputs alike (model.md §11.3); spelled out so no torch version can pick bf16's eps instead.
    return nn.RMSNorm(dim, eps=torch.finfo(torch.float32).eps)


def parse_grid_thw(grid_thw: torch.Tensor | Sequence[Sequence[int]], cfg: VisionConfig) -> list[Grid]:
    """``grid_thw`` as a list of (t, h, w), checked against what the tower can encode."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(r) for r in grid_thw]
    if not rows or any(len(r) != 3 for r in rows):
        raise ValueError(f"grid_thw: expected a non-empty [n_images, 3] table, got {rows!r}")
    kh, kw = cfg.merge_kernel_size
    grids: list[Grid] = []
    for i, (t, h, w) in enumerate(rows):
        if not all(isinstance(v, Integral) and not isinstance(v, bool) and v > 0 for v in (t, h, w)):
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: t, h, w must be positive integers")
        if h % kh or w % kw:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h, w must be multiples of the merge kernel {kh}x{kw}")
        if t > cfg.pos_emb_time:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: t exceeds the time-embedding table ({cfg.pos_emb_time})")
        grids.append((int(t), int(h), int(w)))
    return grids


class PosEmbedding(nn.Module):
    """Learned [H0, W0, D] grid, bilinear-resized per image, plus a fixed time table for t > 1."""

    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(height, width, dim))

    def forward(self, x: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        parts = []
        for t, h, w in grids:
            pos = resize_pos_grid(self.weight, h, w)
            if t > 1:
                pos = (pos.unsqueeze(0) + time_sincos(t, pos.shape[-1]).to(pos).unsqueeze(1)).flatten(0, 1)
            parts.append(pos)
        return x + torch.cat(parts).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = PosEmbedding(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        x = self.proj(pixels.to(self.proj.weight.dtype)).flatten(1)
        return self.pos_emb(x, grids)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


def image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Bidirectional attention inside each [start, end) span of the packed sequence. q, k, v: [N, H, D_h]."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    for s, e in bounds:
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                           v[s:e].transpose(0, 1), scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.norm0 = vision_norm(cfg.hidden_size)
        self.norm1 = vision_norm(cfg.hidden_size)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(cfg.qkv_hidden_size, cfg.hidden_size, bias=False)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bounds: list[tuple[int, int]]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        x = x + self.wo(image_attention(q, k, v, bounds).flatten(1))
        return x + self.mlp(self.norm1(x))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = vision_norm(cfg.hidden_size)

    def forward(self, x: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        cos_parts, sin_parts, bounds = [], [], []
        start = 0
        for t, h, w in grids:
            cos, sin = rope_2d_cos_sin(h, w, self.head_dim, self.rope_theta)
            # every frame of a video reuses the same spatial rotation
            cos_parts.append(cos.repeat(t, 1))
            sin_parts.append(sin.repeat(t, 1))
            bounds.append((start, start + t * h * w))
            start += t * h * w
        cos = torch.cat(cos_parts).to(x.device)
        sin = torch.cat(sin_parts).to(x.device)
        for block in self.blocks:
            x = block(x, cos, sin, bounds)
        return self.final_layernorm(x)


def merge_patches(x: torch.Tensor, grids: list[Grid], kernel: tuple[int, int]) -> torch.Tensor:
    """[N, D] -> [sum h*w/(kh*kw), kh*kw*D]: mean over frames, then each kh x kw window in row-major order."""
    kh, kw = kernel
    d = x.shape[-1]
    out, start = [], 0
    for t, h, w in grids:
        seq = x[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, d)
        out.append(seq.permute(0, 1, 3, 2, 4, 5).mean(dim=0).reshape(-1, kh * kw * d))
        start += t * h * w
    return torch.cat(out)


class MoonViT(nn.Module):
    """``vision_tower``: pixel patches -> merged patch features [M, 4D] (before the projector)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionTransformer(cfg)

    def forward(self, pixel_patches: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = parse_grid_thw(grid_thw, self.cfg)
        p = self.cfg.patch_size
        if pixel_patches.dim() != 4 or tuple(pixel_patches.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_patches: expected [N, 3, {p}, {p}], got {list(pixel_patches.shape)}")
        n = sum(t * h * w for t, h, w in grids)
        if pixel_patches.shape[0] != n:
            raise ValueError(f"pixel_patches: grid_thw describes {n} patches but {pixel_patches.shape[0]} were given")
        x = self.encoder(self.patch_embed(pixel_patches, grids), grids)
        return merge_patches(x, grids, self.cfg.merge_kernel_size)


class PatchMergerProjector(nn.Module):
    """``mm_projector`` (patchmergerv2): [M, 4D] -> [M, text_hidden]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            nn.Linear(cfg.merged_dim, cfg.merged_dim, bias=False),
            nn.GELU(),  # exact (erf) GELU here, unlike the tower's tanh form
            nn.Linear(cfg.merged_dim, cfg.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))


class VisionEncoder(nn.Module):
    """Tower + projector; ``state_dict()`` keys are exactly the checkpoint's ``vision_tower.*``/``mm_projector.*``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = MoonViT(cfg)
        self.mm_projector = PatchMergerProjector(cfg)

    def forward(self, pixel_patches: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        return self.mm_projector(self.vision_tower(pixel_patches, grid_thw))
