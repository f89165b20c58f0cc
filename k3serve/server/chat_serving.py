"""`/v1/chat/completions`: responses and SSE streams in OpenAI form, with Moonshot's streaming rules
(frontend.md §4.3): one choice per frame, a first `role` frame per choice, content / reasoning /
tool-call increments never mixed in a frame, a `reasoning_content: ""` boundary frame when
thinking ends, a finish frame with `delta: {}` carrying the choice's usage, an optional
`choices: []` usage frame (`stream_options.include_usage`), then `[DONE]`. A mid-stream failure
is sent as one `{"error": ...}` frame before `[DONE]` (the OpenAI/vLLM convention).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from k3serve.chat.parsers import ReasoningDelta
from k3serve.server.chat_request import ChatJob
from k3serve.core.errors import error_body
from k3serve.engine.client import EngineDead
from k3serve.server.choice import ChoiceDecoder
from k3serve.server.generation import SSE_DONE, Timer, new_id, run_choices, sse, usage
from k3serve.server.state import ServerState


def _decoders(state: ServerState, job: ChatJob) -> list[ChoiceDecoder]:
    return [ChoiceDecoder(k, state.tokenizer.decode_bytes, stop=job.sampling.stop,
                          parser=state.fmt.new_parser(job.prompt, job.tools or None),
                          eos_ids=state.client.ready.eos_token_ids, one_call=job.one_call) for k in range(job.sampling.n)]


def _reasoning_tokens(state: ServerState, dec: ChoiceDecoder) -> int:
    text = dec.message().reasoning_content
    return int(state.tokenizer.count(text)) if text else 0


def _cached(job: ChatJob, dec: ChoiceDecoder) -> int:
    """The reported prompt's tokens that the prefix cache served. The kimi contract reports the prompt without
    its last 3 ids (the channel-open stub, chat_format_examples.md §3.3); a cache hit is a prefix of the whole
    prompt, so the part of it that reaches into the stub is no reported prompt token."""
    return min(dec.num_cached_tokens, job.usage_prompt_tokens)


def _usage(state: ServerState, job: ChatJob, decs: list[ChoiceDecoder]) -> dict[str, Any]:
    return usage(job.usage_prompt_tokens, sum(d.num_tokens for d in decs),
                 cached=max((_cached(job, d) for d in decs), default=0),
                 reasoning=sum(_reasoning_tokens(state, d) for d in decs))


async def chat_response(state: ServerState, job: ChatJob, model: str) -> dict[str, Any]:
    rid, timer = new_id("chatcmpl-"), Timer()
    decs = _decoders(state, job)
    async for _ in run_choices(state.client, rid, job.prompt_ids, job.sampling, decs, grammar=job.grammar,
                               logit_bias=job.logit_bias, images=job.images, handoff=job.handoff):
        timer.mark_first()
    choices = []
    for d in decs:
        choice = {"index": d.index, "message": d.message().to_openai(), "logprobs": None,
                  "finish_reason": d.final_finish_reason()}
        if job.top_logprobs is not None:
            choice["logprobs"] = {"content": d.logprobs_content(job.top_logprobs)}
        choices.append(choice)
    state.metrics.finished(timer, job.usage_prompt_tokens, decs)
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage(state, job, decs), "system_fingerprint": None}
    if decs[0].handoff is not None:  # prefill role: what a decode worker needs to continue (k3serve route)
        body["kv_transfer_params"] = {"address": decs[0].handoff.address, "request_id": decs[0].handoff.request_id}
    return body


async def chat_stream(state: ServerState, job: ChatJob, model: str) -> AsyncIterator[bytes]:
    rid, created, timer = new_id("chatcmpl-"), int(time.time()), Timer()
    decs = _decoders(state, job)

    def frame(k: int, delta: dict[str, Any], *, finish: str | None = None, logprobs: Any = None,
              choice_usage: dict[str, Any] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if choice_usage is not None:
            choice["usage"] = choice_usage
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice], "usage": None})

    reasoning = [False] * job.sampling.n
    for k in range(job.sampling.n):
        yield frame(k, {"role": "assistant", "content": ""})
    try:
        async for k, deltas, lps in run_choices(state.client, rid, job.prompt_ids, job.sampling, decs,
                                                grammar=job.grammar, logit_bias=job.logit_bias,
                                                images=job.images, handoff=job.handoff):
            timer.mark_first()
            pending = {"content": decs[k].logprobs_content(job.top_logprobs, lps)} if (
                job.top_logprobs is not None and lps) else None
            for d in deltas:
                is_reasoning = isinstance(d, ReasoningDelta)
                if reasoning[k] and not is_reasoning:
                    yield frame(k, {"reasoning_content": ""})
                reasoning[k] = is_reasoning
                yield frame(k, d.to_openai(), logprobs=pending)
                pending = None
            dec = decs[k]
            if dec.done:
                if reasoning[k]:
                    yield frame(k, {"reasoning_content": ""})
                    reasoning[k] = False
                u = usage(job.usage_prompt_tokens, dec.num_tokens, cached=_cached(job, dec),
                          reasoning=_reasoning_tokens(state, dec))
                yield frame(k, {}, finish=dec.final_finish_reason(), logprobs=pending, choice_usage=u)
    except (ValueError, EngineDead) as e:
        status = 503 if isinstance(e, EngineDead) else 400
        yield sse(error_body(status, str(e), code="engine_unavailable" if status == 503 else "invalid_request"))
        yield SSE_DONE
        return
    state.metrics.finished(timer, job.usage_prompt_tokens, decs)
    if job.include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": _usage(state, job, decs)})
    yield SSE_DONE
