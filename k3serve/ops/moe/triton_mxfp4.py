"""Routed-expert combine over MXFP4 experts as two grouped Triton GEMMs, the gated activation fused into the
first (backend "triton" of op "mxfp4_expert_combine"; spec: ``naive_mxfp4_expert_combine``).

Shapes as in ``naive.py``: u ``[N, D]``, weights / ids ``[N, k]``, w13 codes ``[E, 2I, D/2]`` + E8M0 scales
``[E, 2I, D/32]`` (gate rows then up rows), w2 codes ``[E, D_out, I/2]`` + scales ``[E, D_out, I/32]``.

  order = the N·k (token, slot) assignments sorted by expert (stable); rows of one expert form a run
  tiles: each run is cut into tiles of BLOCK_M rows, computed on the device (no host sync, so the launch can
         be captured in a CUDA graph): a fixed grid of min(N·k, ceil(N·k / BLOCK_M) + E) tiles, the unused
         ones empty
  kernel 1 (grid tiles × I/BLOCK_N):  a = act(x W1_e^T, x W3_e^T)   ``[N·k, I]``, x the tile's tokens gathered
  kernel 2 (grid tiles × D_out/BLOCK_N):  y = a W2_e^T   ``[N·k, D_out]``
  out = Σ_k w_k · y[assignment token·k + slot]   ``[N, D_out]`` fp32, slots summed in order (as ``grouped.py``)

Weights stay packed: each K step loads a ``[BLOCK_N, BLOCK_K/2]`` tile of code bytes and the scale byte of
every 32 elements, decodes E2M1 · 2^(s-127) in registers and multiplies the even and odd columns of x by the
low and high nibbles (two dots, no interleave). GEMMs take bfloat16 operands for bfloat16 u (every decoded
weight is exact in bfloat16), else float32 at IEEE precision (no TF32); both accumulate in fp32. The
activation runs in fp32 on the fp32 accumulators. ``act_quant`` fake-quantises u and a to MXFP8 in torch
between the launches, as the torch form does. Runs on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3serve.ops.activation import GatedActivation
from k3serve.ops.mx.naive import BLOCK
from k3serve.ops.mx.quant import mxfp8_fake_quant

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
_ACT = {"silu": 0, "situ": 1}


@triton.jit
def _e2m1(code):
    """int32 E2M1 codes (sign bit 3, magnitude 0..7) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6."""
    mag = code & 7
    ex = mag >> 1
    man = (mag & 1).to(tl.float32)
    val = tl.where(ex == 0, 0.5 * man, tl.exp2((ex - 1).to(tl.float32)) * (1.0 + 0.5 * man))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def _weight_tile(p_ptr, s_ptr, rows, rmask, kh, kmask, half_k, k_blocks, DTYPE: tl.constexpr):
    """Rows ``rows`` (int64 absolute) of a packed matrix at packed columns ``kh``: the weights of elements
    2·kh (low nibble) and 2·kh + 1 (high nibble), each ``[BLOCK_N, BLOCK_K/2]`` in DTYPE."""
    mask = rmask[:, None] & kmask[None, :]
    byte = tl.load(p_ptr + rows[:, None] * half_k + kh[None, :], mask=mask, other=0).to(tl.int32)
    sb = tl.load(s_ptr + rows[:, None] * k_blocks + (kh // 16)[None, :], mask=mask, other=127).to(tl.int32)
    scale = tl.exp2((sb - 127).to(tl.float32))
    scale = tl.where(sb == 255, float("nan"), scale)  # E8M0 0xFF is NaN
    return (_e2m1(byte & 15) * scale).to(DTYPE), (_e2m1(byte >> 4) * scale).to(DTYPE)


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x w^T; IEEE: in fp32 at full precision (fp32 operands, or bf16 ones under the interpreter, whose
    bf16 dot is wrong; bf16 values are exact in fp32, so the result is the same)."""
    if IEEE:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _tanh(x):
    # exp form; |x| > 15 is ±1 in fp32 already, clamped so exp never overflows
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _gate_up_kernel(x_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr, wp_ptr, ws_ptr, a_ptr,
                    D, I, BETA, LIN_BETA,
                    ACT: tl.constexpr, HAS_LIN: tl.constexpr, IEEE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    lo = tl.load(tile_lo_ptr + t)
    hi = tl.load(tile_hi_ptr + t)
    r = lo + tl.arange(0, BM)
    rmask = r < hi
    tok = tl.load(tok_ptr + r, mask=rmask, other=0).to(tl.int64)
    n = pn * BN + tl.arange(0, BN)
    nmask = n < I
    gate_rows = e * 2 * I + n
    up_rows = gate_rows + I
    half_k = D // 2
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    # an empty tile runs no K steps (the loop bound is data, so the grid stays fixed)
    steps = tl.where(hi > lo, tl.cdiv(half_k, BK // 2), 0)
    for s in range(0, steps):
        kh = s * (BK // 2) + tl.arange(0, BK // 2)
        kmask = kh < half_k
        xm = rmask[:, None] & kmask[None, :]
        x_even = tl.load(x_ptr + tok[:, None] * D + 2 * kh[None, :], mask=xm, other=0.0)
        x_odd = tl.load(x_ptr + tok[:, None] * D + 2 * kh[None, :] + 1, mask=xm, other=0.0)
        g_lo, g_hi = _weight_tile(wp_ptr, ws_ptr, gate_rows, nmask, kh, kmask, half_k, D // 32, x_even.dtype)
        acc_g = _dot(x_odd, g_hi, _dot(x_even, g_lo, acc_g, IEEE), IEEE)
        u_lo, u_hi = _weight_tile(wp_ptr, ws_ptr, up_rows, nmask, kh, kmask, half_k, D // 32, x_even.dtype)
        acc_u = _dot(x_odd, u_hi, _dot(x_even, u_lo, acc_u, IEEE), IEEE)
    sig = tl.sigmoid(acc_g)
    if ACT == 0:
        act = acc_g * sig * acc_u
    else:
        up = acc_u
        if HAS_LIN:
            up = LIN_BETA * _tanh(acc_u / LIN_BETA)
        act = BETA * _tanh(acc_g / BETA) * sig * up
    out = a_ptr + r[:, None].to(tl.int64) * I + n[None, :]
    tl.store(out, act.to(a_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(a_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr, wp_ptr, ws_ptr, y_ptr, I, D_OUT,
                 IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    lo = tl.load(tile_lo_ptr + t)
    hi = tl.load(tile_hi_ptr + t)
    r = lo + tl.arange(0, BM)
    rmask = r < hi
    rows64 = r.to(tl.int64)
    n = pn * BN + tl.arange(0, BN)
    nmask = n < D_OUT
    w_rows = e * D_OUT + n
    half_k = I // 2
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    steps = tl.where(hi > lo, tl.cdiv(half_k, BK // 2), 0)
    for s in range(0, steps):
        kh = s * (BK // 2) + tl.arange(0, BK // 2)
        kmask = kh < half_k
        am = rmask[:, None] & kmask[None, :]
        a_even = tl.load(a_ptr + rows64[:, None] * I + 2 * kh[None, :], mask=am, other=0.0)
        a_odd = tl.load(a_ptr + rows64[:, None] * I + 2 * kh[None, :] + 1, mask=am, other=0.0)
        w_lo, w_hi = _weight_tile(wp_ptr, ws_ptr, w_rows, nmask, kh, kmask, half_k, I // 32, a_even.dtype)
        acc = _dot(a_odd, w_hi, _dot(a_even, w_lo, acc, IEEE), IEEE)
    out = y_ptr + rows64[:, None] * D_OUT + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def expert_tiles(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """ids ``[N, k]`` -> (order ``[N·k]`` assignments sorted by expert, tile expert / first row / end row
    ``[tiles]``), all computed on ids' device. A tile covers up to ``block_m`` rows of one expert's run; the
    grid has a fixed ``min(N·k, ceil(N·k / block_m) + E)`` tiles (each used tile holds at least one row, and
    cutting E runs adds at most E partial tiles); unused tiles are empty (first row == end row)."""
    flat = ids.reshape(-1)
    rows = flat.numel()
    order = flat.argsort(stable=True)
    # not bincount: on CUDA it reads the largest id back to size its output, which a captured graph cannot do
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = counts.cumsum(0) - counts
    per_expert = (counts + block_m - 1) // block_m
    tile_end = per_expert.cumsum(0)
    num_tiles = max(1, min(rows, -(-rows // block_m) + num_experts))
    t = torch.arange(num_tiles, device=ids.device)
    e = torch.searchsorted(tile_end, t, right=True)
    used = e < num_experts
    ec = e.clamp(max=num_experts - 1)
    lo = starts[ec] + (t - (tile_end[ec] - per_expert[ec])) * block_m
    hi = torch.minimum(lo + block_m, starts[ec] + counts[ec])
    zero = torch.zeros_like(lo)
    return (order, ec.to(torch.int32), torch.where(used, lo, zero).to(torch.int32),
            torch.where(used, hi, zero).to(torch.int32))


def _check(u: torch.Tensor, w13_packed: torch.Tensor, w2_packed: torch.Tensor, glu: object) -> None:
    if not isinstance(glu, GatedActivation):
        raise ValueError(f"the triton expert combine fuses a GatedActivation, got {type(glu).__name__}")
    D, I = w13_packed.shape[2] * 2, w2_packed.shape[2] * 2
    if D % BLOCK or I % BLOCK or w13_packed.shape[1] != 2 * I or u.shape[-1] != D:
        raise ValueError(f"MXFP4 experts need u [N, D] and widths D, I multiples of {BLOCK}, got u "
                         f"{tuple(u.shape)}, w13 {tuple(w13_packed.shape)}, w2 {tuple(w2_packed.shape)}")


def triton_mxfp4_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13_packed: torch.Tensor,
                                w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                                glu: GatedActivation, *, act_quant: str | None = None,
                                block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                                block_k: int = BLOCK_K) -> torch.Tensor:
    _check(u, w13_packed, w2_packed, glu)
    N, k = ids.shape
    E, D, I, D_out = w13_packed.shape[0], u.shape[1], w2_packed.shape[2] * 2, w2_packed.shape[1]
    compute = torch.bfloat16 if u.dtype == torch.bfloat16 else torch.float32
    ieee = compute == torch.float32 or not u.is_cuda
    if act_quant is not None:  # row-wise blocks of 32: quantising u once equals quantising each gathered row
        u = mxfp8_fake_quant(u, act_quant)
    x = u.to(compute).contiguous()
    order, tile_e, tile_lo, tile_hi = expert_tiles(ids, E, block_m)
    tok = order.div(k, rounding_mode="floor").to(torch.int32)
    tiles = tile_e.numel()
    a = torch.empty(N * k, I, dtype=compute, device=u.device)
    lin = glu.linear_beta
    _gate_up_kernel[(tiles, triton.cdiv(I, block_n))](
        x, tok, tile_e, tile_lo, tile_hi, w13_packed.contiguous(), w13_scale.contiguous(), a, D, I,
        float(glu.beta), float(lin if lin is not None else 1.0), ACT=_ACT[glu.name], HAS_LIN=lin is not None,
        IEEE=ieee, BM=block_m, BN=block_n, BK=block_k)
    if act_quant is not None:
        a = mxfp8_fake_quant(a, act_quant)
    y = torch.empty(N * k, D_out, dtype=compute, device=u.device)
    _down_kernel[(tiles, triton.cdiv(D_out, block_n))](
        a, tile_e, tile_lo, tile_hi, w2_packed.contiguous(), w2_scale.contiguous(), y, I, D_out,
        IEEE=ieee, BM=block_m, BN=block_n, BK=block_k)
    # back to (token, slot) order: sorted row j holds assignment order[j]
    picked = torch.empty(N * k, D_out, dtype=torch.float32, device=u.device).index_copy_(0, order, y.float())
    picked.mul_(weights.reshape(-1, 1).float())
    return picked.view(N, k, -1).sum(1)


def accepts(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13_packed: torch.Tensor, *args,
            **kwargs) -> bool:
    """CUDA tensors and an activation the kernel knows (``GatedActivation``); CPU calls never come here."""
    glu = args[3] if len(args) > 3 else kwargs.get("glu")
    return u.is_cuda and w13_packed.is_cuda and isinstance(glu, GatedActivation)
