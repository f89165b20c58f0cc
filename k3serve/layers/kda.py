"""Kimi Delta Attention layer (both flavours) over packed variable-length batches.

x ``[N, d]`` packed tokens of the active ``ForwardContext``:
  q, k, v = W_{q,k,v} x                     ``[N, P]``, P = H·K
  short causal conv (kernel W) + SiLU on q|k|v, carried in ``kda_conv[layer]`` ``[slots, 3P, W-1]``
  q, k <- L2-normalised per head (fp32, eps inside the sqrt)
  g (log decay, fp32) ``[N, H, K]``:
      Kimi-Linear: ``-exp(A_log_h) · softplus(f + dt_bias)``,            f = W_fb W_fa x
      K3:          ``lower_bound · sigmoid(exp(A_log_h) · (f + dt_bias))``
  beta = sigmoid(W_b x) ``[N, H]``
  delta-rule recurrence (ops ``kda_chunk`` / ``kda_decode``), state ``kda_state[layer]`` ``[slots, H, K, V]``;
  a decode step runs conv, norms, gate, beta and recurrence as one op, ``kda_decode_step``
  out = W_o · GatedRMSNorm(o, z); z = W_g x (K3, full rank) or W_gb W_ga x (Kimi-Linear)
In small layers the projections of x (q, k, v, f_a, b and g or g_a) run as one GEMM over their concatenated
weights; the modules keep their own (checkpoint) parameters. States are updated in place in the pool when the engine has
put the batch's slots at the leading rows (``ForwardContext.leading_state_rows``).

Tensor parallel (``par``): each rank holds H/tp heads: q, k, v, g, b, f_b column-parallel, the conv channels,
dt_bias and A_log of its heads, its ``[slots, H/tp, K, V]`` state and ``[slots, 3P/tp, W-1]`` conv state
(q|k|v of its heads); f_a, g_a and o_norm replicated; o_proj row-parallel. Each held piece runs the whole
head computation on its own (a rank's GEMMs), its o_proj partials summed in piece order (``core.distributed``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.context import ForwardContext
from k3serve.core.distributed import SINGLE, Parallel
from k3serve.layers.norm import GatedRMSNorm
from k3serve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, shard_slot
from k3serve.layers.weights import ConcatCache, WeightSlot, a_log_heads, a_log_slot, keep_fp32
from k3serve.ops import registry
from k3serve.ops.kda import kda_gate, l2_normalize  # noqa: F401  (kda_gate: re-exported for callers)
from k3serve.ops.kda.step import L2_EPS

# Projection weights up to this size run as one fused GEMM over a concatenated copy (see ConcatCache).
FUSE_MAX_BYTES = 16 << 20


def _store(cache: torch.Tensor, rows: slice | None, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Write the batch's new states ``[B, ...]`` to the pool (a no-op when they were updated there in place)."""
    if rows is None:
        cache.index_copy_(0, slots, new)
    elif new.data_ptr() != cache[rows].data_ptr():
        cache[rows].copy_(new)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, *, model_type: str = "kimi_linear", par: Parallel = SINGLE):
        super().__init__()
        la = cfg.linear_attn
        d, H, K, P, W = cfg.hidden_size, la.num_heads, la.head_dim, la.proj_size, la.conv_kernel_size
        h0, h1 = par.held(H)
        Hh = h1 - h0  # heads this rank holds
        self.par, self.total_heads, self.head_start = par, H, h0
        self.layer_idx, self.num_heads, self.head_dim, self.conv_size = layer_idx, Hh, K, W
        self.lower_bound = la.gate_lower_bound
        self.full_rank_gate = la.use_full_rank_gate
        # K3 stores A_log as [head_dim] (first H live); Kimi-Linear as [1, 1, H, 1].
        self.a_log_layout = "k3" if model_type == "kimi_k3" else "kimi_linear"
        self.q_proj = ColumnParallelLinear(d, P, par)
        self.k_proj = ColumnParallelLinear(d, P, par)
        self.v_proj = ColumnParallelLinear(d, P, par)
        Ph = Hh * K
        self.q_conv1d = nn.Conv1d(Ph, Ph, W, groups=Ph, bias=False, dtype=torch.float32)
        self.k_conv1d = nn.Conv1d(Ph, Ph, W, groups=Ph, bias=False, dtype=torch.float32)
        self.v_conv1d = nn.Conv1d(Ph, Ph, W, groups=Ph, bias=False, dtype=torch.float32)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = ColumnParallelLinear(K, P, par)
        self.dt_bias = keep_fp32(nn.Parameter(torch.zeros(Ph, dtype=torch.float32)))
        self.A_log = keep_fp32(nn.Parameter(torch.zeros(Hh, dtype=torch.float32)))
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            keep_fp32(conv.weight)
        self.b_proj = ColumnParallelLinear(d, H, par)
        if self.full_rank_gate:
            self.g_proj = ColumnParallelLinear(d, P, par)
        else:
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = ColumnParallelLinear(K, P, par)
        self.o_norm = GatedRMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = RowParallelLinear(P, d, par)
        # The held heads in pieces (one per rank in a TP run).
        self.head_pieces = par.pieces_of(H)
        Hl = Hh // len(self.head_pieces)
        # Small layers run the projections of x as one GEMM over their concatenated weights (built on first
        # use, kept in sync by ConcatCache), one per piece; output columns [q|k|v, f_a, b, gate]. The conv
        # filters likewise.
        self._in_weights = [ConcatCache(FUSE_MAX_BYTES) for _ in self.head_pieces]
        self._conv_weights = [ConcatCache(FUSE_MAX_BYTES) for _ in self.head_pieces]
        self._in_weight, self._conv_weight = self._in_weights[0], self._conv_weights[0]
        self._in_split = [3 * Hl * K, K, Hl, Hl * K if self.full_rank_gate else K]

    def _project(self, x: torch.Tensor, p: int = 0) -> list[torch.Tensor]:
        """[q|k|v ``[N, 3P]``, f_a ``[N, K]``, b ``[N, H]``, gate ``[N, P or K]``] of x for piece ``p``'s heads."""
        gate = self.g_proj.piece_weight(p) if self.full_rank_gate else self.g_a_proj.weight
        ws = [self.q_proj.piece_weight(p), self.k_proj.piece_weight(p), self.v_proj.piece_weight(p),
              self.f_a_proj.weight, self.b_proj.piece_weight(p), gate]
        fused = self._in_weights[p](ws)
        if fused is not None:
            return list(F.linear(x, fused).split(self._in_split, dim=-1))
        return [torch.cat([F.linear(x, w) for w in ws[:3]], dim=-1)] + [F.linear(x, w) for w in ws[3:]]

    def _conv_filters(self, p: int = 0) -> torch.Tensor:
        """The q|k|v depthwise filters ``[3P, W]`` of piece ``p``'s heads."""
        convs = [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        if len(self.head_pieces) > 1:
            ch = slice(self.head_pieces[p].start * self.head_dim, self.head_pieces[p].stop * self.head_dim)
            convs = [c[ch] for c in convs]
        fused = self._conv_weights[p](convs)
        return (fused if fused is not None else torch.cat(convs))[:, 0]

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Per-slot cache shapes of the held heads; ``None`` dtype means the model dtype."""
        H, K, P = self.num_heads, self.head_dim, self.num_heads * self.head_dim
        return {"kda_state": ((H, K, K), torch.float32), "kda_conv": ((3 * P, self.conv_size - 1), None)}

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        # A_log is the only tensor whose stored shape differs from ours; the rest load by name, or as shards.
        H, K = self.total_heads, self.head_dim
        if self.num_heads == H:
            return [a_log_slot(prefix + "A_log", self.A_log, K, self.a_log_layout)]
        c0, P, W = self.head_start * K, H * K, self.conv_size
        return [shard_slot(prefix + "A_log", self.A_log, (H,), 0, self.head_start, accept=lambda t: a_log_heads(t, H)),
                shard_slot(prefix + "dt_bias", self.dt_bias, (P,), 0, c0),
                *(shard_slot(f"{prefix}{n}.weight", getattr(self, n).weight, (P, 1, W), 0, c0)
                  for n in ("q_conv1d", "k_conv1d", "v_conv1d"))]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        slots = ctx.state_slots
        # States are read and written in place when the batch owns the leading pool rows (the engine arranges
        # that), else gathered once and written back once. Not under autograd, which may keep what it read.
        rows = None if torch.is_grad_enabled() else ctx.leading_state_rows
        conv_cache = ctx.caches.kda_conv[self.layer_idx]
        conv_state = conv_cache[rows] if rows is not None else conv_cache.index_select(0, slots)
        state_cache = ctx.caches.kda_state[self.layer_idx]
        state = state_cache[rows] if rows is not None else state_cache.index_select(0, slots)
        K, P = self.head_dim, self.num_heads * self.head_dim
        if len(self.head_pieces) == 1:
            parts = [self._heads(x, ctx, 0, conv_state, state)]
        else:  # each piece on its own copy of its heads' states (its q|k|v conv channels), as a rank holds them
            if ctx.spec is not None:  # the rollback keeps one record per layer
                raise ValueError("speculative decoding runs with one piece per rank (ParallelLayout.pieces 1)")
            parts = []
            for p, hs in enumerate(self.head_pieces):
                ch = torch.cat([torch.arange(hs.start * K, hs.stop * K, device=x.device) + j * P for j in range(3)])
                cs, st = conv_state[:, ch], state[:, hs].contiguous()
                parts.append(self._heads(x, ctx, p, cs, st))
                conv_state[:, ch] = cs
                state[:, hs] = st
        _store(conv_cache, rows, slots, conv_state)
        _store(state_cache, rows, slots, state)
        return self.o_proj.reduce(parts)

    def _heads(self, x: torch.Tensor, ctx: ForwardContext, p: int, conv_state: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
        """Piece ``p``'s heads: its o_proj partial ``[N, d]``; its ``conv_state``/``state`` ``[B, ...]`` updated
        in place."""
        N, K = x.shape[0], self.head_dim
        hs = self.head_pieces[p]
        H = hs.stop - hs.start
        one = len(self.head_pieces) == 1
        dt_bias = self.dt_bias if one else self.dt_bias[hs.start * K:hs.stop * K]
        a_log = self.A_log if one else self.A_log[hs]
        qkv, f, b, gate = self._project(x, p)
        conv_weight = self._conv_filters(p)
        f = F.linear(f, self.f_b_proj.piece_weight(p)).view(N, H, K)
        if ctx.spec is not None:  # dispatch by row kind (decode rows under the rollback), never by shape
            o = self._speculative(qkv, conv_weight, f, b, conv_state, state, ctx, dt_bias, a_log)
        elif ctx.is_decode:  # one op, states updated in place: on the pool rows themselves, or on the gathered copies
            o = registry.get("kda_decode_step")(qkv, conv_weight, conv_state, f, dt_bias, a_log, b, state,
                                                lower_bound=self.lower_bound, l2_eps=L2_EPS)
        else:
            o = self._chunk(qkv, conv_weight, f, b, conv_state, state, ctx.cu_seqlens, ~ctx.has_initial_state,
                            dt_bias, a_log)
        z = gate if self.full_rank_gate else F.linear(gate, self.g_b_proj.piece_weight(p))
        o = self.o_norm(o, z.view(N, H, K)).to(x.dtype)
        return self.o_proj.piece_partial(o.reshape(N, H * K), p)

    def _chunk(self, qkv: torch.Tensor, conv_weight: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
               conv_state: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor, fresh: torch.Tensor,
               dt_bias: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
        """The prefill path over packed sequences; ``conv_state``/``state`` ``[B, ...]`` updated in place."""
        N, H, K = f.shape
        if bool(fresh.any()):
            conv_state[fresh] = 0
            state[fresh] = 0
        qkv, new_conv = registry.get("short_conv")(qkv.float(), conv_weight, conv_state=conv_state,
                                                   cu_seqlens=cu_seqlens)
        conv_state.copy_(new_conv)
        # q and k are normalised together (same per-head math, half the ops); split, not sliced: under
        # autograd each slice's gradient is a zero-filled copy of the whole, a split's one concatenation
        qk, v = qkv.split([2 * H * K, H * K], dim=1)
        q, k = l2_normalize(qk.reshape(N, 2 * H, K), L2_EPS).split(H, dim=1)
        v = v.float().reshape(N, H, K)
        g = kda_gate(f, dt_bias, a_log, self.lower_bound)
        beta = torch.sigmoid(b.float())
        o, new_state = registry.get("kda_chunk")(q[None], k[None], v[None], g[None], beta[None],
                                                 initial_state=state, cu_seqlens=cu_seqlens)
        if new_state.data_ptr() != state.data_ptr():
            state.copy_(new_state)
        return o[0]

    def _speculative(self, qkv: torch.Tensor, conv_weight: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                     conv_state: torch.Tensor, state: torch.Tensor, ctx: ForwardContext, dt_bias: torch.Tensor,
                     a_log: torch.Tensor) -> torch.Tensor:
        """Decode rows (``ctx.spec.rows``, 1 + k tokens each) through ``spec.verify``; any other rows (prefill
        chunks) through the prefill path. States ``[B, ...]`` updated in place."""
        spec, op = ctx.spec, registry.get("kda_decode_step")

        def step(qkv_t, conv_t, f_t, b_t, state_t):  # noqa: ANN001, ANN202 - the decode step with this layer's weights
            return op(qkv_t, conv_weight, conv_t, f_t, dt_bias, a_log, b_t, state_t,
                      lower_bound=self.lower_bound, l2_eps=L2_EPS)

        B, cu = ctx.batch_size, ctx.host_cu_seqlens
        if len(spec.rows) == B:
            return spec.verify(self.layer_idx, step, qkv, f, b, conv_state, state)
        N, H, K = f.shape
        o = torch.empty(N, H, state.shape[-1], dtype=torch.float32, device=qkv.device)
        verify = set(spec.rows)
        other = [i for i in range(B) if i not in verify]
        for part in (spec.rows, other):
            if not part:
                continue
            idx = torch.tensor(part, device=qkv.device)
            tok = torch.tensor([t for i in part for t in range(cu[i], cu[i + 1])], device=qkv.device)
            cs, st = conv_state.index_select(0, idx), state.index_select(0, idx)
            args = (qkv.index_select(0, tok), conv_weight, f.index_select(0, tok), b.index_select(0, tok))
            if part is spec.rows:
                o[tok] = spec.verify(self.layer_idx, step, args[0], args[2], args[3], cs, st)
            else:
                lens = torch.tensor([0] + [cu[i + 1] - cu[i] for i in part], device=qkv.device)
                o[tok] = self._chunk(*args, cs, st, lens.cumsum(0), ~ctx.has_initial_state[idx], dt_bias, a_log)
            conv_state[idx], state[idx] = cs, st
        return o
