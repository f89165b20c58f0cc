"""Training forms of the model's small fp32 element-wise ops, with hand-written backwards; each registered as
backend "train" of its op (same arguments and results as the "torch" forms in ``k3serve/ops/norm``,
``ops/attn_res`` and ``ops/activation``, whose ``naive.py`` forms are the spec).

Ops and shapes (any leading dims ``...``; the reductions run over the last dim d):
  rms_norm(x [..., d], w [d], eps)            y = w ⊙ x r,  r = (mean(x²) + eps)^-1/2
  gated_rms_norm(x, z [..., d], w [d], eps)   y = w ⊙ x r ⊙ sigmoid(z)
  attn_res_mix(blocks, partial, pw [1, d], nw [d], eps)   sources V_s [N, d] (S of them), q = nw ⊙ pw:
      p = softmax_s((V_s · q) r_s),  out = Σ_s p_s V_s
  situ_and_mul(gate, up [..., I], beta, linear_beta)   tanh written as 2 sigmoid(2x) - 1

Why: autograd through the spec's pow / mean / rsqrt / mul chains keeps every intermediate and runs a kernel per
link both ways; the backwards here are the few passes the gradients need (``dx = r (gw - n mean(gw ⊙ n))``
with ``n = x r``, ``gw = g ⊙ w``). ``torch.tanh`` on this CPU runs ~6x slower than ``torch.sigmoid`` per
element, so SiTU uses the identity (abs. error ~1e-7 β; the serving form keeps ``tanh``). (``einsum`` for the
weight gradients ran ~25x a multiply and a sum here.)
"""

from __future__ import annotations

import torch

from k3serve.ops import registry


def _rms_backward(g: torch.Tensor, n: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """dL/dx of ``n = x r`` given ``g = dL/dn``: ``r (g - n mean(g ⊙ n))``."""
    m = (g * n).mean(-1, keepdim=True)
    return torch.addcmul(g, n, m, value=-1.0).mul_(r)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        n = x * r
        ctx.save_for_backward(n, r, w)
        return w * n

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        n, r, w = ctx.saved_tensors
        dw = _rows(g * n).sum(0) if ctx.needs_input_grad[1] else None
        return _rms_backward(g * w, n, r), dw, None


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        n, s = x * r, torch.sigmoid(z)
        ctx.save_for_backward(n, r, w, s)
        return n * w * s

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        n, r, w, s = ctx.saved_tensors
        gs = g * s
        gn = g * n
        dw = _rows(gn * s).sum(0) if ctx.needs_input_grad[2] else None
        # d sigmoid(z) = s (1 - s): dz = g n w s (1 - s)
        dz = gn.mul_(w).mul_(s).mul_(1.0 - s)
        return _rms_backward(gs.mul_(w), n, r), dz, dw, None


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.float32 or weight.dtype != torch.float32:  # the fused form is fp32 only
        return registry.get("rms_norm", "torch")(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def gated_rms_norm_train(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.float32 or z.dtype != torch.float32 or weight.dtype != torch.float32:
        return registry.get("gated_rms_norm", "torch")(x, z, weight, eps)
    return _GatedRMSNorm.apply(x, z, weight, eps)


class _AttnResMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pw: torch.Tensor, nw: torch.Tensor, eps: float, *sources: torch.Tensor) -> torch.Tensor:
        v = torch.stack(sources)  # [S, N, d]
        q = nw * pw.reshape(-1)
        r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [S, N]
        dot = v @ q  # [S, N]
        p = torch.softmax(dot * r, dim=0)
        out = v[0] * p[0].unsqueeze(-1)
        for s in range(1, v.shape[0]):
            out.addcmul_(v[s], p[s].unsqueeze(-1))
        ctx.save_for_backward(v, q, r, dot, p, pw, nw)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        v, q, r, dot, p, pw, nw = ctx.saved_tensors
        S, N, d = v.shape
        dp = (v * g).sum(-1)  # [S, N]
        dz = p * (dp - (p * dp).sum(0, keepdim=True))
        ddot, coef = dz * r, dz * dot * r.pow(3) * (-1.0 / d)  # d/dV of (V·q) r: q r and -(V·q) r³ V / d
        dv = p.unsqueeze(-1) * g  # [S, N, d]
        dv.addcmul_(ddot.unsqueeze(-1), q).addcmul_(coef.unsqueeze(-1), v)
        dq = ddot.reshape(1, S * N) @ v.reshape(S * N, d)  # [1, d]
        return (dq * nw).reshape(pw.shape), (dq.reshape(-1) * pw.reshape(-1)), None, *dv.unbind(0)


def attn_res_mix_train(blocks: list[torch.Tensor], partial: torch.Tensor, proj_weight: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    sources = [*blocks, partial]
    if not blocks or any(t.dtype != torch.float32 for t in (*sources, proj_weight, norm_weight)):
        return registry.get("attn_res_mix", "torch")(blocks, partial, proj_weight, norm_weight, eps)
    return _AttnResMix.apply(proj_weight, norm_weight, eps, *sources)


def _tanh(x: torch.Tensor, beta: float) -> torch.Tensor:
    """``beta tanh(x / beta)`` as ``2 beta sigmoid(2 x / beta) - beta``."""
    return torch.sigmoid(x * (2.0 / beta)) * (2.0 * beta) - beta


def situ_and_mul_train(gate: torch.Tensor, up: torch.Tensor, beta: float = 1.0,
                       linear_beta: float | None = None) -> torch.Tensor:
    g, u = gate.float(), up.float()
    a = _tanh(g, beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = _tanh(u, linear_beta)
    return (a * u).to(gate.dtype)


registry.register("rms_norm", "train")(rms_norm_train)
registry.register("gated_rms_norm", "train")(gated_rms_norm_train)
registry.register("attn_res_mix", "train")(attn_res_mix_train)
registry.register("situ_and_mul", "train")(situ_and_mul_train)
