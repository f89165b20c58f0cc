"""Batched sampling from fp32 logits ``[M, V]``, one row per request that samples this step.

Order of processing per row: the request's logits processor (``engine.logits_processor``; a grammar mask,
logit bias), penalties (repetition over prompt+output, presence/frequency over output), ``min_tokens`` masking
of EOS/stop ids, then greedy argmax (temperature 0) or temperature -> top-k -> a draw from the top-p and
min-p set (``draw_top_p``: inverse CDF with pivot rejection, no vocabulary sort; ``filter_logits_reference``
is its spec). A request with a seed draws its uniforms from its own generator, so its samples depend only on
its seed and its logits, not on the batch around it. Logprobs are the log-softmax of the model's raw logits
(before any processor, penalty or temperature), as in vLLM's default ``raw_logprobs`` mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3serve.engine.request import Request


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # sampled token first, then the top ones


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    V = logits.shape[-1]
    for row, req in enumerate(reqs):
        p = req.params
        if not p.needs_penalties:
            continue
        x = logits[row]
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < V]
            v = x[seen]
            x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=V)[:V]
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def mask_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> None:
    V = logits.shape[-1]
    for row, req in enumerate(reqs):
        if req.num_output_tokens < req.params.min_tokens:
            ids = [t for t in (*(() if req.params.ignore_eos else req.eos_token_ids), *req.params.stop_token_ids)
                   if t < V]
            logits[row, ids] = float("-inf")


def filter_logits_reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask ``logits [M, V]`` (already temperature-scaled) outside each row's top-k / top-p / min-p set, read
    off full-vocabulary sorts: the spec that ``sample`` draws from (tests, benchmarks/sampler.py).

    The sets are defined by thresholds, so tied tokens are kept or dropped together: top-k keeps the logits
    at least the k-th largest; top-p (over the top-k set's renormalised probabilities) keeps every token whose
    mass strictly before it in descending order is below p (cumulative masses in fp64), down to the one that
    reaches p; min-p keeps probabilities at least ``min_p`` times the largest.
    """
    V = logits.shape[-1]
    on = (top_k > 0) & (top_k < V)
    if bool(on.any()):
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (top_k.clamp(1, V) - 1)[:, None])
        logits = logits.masked_fill(on[:, None] & (logits < kth), float("-inf"))
    probs = logits.softmax(dim=-1)
    desc = probs.sort(dim=-1, descending=True).values
    n = (desc.double().cumsum(dim=-1) < top_p[:, None].double()).sum(dim=-1).clamp(max=V - 1)
    floor = torch.where(top_p < 1, desc.gather(-1, n[:, None]).squeeze(-1), 0.0)
    keep = (probs >= floor[:, None]) & (probs >= min_p[:, None] * desc[:, :1])
    return logits.masked_fill(~keep, float("-inf"))


def mask_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``logits`` with -inf below each row's k-th largest logit (rows with ``top_k`` 0, -1 or >= V untouched)."""
    V = logits.shape[-1]
    on = (top_k > 0) & (top_k < V)
    if not bool(on.any()):
        return logits
    k = torch.where(on, top_k, 1)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(on[:, None] & (logits < kth), float("-inf"))


