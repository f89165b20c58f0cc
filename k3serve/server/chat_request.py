"""A chat request turned into engine work: render with the model's chat format, encode per
segment, expand image placeholders, pick sampling and (for forced tool calls / response_format)
the grammar. Every bad input raises ValueError (HTTP 400; a request over the size limits 413). Message
count and characters are checked first; image decoding, rendering and tokenizing run in the frontend's
worker threads (`state.pool`), never on the event loop."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from k3serve.chat import ChatOptions, Prompt
from k3serve.engine.messages import HandoffSource, ImageData
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.vision_preprocess import K3_MEDIA_PROC, K25_MEDIA_PROC, num_image_tokens
from k3serve.server.grammars import (all_strict, check_grammar, check_schema_size, json_grammar, strict_tools_grammar,
                                     tool_call_grammar)
from k3serve.server.limits import check_chat_size
from k3serve.server.media import engine_images, expand_media_spans, image_parts, load_images
from k3serve.server.protocol import ChatCompletionRequest
from k3serve.server.state import ServerState


@dataclass
class ChatJob:
    prompt: Prompt
    prompt_ids: list[int]
    usage_prompt_tokens: int  # kimi contract: without the generation-channel stub (§3.3)
    sampling: SamplingParams  # n choices, stop strings (applied to content, `chat.cutoffs`)
    tools: list[dict[str, Any]]
    grammar: str | None
    logit_bias: dict[int, float]
    top_logprobs: int | None
    include_usage: bool
    one_call: bool = False  # parallel_tool_calls: false -> at most one tool call
    images: list[ImageData] = field(default_factory=list)  # preprocessed, for the engine's vision tower
    handoff: HandoffSource | None = None  # decode role: import the prompt's caches from a prefill worker


def all_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    tools = list(req.tools) if isinstance(req.tools, list) else []
    for m in req.messages:
        if isinstance(m, Mapping) and m.get("role") == "system" and isinstance(m.get("tools"), list):
            tools += m["tools"]
    return [t for t in tools if isinstance(t, Mapping)]


def _grammar(state: ServerState, req: ChatCompletionRequest, prompt: Prompt, options: ChatOptions,
             tools: list[dict[str, Any]]) -> str | None:
    choice = options.tool_choice
    fmt = state.fmt
    if choice == "required" or isinstance(choice, Mapping):
        name = choice["function"]["name"] if isinstance(choice, Mapping) else None
        return tool_call_grammar(fmt, prompt, tools, name)
    kind = options.response_format_type
    if fmt.is_k3 and kind == "text" and choice in (None, "auto") and tools and all_strict(tools):
        # OpenAI `strict` functions: the choice stays free, but a call must follow its function's schema
        return strict_tools_grammar(prompt, tools, one_call=req.parallel_tool_calls is False)
    if kind == "text" or (tools and choice != "none"):
        return None  # a free choice between a tool call and an answer stays unconstrained
    if kind == "json_object":
        return json_grammar(fmt, prompt, None)
    js = options.response_format["json_schema"]
    return json_grammar(fmt, prompt, options.response_schema, strict=js.get("strict") is not False)


def _check_schema_sizes(req: ChatCompletionRequest) -> None:
    for i, t in enumerate(all_tools(req)):
        fn = t.get("function")
        if isinstance(fn, Mapping):
            check_schema_size(fn.get("parameters"), f"tools[{i}].function.parameters")
    fmt = req.response_format
    if isinstance(fmt, Mapping) and isinstance(fmt.get("json_schema"), Mapping):
        check_schema_size(fmt["json_schema"].get("schema"), "response_format.json_schema.schema")


def _renderable(fmt, options: ChatOptions, req: ChatCompletionRequest) -> ChatOptions:
    """K3 renders nothing for a named tool_choice (the grammar forces the call): check here that it names a
    declared tool and that thinking is off, then render as `auto`."""
    if not fmt.is_k3 or not isinstance(options.tool_choice, Mapping):
        return options
    name = options.tool_choice["function"]["name"]
    if name not in {t["function"].get("name") for t in all_tools(req) if isinstance(t.get("function"), Mapping)}:
        raise ValueError(f"tool_choice names {name!r}, which is not a declared tool")
    if options.thinking:
        raise ValueError("tool_choice naming a function is not supported with thinking enabled")
    return replace(options, tool_choice="auto")


async def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> ChatJob:
    state.check_chat()
    check_chat_size(req.messages, state.config.limits)
    fmt = state.fmt
    default_thinking = fmt.is_k3 or (fmt.k2_style is not None and fmt.k2_style.think != "none")
    thinking, effort = req.thinking_mode(default_thinking)
    if req.parallel_tool_calls is not None and not isinstance(req.parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls: must be a boolean")
    include_usage = req.check_stream_options()
    req.stop_strings()  # checked here, before the prompt, as the errors' order has always been
    if image_parts(req.messages) and not state.client.ready.supports_images:
        raise ValueError(f"messages: model {state.config.names[0]!r} takes text only (it has no vision tower); "
                         "remove the image parts")
    images = await load_images(req.messages, state.config.media, state.pool.run)
    tool_choice = req.tool_choice
    if tool_choice is None and req.tools is not None and not isinstance(req.tools, list):
        raise ValueError("tools: must be an array")
    options = ChatOptions(thinking=thinking, effort=effort, tool_choice=tool_choice,
                          response_format=req.response_format, image_sizes=tuple(im.size for im in images))
    if isinstance(req.tools, list) and not req.tools and tool_choice == "required":
        raise ValueError("tool_choice: 'required' needs at least one tool")
    _check_schema_sizes(req)
    job, spans = await state.pool.run(_build, state, req, options, include_usage)
    media = K3_MEDIA_PROC if state.fmt.is_k3 else K25_MEDIA_PROC
    job.images = await engine_images(images, spans, media, state.pool.run)
    return job


def _build(state: ServerState, req: ChatCompletionRequest, options: ChatOptions,
           include_usage: bool) -> tuple[ChatJob, list[tuple[int, int]]]:
    """Render, encode and pick the grammar (a worker thread's part); also each image's placeholder run."""
    fmt, tok = state.fmt, state.tokenizer
    prompt = fmt.render(req.messages, req.tools if req.tools else None, _renderable(fmt, options, req))
    ids = tok.encode_segments(prompt.token_segments()).tolist()
    media = K3_MEDIA_PROC if fmt.is_k3 else K25_MEDIA_PROC
    ids, spans = expand_media_spans(ids, [num_image_tokens(w, h, media) for w, h in options.image_sizes])
    state.check_ids(ids)
    stub = prompt.stub_ids(tok.encode_segments) if state.contract == "kimi" else 0
    tools = all_tools(req)
    grammar = _grammar(state, req, prompt, options, tools)
    if grammar is not None:
        check_grammar(grammar)
    sampling = req.to_sampling_params(state.contract, thinking=options.thinking, prompt_len=len(ids),
                                      max_model_len=state.max_model_len)
    handoff = req.handoff_source(sampling.n, state.config.engine.get("role", "both"))
    job = ChatJob(prompt=prompt, prompt_ids=ids, usage_prompt_tokens=len(ids) - stub, sampling=sampling,
                  tools=tools, grammar=grammar, handoff=handoff,
                  logit_bias=req.logit_bias_ids(state.contract), top_logprobs=req.logprob_count(),
                  include_usage=include_usage, one_call=req.parallel_tool_calls is False and bool(tools))
    return job, spans
