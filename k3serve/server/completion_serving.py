"""`/v1/completions`: raw prompts (text or token ids, one or a batch) in `text_completion` form."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from k3serve.core.errors import error_body
from k3serve.server.choice import ChoiceDecoder, token_str
from k3serve.server.engine_client import EngineDead
from k3serve.server.generation import SSE_DONE, Timer, new_id, run_choices, sse, usage
from k3serve.server.messages import Sampling
from k3serve.server.protocol import CompletionRequest
from k3serve.server.state import ServerState


@dataclass
class CompletionJob:
    prompts: list[list[int]]
    texts: list[str]
    samplings: list[Sampling]
    n: int
    stop: tuple[str, ...]
    logprobs: int | None
    echo: bool
    include_usage: bool
    skip_special: bool
    logit_bias: dict[int, float]


def prepare_completion(state: ServerState, req: CompletionRequest) -> CompletionJob:
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        raw: list[Any] = [p]
    else:
        raw = list(p)
    if not raw:
        raise ValueError("prompt: must not be empty")
    prompts, texts = [], []
    for item in raw:
        ids = [int(t) for t in state.tokenizer.encode(item)] if isinstance(item, str) else list(item)
        state.check_ids(ids)
        prompts.append(ids)
        texts.append(item if isinstance(item, str) else state.tokenizer.decode(ids) if req.echo else "")
    include_usage = req.check_stream_options()
    samplings = [req.to_sampling_params(state.contract, prompt_len=len(ids), max_model_len=state.max_model_len)
                 for ids in prompts]
    return CompletionJob(prompts, texts, samplings, req.n or 1, req.stop_strings(), req.logprobs, req.echo,
                         include_usage, req.skip_special_tokens, req.logit_bias_ids(state.contract))


def _decoders(state: ServerState, job: CompletionJob) -> list[ChoiceDecoder]:
    skip = frozenset(state.tokenizer.special_tokens.values()) if job.skip_special else frozenset()
    return [ChoiceDecoder(k, state.tokenizer.decode_bytes, stop=job.stop, skip_ids=skip,
                          eos_ids=state.client.ready.eos_token_ids) for k in range(job.n)]


def _logprobs(state: ServerState, dec: ChoiceDecoder, top: int, items=None, offset: int = 0) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    for tok, d in (dec.logprobs if items is None else items):
        s = token_str(state.tokenizer.decode_bytes, tok)[0]
        offsets.append(offset)
        offset += len(s)
        tokens.append(s)
        lps.append(d.get(tok, 0.0))
        best = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        tops.append({token_str(state.tokenizer.decode_bytes, t)[0]: lp for t, lp in best})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def completion_response(state: ServerState, job: CompletionJob, model: str) -> dict[str, Any]:
    rid, timer = new_id("cmpl-"), Timer()
    choices, n_prompt, n_out, n_cached = [], 0, 0, 0
    for i, (ids, sampling) in enumerate(zip(job.prompts, job.samplings)):
        decs = _decoders(state, job)
        async for _ in run_choices(state.client, f"{rid}-{i}", ids, sampling, decs, logit_bias=job.logit_bias):
            timer.mark_first()
        n_prompt += len(ids)
        n_cached += max((d.num_cached_tokens for d in decs), default=0)
        for d in decs:
            n_out += d.num_tokens
            choices.append({"index": i * job.n + d.index, "text": (job.texts[i] if job.echo else "") + d.text,
                            "logprobs": None if job.logprobs is None else _logprobs(state, d, job.logprobs),
                            "finish_reason": d.final_finish_reason()})
        state.metrics.finished(timer, len(ids), decs)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(n_prompt, n_out, cached=n_cached)}


async def completion_stream(state: ServerState, job: CompletionJob, model: str) -> AsyncIterator[bytes]:
    rid, created, timer = new_id("cmpl-"), int(time.time()), Timer()
    n_prompt = n_out = n_cached = 0

    def frame(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                    "usage": None})

    try:
        for i, (ids, sampling) in enumerate(zip(job.prompts, job.samplings)):
            decs = _decoders(state, job)
            n_prompt += len(ids)
            if job.echo:
                for k in range(job.n):
                    yield frame(i * job.n + k, job.texts[i])
            async for k, text, lps in run_choices(state.client, f"{rid}-{i}", ids, sampling, decs,
                                                  logit_bias=job.logit_bias):
                timer.mark_first()
                lp = _logprobs(state, decs[k], job.logprobs, lps) if job.logprobs is not None and lps else None
                if text or lp:
                    yield frame(i * job.n + k, text, logprobs=lp)
                if decs[k].done:
                    n_out += decs[k].num_tokens
                    yield frame(i * job.n + k, "", decs[k].final_finish_reason())
            n_cached += max((d.num_cached_tokens for d in decs), default=0)
            state.metrics.finished(timer, len(ids), decs)
    except (ValueError, EngineDead) as e:
        status = 503 if isinstance(e, EngineDead) else 400
        yield sse(error_body(status, str(e)))
        yield SSE_DONE
        return
    if job.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage(n_prompt, n_out, cached=n_cached)})
    yield SSE_DONE
