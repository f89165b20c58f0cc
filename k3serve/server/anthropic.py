"""`/v1/messages` (Anthropic Messages API) on top of the chat path: the body is mapped to an OpenAI
chat request (same renderer, parser, grammar and contract), the result back to Anthropic blocks.

Mapping: `system` -> system message; `tool_use` / `tool_result` blocks <-> assistant `tool_calls`
/ `tool` messages; `image` (base64 source) -> `image_url` data URL; `tool_choice` auto / any /
tool / none -> auto / required / named / none (`disable_parallel_tool_use` -> `parallel_tool_calls:
false`); reasoning <-> `thinking` blocks; stop reasons end_turn / max_tokens / tool_use / stop_sequence.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from k3serve.chat.parsers import ContentDelta, ReasoningDelta, ToolCallArgs, ToolCallStart
from k3serve.engine.client import EngineDead
from k3serve.server.chat_request import ChatJob
from k3serve.server.chat_serving import _decoders
from k3serve.server.generation import new_id, run_choices, stream_error_body
from k3serve.server.protocol import INT32, Budget, ChatCompletionRequest, TopK, _Body
from k3serve.server.state import ServerState


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: Budget
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    def to_chat(self) -> ChatCompletionRequest:
        msgs: list[dict[str, Any]] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(
                b.get("text", "") for b in self.system if isinstance(b, dict))
            msgs.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            msgs += _message(m, i)
        tools = None if self.tools is None else [_tool(t, i) for i, t in enumerate(self.tools)]
        body: dict[str, Any] = {"model": self.model, "messages": msgs, "max_tokens": self.max_tokens,
                                "stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p,
                                "top_k": self.top_k, "tools": tools, "tool_choice": _tool_choice(self.tool_choice)}
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("disable_parallel_tool_use") is True:
            body["parallel_tool_calls"] = False
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind not in ("enabled", "disabled"):
                raise ValueError("thinking.type: must be 'enabled' or 'disabled'")
            body["thinking"] = {"type": kind}
        return ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None})


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1, le=INT32)  # not part of a count_tokens body


def _tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise ValueError(f"tools[{i}].name: required")
    fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
    if t.get("description"):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(tc: dict[str, Any] | None) -> Any:
    if tc is None:
        return None
    kind = tc.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise ValueError("tool_choice: must be auto, any, none or {type: tool, name}")


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise ValueError(f"messages[{i}].role: must be 'user' or 'assistant'")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content: must be a string or an array of blocks")
    parts, calls, results, reasoning = [], [], [], None
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": b.get("text", "")})
        elif kind == "image":
            src = b.get("source")
            if not isinstance(src, dict) or src.get("type") != "base64":
                raise ValueError(f"messages[{i}].content[{j}]: only base64 image sources are accepted")
            parts.append({"type": "image_url", "image_url": {"url": f"data:{src.get('media_type')};base64,"
                                                                     f"{src.get('data', '')}"}})
        elif kind == "tool_use":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result":
            inner = b.get("content")
            text = inner if isinstance(inner, str) else "".join(
                x.get("text", "") for x in inner or [] if isinstance(x, dict))
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id")), "content": text})
        elif kind == "thinking":
            reasoning = b.get("thinking")
        else:
            raise ValueError(f"messages[{i}].content[{j}].type: {kind!r} is not supported")
    out = list(results)
    if parts or calls or not results:
        msg: dict[str, Any] = {"role": m["role"], "content": parts}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def _stop_reason(dec) -> tuple[str, str | None]:
    if dec.stopped_on is not None:
        return "stop_sequence", dec.stopped_on
    reason = dec.final_finish_reason()
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(reason, "end_turn"), None


async def messages_response(state: ServerState, job: ChatJob, model: str) -> dict[str, Any]:
    dec = _decoders(state, job)[0]
    async for _ in run_choices(state.client, new_id("msg-"), job.prompt_ids, job.sampling, [dec],
                               grammar=job.grammar, logit_bias=job.logit_bias, images=job.images):
        pass
    msg = dec.message()
    blocks: list[dict[str, Any]] = []
    if msg.reasoning_content:
        blocks.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
    if msg.content:
        blocks.append({"type": "text", "text": msg.content})
    for c in msg.tool_calls:
        try:
            args = json.loads(c.arguments or "{}")
        except json.JSONDecodeError:
            args = {"_raw": c.arguments}
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
    reason, seq = _stop_reason(dec)
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": job.usage_prompt_tokens, "output_tokens": dec.num_tokens}}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


# Anthropic's error type for each code `stream_error_body` gives
_ERROR_TYPES = {"invalid_request": "invalid_request_error", "rate_limit_exceeded": "rate_limit_error",
                "engine_unavailable": "overloaded_error"}


def anthropic_error_frame(e: Exception) -> bytes:
    """The `error` event that ends a /v1/messages stream failing after its 200 (Anthropic streams have no
    [DONE]: the error event is the last one)."""
    err = stream_error_body(e)["error"]
    return _event("error", {"error": {"type": _ERROR_TYPES.get(err["code"], "api_error"), "message": err["message"]}})


async def messages_stream(state: ServerState, job: ChatJob, model: str) -> AsyncIterator[bytes]:
    dec = _decoders(state, job)[0]
    mid = new_id("msg_")
    yield _event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": job.usage_prompt_tokens, "output_tokens": 0}}})
    block, kind = -1, None  # current block index and kind

    def open_block(new_kind: str, start: dict[str, Any]) -> list[bytes]:
        nonlocal block, kind
        out = [_event("content_block_stop", {"index": block})] if block >= 0 else []
        block, kind = block + 1, new_kind
        return out + [_event("content_block_start", {"index": block, "content_block": start})]

    try:
        async for _, deltas, _ in run_choices(state.client, mid, job.prompt_ids, job.sampling, [dec],
                                              grammar=job.grammar, logit_bias=job.logit_bias,
                                              images=job.images):
            for d in deltas:
                if isinstance(d, ReasoningDelta):
                    if kind != "thinking":
                        for e in open_block("thinking", {"type": "thinking", "thinking": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": block, "delta": {"type": "thinking_delta",
                                                                                    "thinking": d.text}})
                elif isinstance(d, ContentDelta):
                    if kind != "text":
                        for e in open_block("text", {"type": "text", "text": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": block, "delta": {"type": "text_delta",
                                                                                    "text": d.text}})
                elif isinstance(d, ToolCallStart):
                    for e in open_block("tool_use", {"type": "tool_use", "id": d.id, "name": d.name, "input": {}}):
                        yield e
                elif isinstance(d, ToolCallArgs):
                    yield _event("content_block_delta", {"index": block, "delta": {"type": "input_json_delta",
                                                                                    "partial_json": d.arguments}})
    except (ValueError, EngineDead) as e:
        yield anthropic_error_frame(e)
        return
    if block >= 0:
        yield _event("content_block_stop", {"index": block})
    reason, seq = _stop_reason(dec)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                   "usage": {"output_tokens": dec.num_tokens}})
    yield _event("message_stop", {})
