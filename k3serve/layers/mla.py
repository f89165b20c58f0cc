"""Multi-head Latent Attention without RoPE (NoPE), with optional q-LoRA and K3's sigmoid output gate.

x ``[N, d]`` packed tokens of the active ``ForwardContext``:
  q = W_qb · RMSNorm(W_qa x)  (q-LoRA, K3)  or  W_q x  (Kimi-Linear)      ``[N, H, Dn + R]``
  [c̃ | k_rot] = W_kva x;  c = RMSNorm(c̃)                                   ``[N, C + R]`` -> paged cache
  o = attention over the cached latents   ``[N, H, Dv]``: absorbed (batched) for every sequence that adds one
      token to a cached context and every token of a speculative verify row, expanded (per sequence) for
      prefill chunks
  K3: o <- o ⊙ sigmoid(W_g x)   (gate from the layer *input*)
  out = W_o o
The latent norms use eps 1e-6 as in the official code (engines use rms_norm_eps; negligible).
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.context import ForwardContext
from k3serve.layers.norm import KimiRMSNorm
from k3serve.ops import mla as mla_ops
from k3serve.ops import registry

LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        d, H = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = self.qk_dim ** -0.5
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiRMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)
        self.g_proj = nn.Linear(d, H * self.v_dim, bias=False) if cfg.mla_use_output_gate else None

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
        N = x.shape[0]
        q, latents = self.queries(x), self.latents(x)
        cache = ctx.caches.mla[self.layer_idx]
        mla_ops.write_latents(cache, ctx.slot_mapping, latents)

        if ctx.is_decode:
            o = self._decode(q, cache, ctx, ctx.block_tables, ctx.context_lens_tensor, max(ctx.context_lens))
        else:
            o = self._prefill(q, latents, cache, ctx)
        o = o.reshape(N, self.num_heads * self.v_dim).to(x.dtype)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext, block_tables: torch.Tensor,
                context_lens: torch.Tensor, max_len: int) -> torch.Tensor:
        """Absorbed attention for one new token per row: q ``[b, H, Dn + R]`` -> ``[b, H, Dv]``."""
        decode = registry.pick("mla_decode", q, cache, block_tables, context_lens, self.kv_b_proj.weight)
        dims = dict(nope_dim=self.nope_dim, v_dim=self.v_dim, scale=self.scale)
        if getattr(decode, "reads_cache_in_place", False):  # no gather: it needs no workspace or chunk plan
            return decode(q, cache, block_tables, context_lens, self.kv_b_proj.weight, **dims)
        need = mla_ops.decode_workspace_numel(max_len, cache.shape[1], cache.shape[2])
        work = ctx.caches.workspace("mla_latents", need, cache.dtype, cache.device)
        # the chunk plan depends only on the step's tables and lengths: the MLA layers of a step share it
        key = ("mla_decode_plan", ctx.is_decode, cache.shape[1], cache.shape[2])
        plan = ctx.step_memo.get(key)
        if plan is None:
            plan = ctx.step_memo[key] = mla_ops.plan_decode(block_tables, context_lens, cache.shape[1], cache.shape[2])
        return decode(q, cache, block_tables, context_lens, self.kv_b_proj.weight, workspace=work, plan=plan, **dims)

    def _prefill(self, q: torch.Tensor, latents: torch.Tensor, cache: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        """A step of fresh prompts goes to the packed prefill op in one call. Otherwise (a mixed step) its
        decode rows (one token after a cached context) and every token of its speculative verify rows
        (``ctx.spec.rows``; token j of row i attends to ``cached_lens[i] + j + 1`` latents, its causal prefix)
        share one batched absorbed decode call, as decoding them one by one would; the other sequences are
        expanded and attended one at a time."""
        dims = dict(nope_dim=self.nope_dim, v_dim=self.v_dim, scale=self.scale)
        rows = ctx.decode_rows
        verify = ctx.spec.rows if ctx.spec is not None else []
        if not rows and not verify and all(c == 0 for c in ctx.cached_lens):  # fresh prompts only: one call
            return registry.get("mla_prefill_packed")(q, latents, ctx.cu_seqlens, self.kv_b_proj.weight, **dims)
        o = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        cu = ctx.host_cu_seqlens
        skip = set(rows) | set(verify)
        if skip:
            # (token, row, context length) of each decode-like query
            queries = [(cu[i] + j, i, ctx.cached_lens[i] + j + 1) for i in sorted(skip) for j in range(ctx.seq_lens[i])]
            tokens = torch.tensor([t for t, _, _ in queries], device=q.device)
            r = torch.tensor([i for _, i, _ in queries], device=q.device)
            lens = torch.tensor([n for _, _, n in queries], dtype=torch.long, device=q.device)
            o[tokens] = self._decode(q.index_select(0, tokens), cache, ctx, ctx.block_tables.index_select(0, r),
                                     lens, max(n for _, _, n in queries))
        prefill = registry.get("mla_prefill")
        for i, (start, n, total) in enumerate(zip(cu, ctx.seq_lens, ctx.context_lens)):
            if i in skip:
                continue
            if n == total:  # nothing cached before: the new latents are the whole context
                lat = latents[start:start + n]
            else:
                lat = mla_ops.gather_latents(cache, ctx.block_tables[i], total)
            o[start:start + n] = prefill(q[start:start + n], lat, self.kv_b_proj.weight, **dims)
        return o
