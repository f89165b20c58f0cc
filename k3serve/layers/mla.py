"""Multi-head Latent Attention without RoPE (NoPE), with optional q-LoRA and K3's sigmoid output gate.

x ``[N, d]`` packed tokens of the active ``ForwardContext``:
  q = W_qb · RMSNorm(W_qa x)  (q-LoRA, K3)  or  W_q x  (Kimi-Linear)      ``[N, H, Dn + R]``
  [c̃ | k_rot] = W_kva x;  c = RMSNorm(c̃)                                   ``[N, C + R]`` -> paged cache
  o = attention over the cached latents   ``[N, H, Dv]``: absorbed (batched) for every sequence that adds one
      token to a cached context and every token of a speculative verify row, expanded (per sequence) for
      prefill chunks; in a static decode step (``ForwardContext.static``) the fixed-shape masked form
  K3: o <- o ⊙ sigmoid(W_g x)   (gate from the layer *input*)
  out = W_o o
The latent norms use eps 1e-6 as in the official code (engines use rms_norm_eps; negligible).

Tensor parallel (``par``): heads split (q / q_b, kv_b, g column-parallel, o_proj row-parallel); q_a, kv_a and
their norms replicated, so every rank computes and caches the same latents: the latent cache is REPLICATED
on every TP rank (it does not shrink with tp). Each held piece attends over its own heads, its o_proj
partials summed in piece order (``core.distributed``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.context import ForwardContext
from k3serve.core.distributed import SINGLE, Parallel
from k3serve.layers.norm import KimiRMSNorm
from k3serve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from k3serve.ops import mla as mla_ops
from k3serve.ops import registry

LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, par: Parallel = SINGLE):
        super().__init__()
        d, H = cfg.hidden_size, cfg.num_attention_heads
        h0, h1 = par.held(H)
        self.layer_idx, self.num_heads, self.par = layer_idx, h1 - h0, par  # num_heads: the held heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = self.qk_dim ** -0.5
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d, H * self.qk_dim, par)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiRMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * self.qk_dim, par)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), par)
        self.o_proj = RowParallelLinear(H * self.v_dim, d, par)
        self.g_proj = ColumnParallelLinear(d, H * self.v_dim, par) if cfg.mla_use_output_gate else None
        self.head_pieces = par.pieces_of(H)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Per-token cache width (paged); ``None`` dtype means the model dtype."""
        return {"mla": ((self.kv_lora_rank + self.rope_dim,), None)}

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """q ``[N, H, Dn + R]`` of x ``[N, d]``."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.qk_dim)

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache holds per token ``[N, kv_lora_rank + R]``: the normed kv latent, then k_pe."""
        ckv = self.kv_a_proj_with_mqa(x)
        return torch.cat([self.kv_a_layernorm(ckv[:, : self.kv_lora_rank]), ckv[:, self.kv_lora_rank:]], -1)

    def keys(self, latents: torch.Tensor) -> torch.Tensor:
        """Expanded keys ``[N, H, Dn + R]`` of cached latents ``[N, C + R]`` (k_rot shared by all heads, NoPE):
        what the attention ops score against, for probes and training losses that need the scores."""
        N, C = latents.shape[0], self.kv_lora_rank
        k_nope = self.kv_b_proj(latents[:, :C]).view(N, self.num_heads, self.nope_dim + self.v_dim)[..., :self.nope_dim]
        return torch.cat([k_nope, latents[:, None, C:].expand(N, self.num_heads, self.rope_dim)], -1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        latents = self.latents(x)
        cache = ctx.caches.mla[self.layer_idx]
        mla_ops.write_latents(cache, ctx.slot_mapping, latents)
        if len(self.head_pieces) == 1:
            return self.o_proj.reduce([self._heads(x, self.queries(x), latents, cache, ctx, 0)])
        qa = self.q_a_layernorm(self.q_a_proj(x)) if hasattr(self, "q_a_proj") else x
        q_proj = self.q_b_proj if hasattr(self, "q_a_proj") else self.q_proj
        parts = [self._heads(x, F.linear(qa, q_proj.piece_weight(p)).view(x.shape[0], -1, self.qk_dim), latents,
                             cache, ctx, p) for p in range(len(self.head_pieces))]
        return self.o_proj.reduce(parts)

    def _heads(self, x: torch.Tensor, q: torch.Tensor, latents: torch.Tensor, cache: torch.Tensor,
               ctx: ForwardContext, p: int) -> torch.Tensor:
        """Piece ``p``'s heads (queries ``q`` ``[N, h, Dn + R]``) -> its o_proj partial ``[N, d]``."""
        N, h = x.shape[0], q.shape[1]
        kv_b = self.kv_b_proj.piece_weight(p)
        if ctx.static is not None:  # fixed-width tables, lengths as a mask: nothing read back (CUDA graphs)
            o = registry.get("mla_decode_static")(q, cache, ctx.block_tables, ctx.static.context_lens, kv_b,
                                                  nope_dim=self.nope_dim, v_dim=self.v_dim, scale=self.scale)
        elif ctx.is_decode:
            o = self._decode(q, cache, ctx, ctx.block_tables, ctx.context_lens_tensor, max(ctx.context_lens), kv_b)
        else:
            o = self._prefill(q, latents, cache, ctx, kv_b)
        o = o.reshape(N, h * self.v_dim).to(x.dtype)
        if self.g_proj is not None:
            o = o * torch.sigmoid(F.linear(x, self.g_proj.piece_weight(p)))
        return self.o_proj.piece_partial(o, p)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext, block_tables: torch.Tensor,
                context_lens: torch.Tensor, max_len: int, kv_b: torch.Tensor) -> torch.Tensor:
        """Absorbed attention for one new token per row: q ``[b, H, Dn + R]`` -> ``[b, H, Dv]``."""
        decode = registry.pick("mla_decode", q, cache, block_tables, context_lens, kv_b)
        dims = dict(nope_dim=self.nope_dim, v_dim=self.v_dim, scale=self.scale)
        if getattr(decode, "reads_cache_in_place", False):  # no gather: it needs no workspace or chunk plan
            return decode(q, cache, block_tables, context_lens, kv_b, **dims)
        need = mla_ops.decode_workspace_numel(max_len, cache.shape[1], cache.shape[2])
        work = ctx.caches.workspace("mla_latents", need, cache.dtype, cache.device)
        # the chunk plan depends only on the step's tables and lengths: the MLA layers of a step share it
        key = ("mla_decode_plan", ctx.is_decode, cache.shape[1], cache.shape[2])
        plan = ctx.step_memo.get(key)
        if plan is None:
            plan = ctx.step_memo[key] = mla_ops.plan_decode(block_tables, context_lens, cache.shape[1], cache.shape[2])
        return decode(q, cache, block_tables, context_lens, kv_b, workspace=work, plan=plan, **dims)

    def _prefill(self, q: torch.Tensor, latents: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext,
                 kv_b: torch.Tensor) -> torch.Tensor:
        """A step of fresh prompts goes to the packed prefill op in one call. Otherwise (a mixed step) its
        decode rows (one token after a cached context) and every token of its speculative verify rows
        (``ctx.spec.rows``; token j of row i attends to ``cached_lens[i] + j + 1`` latents, its causal prefix)
        share one batched absorbed decode call, as decoding them one by one would; the other sequences are
        expanded and attended one at a time."""
        dims = dict(nope_dim=self.nope_dim, v_dim=self.v_dim, scale=self.scale)
        rows = ctx.decode_rows
        verify = ctx.spec.rows if ctx.spec is not None else []
        if not rows and not verify and all(c == 0 for c in ctx.cached_lens):  # fresh prompts only: one call
            return registry.get("mla_prefill_packed")(q, latents, ctx.cu_seqlens, kv_b, **dims)
        o = q.new_empty(q.shape[0], q.shape[1], self.v_dim)
        cu = ctx.host_cu_seqlens
        skip = set(rows) | set(verify)
        if skip:
            # the decode-like queries' layout depends only on the step: its MLA layers share it
            key = ("mla_decode_queries", ctx.is_decode)
            layout = ctx.step_memo.get(key)
            if layout is None:
                layout = ctx.step_memo[key] = _decode_queries(ctx, sorted(skip), q.device)
            tokens, tables, lens, max_len = layout
            o[tokens] = self._decode(q.index_select(0, tokens), cache, ctx, tables, lens, max_len, kv_b)
        prefill = registry.get("mla_prefill")
        for i, (start, n, total) in enumerate(zip(cu, ctx.seq_lens, ctx.context_lens)):
            if i in skip:
                continue
            if n == total:  # nothing cached before: the new latents are the whole context
                lat = latents[start:start + n]
            else:
                lat = mla_ops.gather_latents(cache, ctx.block_tables[i], total)
            o[start:start + n] = prefill(q[start:start + n], lat, kv_b, **dims)
        return o


def _decode_queries(ctx: ForwardContext, rows: list[int], device: torch.device):
    """(token index, block table, context length) of each decode-like query of ``rows`` (token j of row i sees
    ``cached_lens[i] + j + 1`` latents), as device tensors, and the longest context."""
    cu = ctx.host_cu_seqlens
    queries = [(cu[i] + j, i, ctx.cached_lens[i] + j + 1) for i in rows for j in range(ctx.seq_lens[i])]
    tokens = torch.tensor([t for t, _, _ in queries], device=device)
    r = torch.tensor([i for _, i, _ in queries], device=device)
    lens = torch.tensor([n for _, _, n in queries], dtype=torch.long, device=device)
    return tokens, ctx.block_tables.index_select(0, r), lens, max(n for _, _, n in queries)