def draw_top_p(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
               uniforms: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One token per row of ``probs [M, V]`` (the top-k set's softmax) from its top-p and min-p set,
    renormalised, without sorting the vocabulary (pivot rejection, as FlashInfer samples).

    Each round draws from the tokens not yet ruled out (``inverse_cdf``, one uniform a row from
    ``uniforms(rows)``) and accepts the token when the mass of the strictly more likely tokens is below p
    (fp64), which is the membership rule of ``filter_logits_reference``. A rejected token's probability
    becomes the row's pivot: every token at or below it is outside the set too, so the next round draws only
    above it. A draw lands in the set with probability at least p, so rows rarely need a second round, and
    each costs two passes over the row instead of a sort.
    """
    M = probs.shape[0]
    if bool((min_p > 0).any()):
        probs_in = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    else:
        probs_in = probs
    tokens = torch.empty(M, dtype=torch.long, device=probs.device)
    pivot = probs.new_zeros(M)
    rows = torch.arange(M, device=probs.device)
    first = True
    while rows.numel():
        sub = probs if rows.numel() == M else probs[rows]
        cand = probs_in if rows.numel() == M else probs_in[rows]
        if not first:
            cand = cand.masked_fill(sub <= pivot[rows, None], 0.0)
        tok = inverse_cdf(cand, uniforms(rows))
        v = sub.gather(-1, tok[:, None])
        above = sub.masked_fill(sub <= v, 0.0).sum(dim=-1, dtype=torch.float64)
        # the most likely token (nothing above it) is always in the set, even where p rounds to 0 in fp32
        ok = (top_p[rows] >= 1) | (above < top_p[rows].double()) | (above == 0)
        tokens[rows[ok]] = tok[ok]
        pivot[rows[~ok]] = v[~ok, 0]
        rows = rows[~ok]
        first = False
    return tokens


def sample(logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
    """Tokens for ``logits [M, V]`` (fp32, one row per request in ``reqs``)."""
    raw = logits
    if any(r.logits_processor is not None or r.params.needs_penalties or r.num_output_tokens < r.params.min_tokens
           for r in reqs):
        logits = logits.clone()
        for row, req in enumerate(reqs):
            if req.logits_processor is not None:
                req.logits_processor.apply(logits[row])
        apply_penalties(logits, reqs)
        mask_min_tokens(logits, reqs)
    rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
    # the argmax pass is only for greedy rows; a batch that samples every row skips it
    tokens = logits.argmax(dim=-1) if len(rand) < len(reqs) else torch.empty(len(reqs), dtype=torch.long,
                                                                              device=logits.device)
    if rand:
        dev, dt = logits.device, logits.dtype
        idx = torch.tensor(rand, device=dev)
        x = logits if len(rand) == len(reqs) else logits[idx]
        temps = [reqs[i].params.temperature for i in rand]
        if any(t != 1 for t in temps):
            x = x / torch.tensor(temps, dtype=dt, device=dev)[:, None]
        x = mask_top_k(x, torch.tensor([reqs[i].params.top_k for i in rand], device=dev))
        tokens[idx] = draw_top_p(x.softmax(dim=-1),
                                 torch.tensor([reqs[i].params.top_p for i in rand], dtype=dt, device=dev),
                                 torch.tensor([reqs[i].params.min_p for i in rand], dtype=dt, device=dev),
                                 _Uniforms([reqs[i].generator for i in rand], dev))
    token_list = tokens.tolist()
    return SampleResult(token_list, token_logprobs(raw, token_list, [r.params.logprobs for r in reqs]))


class _Uniforms:
    """fp64 uniforms in [0, 1) for some rows of a batch: a seeded row draws on its own CPU generator (the same
    values on any device, whatever the batch around it); the rest share one ``torch.rand`` call."""

    def __init__(self, generators: list[torch.Generator | None], device: torch.device):
        self.generators, self.device = generators, device

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        gens = [self.generators[i] for i in rows.tolist()]
        u = torch.empty(len(gens), dtype=torch.float64, device=self.device)
        shared = [j for j, g in enumerate(gens) if g is None]
        if shared:
            u[shared] = torch.rand(len(shared), dtype=torch.float64, device=self.device)
        for j, g in enumerate(gens):
            if g is not None:
                u[j] = float(torch.rand((), dtype=torch.float64, generator=g))
        return u


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [M, V]`` for ``uniform [M]`` in [0, 1): the first token whose cumulative
    probability (fp64, so rounding stays far below any probability that matters) exceeds ``uniform`` times the
    row's total. One uniform per row instead of a noise value per vocabulary entry (the exponential race costs
    ~15x more over 163,840 ids); zero-probability tokens are never drawn, the cumulative sum being flat there."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (uniform * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int | None]) -> list[dict[int, float] | None]:
    """Per row: ``{token: logprob, top-1: ..., top-k: ...}`` of ``log_softmax(logits)``, or None if not asked."""
    rows = [i for i, k in enumerate(num_top) if k is not None]
    out: list[dict[int, float] | None] = [None] * len(tokens)
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    kmax = max(num_top[i] for i in rows)
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
    for j, i in enumerate(rows):
        d = {tokens[i]: float(lp[j, tokens[i]])}
        for t in range(num_top[i]):
            d.setdefault(int(top_i[j, t]), float(top_v[j, t]))
        out[i] = d
    return out
