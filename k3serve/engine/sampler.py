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

import math
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
    """Mask ``logits [M, V]`` (already temperature-scaled) outside each row's top-k / top-p / min-p set.

    The sets are defined by thresholds, so tied tokens are kept or dropped together: top-k keeps the logits
    at least the k-th largest; top-p (over the top-k set's renormalised probabilities) keeps every token whose
    mass strictly before it in descending order is below p, down to the one that reaches p; min-p keeps
    probabilities at least ``min_p`` times the largest. Same sets as ``filter_logits_reference``, without
    sorting the vocabulary: the top-p floor comes from a top-k prefix that grows until its mass reaches p.
    """
    if bool((top_k <= 0).all() and (top_p >= 1).all() and (min_p <= 0).all()):
        return logits  # nothing to filter
    logits = mask_top_k(logits, top_k)
    probs = logits.softmax(dim=-1)
    floor = nucleus_floor(probs, top_p)
    if bool((min_p > 0).any()):
        floor = torch.maximum(floor, min_p * probs.amax(dim=-1))
    return logits.masked_fill(probs < floor[:, None], float("-inf"))


def filter_logits_reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """The same sets as ``filter_logits``, read off full-vocabulary sorts (the naive form, for tests and
    benchmarks/sampler.py)."""
    V = logits.shape[-1]
    on = (top_k > 0) & (top_k < V)
    if bool(on.any()):
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (top_k.clamp(1, V) - 1)[:, None])
        logits = logits.masked_fill(on[:, None] & (logits < kth), float("-inf"))
    probs = logits.softmax(dim=-1)
    desc = probs.sort(dim=-1, descending=True).values
    floor = torch.where(top_p < 1, _prefix_floor(desc, top_p)[0], 0.0)  # fp64 cumulative masses
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


def nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor, first_k: int = 256) -> torch.Tensor:
    """Per row of ``probs [M, V]``: the smallest probability in its top-p set (0 where ``top_p`` >= 1).

    The floor is read off the ``k`` most likely probabilities (``topk``, exactly the sort's first ``k``
    values), with ``k`` grown until each row's prefix reaches p. A row whose prefix would have to span a
    quarter of the vocabulary (a broad distribution) is read from the other end instead: the tokens that
    top-p drops are the least likely ones, whose mass stays below 1 - p (``_tail_floor``). Small vocabularies
    are sorted outright. Cumulative masses are fp64, so the summation order between the two ends does not
    move the floor.
    """
    M, V = probs.shape
    floor = probs.new_zeros(M)
    rows = (top_p < 1).nonzero().squeeze(-1)
    k = first_k
    while rows.numel():
        if 4 * k > V:
            sub = probs if rows.numel() == M else probs[rows]
            if V <= _SORT_BELOW:
                floor[rows] = _prefix_floor(sub.sort(dim=-1, descending=True).values, top_p[rows])[0]
            else:
                floor[rows] = _tail_floor(sub, top_p[rows])
            break
        desc = (probs if rows.numel() == M else probs[rows]).topk(k, dim=-1).values
        f, known, mass = _prefix_floor(desc, top_p[rows])
        known |= desc[:, -1] == 0  # the rest of the row is zeros: the set is the whole row, floor 0 (= f)
        floor[rows[known]] = f[known]
        # the open rows need at least (p - mass) / (largest remaining probability) more tokens
        need = ((top_p[rows] - mass) / desc[:, -1])[~known]
        rows = rows[~known]
        if rows.numel():
            k = max(8 * k, k + math.ceil(min(float(need.max()), V)))
    return floor


_SORT_BELOW = 8192  # a vocabulary this small is sorted: cheaper than a few topk passes


def _prefix_floor(desc: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From each row's first ``K`` probabilities in descending order: the floor of the top-p set (the first
    token whose cumulative mass reaches p, or the last of the prefix), whether the prefix reached p, and its
    mass."""
    K = desc.shape[-1]
    mass = desc.double().cumsum(dim=-1)
    n = (mass < top_p[:, None].double()).sum(dim=-1)
    return desc.gather(-1, n.clamp(max=K - 1)[:, None]).squeeze(-1), n < K, mass[:, -1].to(desc.dtype)


def _tail_floor(probs: torch.Tensor, top_p: torch.Tensor, first_k: int = 4096) -> torch.Tensor:
    """The top-p floor of broad rows of ``probs [R, V]``, from the least likely tokens up.

    A token is in the set when the mass strictly before it (in descending order) is below p, i.e. when the
    mass of it and every less likely token exceeds ``total - p``. So the floor is the first token, counting
    from the bottom, at which that ascending cumulative mass passes ``total - p``; the ``k`` smallest
    probabilities (zeros included, which a top-k mask leaves) are taken until they reach it, and a row whose
    tail spans half the vocabulary is sorted.
    """
    R, V = probs.shape
    floor = probs.new_zeros(R)
    zeros = (probs == 0).sum(dim=-1)
    drop = probs.double().sum(dim=-1) - top_p.double()  # the mass top-p may leave out
    rows = torch.arange(R, device=probs.device)
    k = first_k
    while rows.numel():
        width = int(zeros[rows].max()) + k
        if 2 * width > V:
            desc = probs[rows].sort(dim=-1, descending=True).values
            floor[rows] = _prefix_floor(desc, top_p[rows])[0]
            break
        asc = probs[rows].topk(width, dim=-1, largest=False).values
        m = (asc.double().cumsum(dim=-1) <= drop[rows, None]).sum(dim=-1)
        known = m < width
        floor[rows[known]] = asc[known].gather(-1, m[known, None]).squeeze(-1)
        rows = rows[~known]
        k *= 4
    return floor


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
        dev, dt = logits.device, logits.dtype
        idx = torch.tensor(rand, device=dev)
        temp = torch.tensor([reqs[i].params.temperature for i in rand], dtype=dt, device=dev)
        x = filter_logits(logits[idx] / temp[:, None],
                          torch.tensor([reqs[i].params.top_k for i in rand], device=dev),
                          torch.tensor([reqs[i].params.top_p for i in rand], dtype=dt, device=dev),
                          torch.tensor([reqs[i].params.min_p for i in rand], dtype=dt, device=dev))
        uniform = torch.empty(len(rand), dtype=torch.float64, device=dev)
        unseeded = [j for j, i in enumerate(rand) if reqs[i].generator is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=dev)
        for j, i in enumerate(rand):
            if reqs[i].generator is not None:  # a seeded row draws on the CPU generator: the same on any device
                uniform[j] = float(torch.rand((), dtype=torch.float64, generator=reqs[i].generator))
        tokens[idx] = inverse_cdf(x.softmax(dim=-1), uniform)
    token_list = tokens.tolist()
    return SampleResult(token_list, token_logprobs(raw, token_list, [r.params.logprobs for r in reqs]))


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [M, V]`` for ``uniform [M]`` in [0, 1): the first token whose cumulative
    probability (fp64, so rounding stays far below any probability that matters) exceeds ``uniform`` times the
    row's total. One uniform per row instead of a noise value per vocabulary entry (the exponential race costs
    ~15x more over 163,840 ids); zero-probability tokens are never drawn, the cumulative sum being flat there."""
    cdf = probs.double().cumsum(dim=-1)
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
