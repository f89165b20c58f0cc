"""Batched sampling from fp32 logits ``[M, V]``, one row per request that samples this step.

Order of processing per row: the request's logits processor (``engine.logits_processor``; a grammar mask,
logit bias), penalties (repetition over prompt+output, presence/frequency over output), ``min_tokens`` masking
of EOS/stop ids, then greedy argmax (temperature 0) or temperature -> top-k -> top-p -> min-p -> an exponential
race ``argmax(p / E)``, ``E ~ Exp(1)``, which draws from ``p`` exactly. A request with a seed draws its ``E``
row from its own generator, so its samples depend only on its seed and its logits, not on the batch around
it. Logprobs are the log-softmax of the model's raw logits (before any processor, penalty or temperature),
as in vLLM's default ``raw_logprobs`` mode.
"""

from __future__ import annotations

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
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long)
            seen = seen[seen < V]
            v = x[seen]
            x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long), minlength=V)[:V]
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def mask_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> None:
    V = logits.shape[-1]
    for row, req in enumerate(reqs):
        if req.num_output_tokens < req.params.min_tokens:
            ids = [t for t in (*(() if req.params.ignore_eos else req.eos_token_ids), *req.params.stop_token_ids)
                   if t < V]
            logits[row, ids] = float("-inf")


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask ``logits [M, V]`` (already temperature-scaled) outside each row's top-k / top-p / min-p set."""
    V = logits.shape[-1]
    if bool((top_k <= 0).all() and (top_p >= 1).all() and (min_p <= 0).all()):
        return logits  # nothing to filter: skip the full-vocabulary sort
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


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
    tokens = logits.argmax(dim=-1)
    rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if rand:
        idx = torch.tensor(rand)
        temp = torch.tensor([reqs[i].params.temperature for i in rand], dtype=logits.dtype)
        x = filter_logits(logits[idx] / temp[:, None],
                          torch.tensor([reqs[i].params.top_k for i in rand]),
                          torch.tensor([reqs[i].params.top_p for i in rand], dtype=logits.dtype),
                          torch.tensor([reqs[i].params.min_p for i in rand], dtype=logits.dtype))
        noise = torch.empty_like(x)
        unseeded = [j for j, i in enumerate(rand) if reqs[i].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), x.shape[-1]).exponential_()
        for j, i in enumerate(rand):
            if reqs[i].generator is not None:
                noise[j] = torch.empty(x.shape[-1]).exponential_(generator=reqs[i].generator)
        tokens[idx] = (x.softmax(dim=-1) / noise).argmax(dim=-1)
    token_list = tokens.tolist()
    return SampleResult(token_list, token_logprobs(raw, token_list, [r.params.logprobs for r in reqs]))


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
