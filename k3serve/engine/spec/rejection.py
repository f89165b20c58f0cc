"""Verification of one decode row's drafts: which drafts the target model accepts, and the token after them.

``verify_drafts(logits [T, V], req, drafts)``: ``logits[j]`` is the model's (raw, fp32) distribution after the
row's tokens and ``drafts[:j]`` (T = len(drafts) + 1). Position j is processed exactly as the ordinary sampler
would process it had ``drafts[:j]`` been sampled already: the request's logits processor (a grammar is fed the
accepted drafts first, so a draft is checked against the grammar's mask like any sampled token), penalties,
``min_tokens``, then temperature / top-k / top-p / min-p (``sampler.filter_logits_reference``, the set the
sampler draws from). The drafters are deterministic, so the draft distribution q is one-hot and standard
speculative sampling (Leviathan et al. / Chen et al.) reads:

  * greedy: accept draft j while it equals the argmax; the first mismatch's argmax (or, with every draft
    accepted, position T-1's argmax) is the next token;
  * temperature > 0: accept draft d with probability p(d) (one uniform); on rejection draw from the residual
    ``norm(max(0, p - q))`` = p with d removed; with every draft accepted draw the bonus from p.

An accepted draft that ends the request (EOS or a stop id, past ``min_tokens``; ``is_stop``) ends the row's
tokens too: the drafts after it are not looked at (a grammar would fail on tokens past its end), emitted or
committed to the state. Every emitted token is thus distributed exactly as without speculation. Uniforms come from the request's own
generator when it has a seed (reproducible for a seed and configuration), else from torch's global one.
Returns the emitted tokens (accepted drafts, then one more) and, when the request asked, their logprobs.
"""

from __future__ import annotations

import torch

from k3serve.engine.request import Request
from k3serve.engine.sampler import (apply_penalties, filter_logits_reference, inverse_cdf, mask_min_tokens,
                                    token_logprobs)


class DraftView:
    """``req`` as the sampler sees it after ``extra`` more output tokens (penalties and min_tokens read it)."""

    def __init__(self, req: Request, extra: list[int]):
        self.req, self.extra = req, extra
        self.params, self.eos_token_ids = req.params, req.eos_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.req.token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.req.output_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + len(self.extra)


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=gen))


def _processed(logits: torch.Tensor, req: Request, drafts: list[int], j: int) -> torch.Tensor:
    """Row j's logits after the request's processor, penalties and min_tokens, as if ``drafts[:j]`` were output."""
    p = req.params
    proc = req.logits_processor
    if proc is None and not p.needs_penalties and req.num_output_tokens + j >= p.min_tokens:
        return logits[j]
    row = logits[j].clone()
    view = DraftView(req, drafts[:j])
    if proc is not None:
        if j:  # position 0's mask was prepared before the forward (the runner overlaps it)
            proc.prepare(view.output_token_ids)
        proc.apply(row)
    apply_penalties(row[None], [view])
    mask_min_tokens(row[None], [view])
    return row


def target_probs(row: torch.Tensor, req: Request) -> torch.Tensor:
    """The distribution ``[V]`` the sampler draws from for processed logits ``row`` (temperature > 0)."""
    p = req.params
    x = (row / p.temperature)[None]
    x = filter_logits_reference(x, torch.tensor([p.top_k]), torch.tensor([p.top_p], dtype=x.dtype),
                                torch.tensor([p.min_p], dtype=x.dtype))
    return x.softmax(dim=-1)[0]


def is_plain_greedy(req: Request) -> bool:
    """Greedy with nothing that edits the logits and no logprobs: verification is an argmax prefix match."""
    p = req.params
    return (p.greedy and req.logits_processor is None and not p.needs_penalties and p.logprobs is None
            and req.num_output_tokens >= p.min_tokens)


def is_stop(req: Request, token: int, num_output: int) -> bool:
    """Whether ``token``, as the request's ``num_output``-th output token, ends it with "stop" (the rule of
    ``scheduler.stop_reason``)."""
    p = req.params
    if num_output <= p.min_tokens:
        return False
    return (not p.ignore_eos and token in req.eos_token_ids) or token in p.stop_token_ids


def cut_at_stop(req: Request, tokens: list[int]) -> list[int]:
    """``tokens`` (a row's accepted drafts, then the next token) up to and including the first that stops."""
    n = req.num_output_tokens
    for j, t in enumerate(tokens):
        if is_stop(req, t, n + j + 1):
            return tokens[:j + 1]
    return tokens


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """The emitted tokens of a plain greedy row whose argmax at each position is ``targets``."""
    out = []
    for j, t in enumerate(targets):
        out.append(t)
        if j >= len(drafts) or t != drafts[j]:
            break
    return out


def verify_drafts(logits: torch.Tensor, req: Request, drafts: list[int]) -> tuple[list[int], list[dict | None] | None]:
    T = len(drafts) + 1
    if logits.shape[0] != T:
        raise ValueError(f"verify_drafts: {logits.shape[0]} logit rows for {len(drafts)} drafts")
    out: list[int] = []
    greedy = req.params.greedy
    for j in range(T):
        row = _processed(logits, req, drafts, j)
        if greedy:
            target = int(row.argmax())
            if j < len(drafts) and target == drafts[j]:
                out.append(target)
                if is_stop(req, target, req.num_output_tokens + j + 1):
                    break
                continue
            out.append(target)
            break
        probs = target_probs(row, req)
        if j < len(drafts):
            d = drafts[j]
            if _uniform(req.generator) < float(probs[d]):
                out.append(d)
                if is_stop(req, d, req.num_output_tokens + j + 1):
                    break
                continue
            probs = probs.clone()
            probs[d] = 0.0  # the residual max(0, p - q) for a one-hot q
        u = torch.tensor([_uniform(req.generator)], dtype=torch.float64)
        out.append(int(inverse_cdf(probs[None], u)[0]))
        break
    if req.params.logprobs is None:
        return out, None
    lp = token_logprobs(logits[:len(out)], out, [req.params.logprobs] * len(out))
    return out, lp
