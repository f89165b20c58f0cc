"""`/v1/completions`: raw prompts (text or token ids, one or a batch) in `text_completion` form. The choices of
every prompt of a batch run in the engine at once; choice `n·i + k` is prompt i's k-th."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from k3serve.core.errors import error_body
from k3serve.engine.client import EngineBusy, EngineDead
from k3serve.engine.messages import HandoffSource
from k3serve.engine.sampling_params import SamplingParams, fan_out
from k3serve.server.choice import ChoiceDecoder, token_str
from k3serve.server.limits import check_prompt_chars
from k3serve.server.generation import SSE_DONE, Timer, new_id, run_requests, sse, usage
from k3serve.server.protocol import CompletionRequest
from k3serve.server.state import ServerState


@dataclass
class CompletionJob:
    prompts: list[list[int]]
    texts: list[str]
    samplings: list[SamplingParams]  # one per prompt (their budgets differ), the same n and stop strings
    logprobs: int | None
    echo: bool
    include_usage: bool
    skip_special: bool
    logit_bias: dict[int, float]
    handoff: HandoffSource | None = None  # decode role: import the prompt's caches from a prefill worker

    @property
    def n(self) -> int:
        return self.samplings[0].n


def prepare_completion(state: ServerState, req: CompletionRequest) -> CompletionJob:
    """The engine work of a request; tokenizes, so the server runs it in its worker pool."""
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        raw: list[Any] = [p]
    else:
        raw = list(p)
    if not raw:
        raise ValueError("prompt: must not be empty")
    check_prompt_chars(sum(len(item) for item in raw if isinstance(item, str)), state.config.limits, "prompt")
    prompts, texts = [], []
    for item in raw:
        ids = [int(t) for t in state.tokenizer.encode(item)] if isinstance(item, str) else list(item)
        state.check_ids(ids)
        prompts.append(ids)
        texts.append(item if isinstance(item, str) else state.tokenizer.decode(ids) if req.echo else "")
    include_usage = req.check_stream_options()
    samplings = [req.to_sampling_params(state.contract, prompt_len=len(ids), max_model_len=state.max_model_len)
                 for ids in prompts]
    role = state.config.engine.get("role", "both")
    handoff = req.handoff_source(samplings[0].n, role)
    if (handoff is not None or role == "prefill") and len(prompts) != 1:
        raise ValueError(f"prompt: prefill/decode disaggregation serves one prompt per request, got {len(prompts)}")
    return CompletionJob(prompts, texts, samplings, req.logprobs, req.echo,
                         include_usage, req.skip_special_tokens, req.logit_bias_ids(state.contract), handoff)


def _decoders(state: ServerState, job: CompletionJob) -> list[ChoiceDecoder]:
    """One decoder per choice of every prompt; choice j = prompt j // n, its k = j % n (the response index)."""
    skip = frozenset(state.tokenizer.special_tokens.values()) if job.skip_special else frozenset()
    return [ChoiceDecoder(j, state.tokenizer.decode_bytes, stop=job.samplings[0].stop, skip_ids=skip,
                          eos_ids=state.client.ready.eos_token_ids) for j in range(len(job.prompts) * job.n)]


def _requests(rid: str, job: CompletionJob) -> list[tuple[str, list[int], SamplingParams]]:
    return [(sub, ids, params) for i, (ids, sampling) in enumerate(zip(job.prompts, job.samplings))
            for sub, params in fan_out(f"{rid}-{i}", sampling)]


class _Batch:
    """Every choice of every prompt runs at once; this keeps each prompt's timer, records its metrics when
    its last choice ends, and sums the usage."""

    def __init__(self, state: ServerState, job: CompletionJob, decs: list[ChoiceDecoder]):
        self.state, self.job, self.decs = state, job, decs
        self.timers = [Timer() for _ in job.prompts]
        self.left = [job.n] * len(job.prompts)

    def stepped(self, j: int) -> None:
        i = j // self.job.n
        self.timers[i].mark_first()
        if self.decs[j].done:
            self.left[i] -= 1
            if not self.left[i]:
                self.state.metrics.finished(self.timers[i], len(self.job.prompts[i]), self.choices(i))

    def choices(self, i: int) -> list[ChoiceDecoder]:
        return self.decs[i * self.job.n:(i + 1) * self.job.n]

    def usage(self) -> dict[str, Any]:
        n_cached = sum(max(d.num_cached_tokens for d in self.choices(i)) for i in range(len(self.job.prompts)))
        return usage(sum(len(ids) for ids in self.job.prompts), sum(d.num_tokens for d in self.decs),
                     cached=n_cached)


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
    rid, decs = new_id("cmpl-"), _decoders(state, job)
    batch = _Batch(state, job, decs)
    async for j, _, _ in run_requests(state.client, _requests(rid, job), decs, logit_bias=job.logit_bias,
                                      handoff=job.handoff):
        batch.stepped(j)
    choices = [{"index": d.index, "text": (job.texts[d.index // job.n] if job.echo else "") + d.text,
                "logprobs": None if job.logprobs is None else _logprobs(state, d, job.logprobs),
                "finish_reason": d.final_finish_reason()} for d in decs]
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": batch.usage()}
    if decs[0].handoff is not None:  # prefill role: what a decode worker needs to continue (k3serve route)
        body["kv_transfer_params"] = {"address": decs[0].handoff.address, "request_id": decs[0].handoff.request_id}
    return body


async def completion_stream(state: ServerState, job: CompletionJob, model: str) -> AsyncIterator[bytes]:
    """One chunk per engine step that gave a choice new token ids, even when they decode to no text yet (as
    vLLM does): clients and `k3serve bench` see each token arrive. A finish chunk (`text: ""`) ends each choice."""
    rid, created, decs = new_id("cmpl-"), int(time.time()), _decoders(state, job)
    batch = _Batch(state, job, decs)

    def frame(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                    "usage": None})

    try:
        if job.echo:
            for j in range(len(decs)):
                yield frame(j, job.texts[j // job.n])
        async for j, text, lps in run_requests(state.client, _requests(rid, job), decs, logit_bias=job.logit_bias,
                                               handoff=job.handoff):
            dec = decs[j]
            batch.stepped(j)
            lp = _logprobs(state, dec, job.logprobs, lps) if job.logprobs is not None and lps else None
            if text or lp or dec.step_tokens:
                yield frame(j, text, logprobs=lp)
            if dec.done:
                yield frame(j, "", dec.final_finish_reason())
    except (ValueError, EngineDead, EngineBusy) as e:
        status = 400 if isinstance(e, ValueError) else 503
        yield sse(error_body(status, str(e)))
        yield SSE_DONE
        return
    if job.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": batch.usage()})
    yield SSE_DONE
