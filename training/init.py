"""How a training run starts its weights: the writer's random init, adjusted for training from scratch.

Options used by probes (``training/RESULTS.md``, "Who copies"): MLA projections at another std, and a
previous-token head in the first KDA layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3serve.layers.attn_res import AttnResWeights
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.mla import MLAttention
from k3serve.layers.moe import MoEGate
from k3serve.layers.norm import GatedRMSNorm, KimiRMSNorm
from k3serve.models.kimi import text_model
from k3serve.models.writer import init_random_


@torch.no_grad()
def init_for_training(model: nn.Module, seed: int, embed_std: float = 1.0, mla_init_std: float = 0.0,
                      prev_token_init: int = 0, split_residual: bool = False) -> None:
    """The writer's random init, with unit norms, uniform AttnRes mixing (zero pseudo-queries) and embedding
    rows of std ``embed_std``: with tied rows and a unit-RMS final norm (|h| ~ sqrt(d) = 8), a correct token
    must reach a logit well above log(V - |U|) ~ 12 (the zero rows' mass). Measured on a copy probe
    (k3-default body, random 12-token sequences repeated): rows at std 0.02 never left the plateau in 300
    steps, std 0.3 started copying at ~250 steps, std 1.0 at ~150."""
    init_random_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    emb = text_model(model).model.embed_tokens.weight
    emb.copy_(torch.randn(emb.shape, generator=g) * embed_std)
    for name, m in model.named_modules():
        if isinstance(m, (KimiRMSNorm, GatedRMSNorm, AttnResWeights)):
            m.weight.fill_(1.0)
        elif isinstance(m, MoEGate):
            m.e_score_correction_bias.zero_()
        elif name.endswith("res_proj"):
            m.weight.zero_()
    if mla_init_std:
        _scale_mla_init(model, mla_init_std, g)
    kda = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    for m in kda[:prev_token_init]:
        _previous_token_head(m, 0)
    if split_residual:
        _split_residual(emb, kda[0], embed_std, g)


SPLIT_GAIN = 2.0  # the previous-token feature's elements come out ~0.5 (gated norm); the embedding's ~1.4


def _split_residual(emb: torch.Tensor, kda: KimiDeltaAttention, embed_std: float, g: torch.Generator) -> None:
    """Token embeddings in the first half of the residual, the previous token in the second half.

    An MLA key has to tell "the token before me was the current one" apart among up to 2k positions. With
    both features spread over all d = 64 dims, each score carries cross terms of random embeddings ~1/8 of the
    signal; a head of q/k width 32 then finds the right key among 2k at best 73% of the time, against 100%
    when each feature has its own 32 dims (``benchmarks/induction_snr.py``). So the rows start in dims
    [0, d/2) (at the same norm), and head 0 of the first KDA layer starts as a previous-token head (see
    ``_previous_token_head``) whose value reads dims [0, d/2) and whose output writes dims [d/2, d).
    Measured (RESULTS.md, "MLA copies"): with ``--attn-sup`` MLA head 0 learns induction within ~100 steps;
    with the previous-token head alone, or this init alone, it does not within 300."""
    d = emb.shape[1]
    half = d // 2
    emb.zero_()
    emb[:, :half] = torch.randn(emb.shape[0], half, generator=g) * embed_std * math.sqrt(2.0)
    context_heads(kda, 1, half)


SHIFT_DECAY = 0.5  # each further previous token writes the second half at half the gain of the one after it


@torch.no_grad()
def context_heads(kda: KimiDeltaAttention, shifts: int, half: int, start: int = 0) -> None:
    """Heads 0..shifts-1 of ``kda`` as previous-token heads for x_{t-1}, x_{t-2}, ...: each value reads
    dims [0, half) of its token and each output adds into dims [half, 2 half) with gain SPLIT_GAIN x
    SHIFT_DECAY^h. With shifts > 1 the second half holds the tokens before, most recent first, so an MLA key
    can match a context of several tokens: a call's next key is the token after the *value just written*
    (and the separator), which one previous token (a separator) does not single out. Heads below ``start``
    are left as they are (a continued run that already has them)."""
    K = kda.head_dim
    n = min(K, half)
    if not 1 <= shifts <= min(kda.num_heads, kda.conv_size - 1):
        raise ValueError(f"split shifts must be 1..{min(kda.num_heads, kda.conv_size - 1)}, got {shifts}")
    for h in range(start, shifts):
        _previous_token_head(kda, h, shift=h + 1)
        rows = slice(h * K, (h + 1) * K)
        kda.v_proj.weight[rows] = 0.0
        kda.v_proj.weight[h * K + torch.arange(n), torch.arange(n)] = 1.0
        kda.o_proj.weight[:, rows] = 0.0
        kda.o_proj.weight[half + torch.arange(n), h * K + torch.arange(n)] = SPLIT_GAIN * SHIFT_DECAY ** h


def _previous_token_head(m: KimiDeltaAttention, h: int, shift: int = 1) -> None:
    """Start head ``h`` of a KDA layer as a previous-token head: its output is (a gated, normalised
    projection of) the token before, o_t = beta_t * v_{t-1}. The softmax layers have no positions, so
    finding "the token after an earlier occurrence of this one" needs that feature in their keys (without
    it MLA attention stays near uniform and the KDA layers do all the copying from their own state, which
    holds ~10-20 tokens). Measured: with it MLA still did not copy within 300-step probes (RESULTS.md).
    How: the decay forgets the state at every step (log decay ~ -50), q and k are the same projection of
    the current token (so q.k = 1 after the L2 norm) and the value filter reads only x_{t-1}; the delta
    rule then leaves S_t = beta_t k_t v_t^T. ``shift`` s > 1 reads x_{t-s} instead (up to the conv width - 1)."""
    K = m.head_dim
    sl = slice(h * K, (h + 1) * K)
    m.k_proj.weight[sl] = m.q_proj.weight[sl]
    for conv, tap in ((m.q_conv1d, -1), (m.k_conv1d, -1), (m.v_conv1d, -1 - shift)):
        conv.weight[sl] = 0.0
        conv.weight[sl, 0, tap] = 1.0
    m.A_log[h] = math.log(16.0)
    m.dt_bias[sl] = 3.0


MLA_SCALED = ("q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _scale_mla_init(model: nn.Module, std: float, g: torch.Generator) -> None:
    """Redraw the MLA projections that set the attention scores and output at ``std``. At the flat 0.02,
    q and k come out ~0.16 per element, so the scores start ~0.03 apart (uniform attention) and their
    gradient is a product of three small factors; the KDA layers, whose q and k are L2-normalised, learn
    all the copying instead (zeroing every MLA output of a model so trained leaves its copy accuracy unchanged).
    Measured: at 0.125 a 400-step copy probe ended at the same loss as at 0.02 (RESULTS.md)."""
    for m in model.modules():
        if isinstance(m, MLAttention):
            for name in MLA_SCALED:
                w = getattr(m, name).weight
                w.copy_(torch.randn(w.shape, generator=g) * std)
