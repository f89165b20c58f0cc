"""Large request bodies parsed and validated in the frontend's worker pool, not on the event loop.

FastAPI reads a body, `json.loads` it and validates it with pydantic on the event loop; for a 7 MB chat of
200,000 messages that held `/health` for most of a second. `PooledBodyRoute` (the app's route class) does
that work in `state.pool` for a JSON body over `INLINE_BODY_BYTES` and hands FastAPI the validated model,
which FastAPI accepts as is; small bodies stay inline, where a hop to a thread costs more than parsing.

Before any Python object is built, `check_counts` counts the body's large collections from the raw JSON
(msgspec `Raw` slices: ~20 ms for 200,000 messages against ~100-200 ms to parse them), so a count over its
limit is refused without parsing the rest: `messages` over `--max-messages` (413) and `logit_bias` over
`MAX_LOGIT_BIAS` entries (400). json.loads and pydantic hold the GIL for their whole call, so the thread
alone would not keep the loop free while they chew on 200,000 objects (msgspec parses what it can,
in about half json.loads' time).
"""

from __future__ import annotations

import email.message
import json
from typing import Any

import msgspec
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from k3serve.server.errors import APIError
from k3serve.server.limits import RequestLimits, check_message_count
from k3serve.server.protocol import MAX_LOGIT_BIAS

INLINE_BODY_BYTES = 64 << 10  # ~1 ms of json.loads: below it, the worker-thread hop costs more than it saves


def _length(raw: msgspec.Raw, kind: type) -> int | None:
    try:
        return len(msgspec.json.decode(raw, type=kind))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # not a list / object (or too deep): the full parse and pydantic name the error


def check_counts(raw: bytes, limits: RequestLimits) -> None:
    """Refuse a body whose `messages` or `logit_bias` is over its limit, from the raw JSON."""
    try:
        top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return  # not an object msgspec reads (NaN, too deep, a non-object, bad JSON): the full parse reports it
    if "messages" in top:
        n = _length(top["messages"], list[msgspec.Raw])
        if n is not None:
            check_message_count(n, limits)
    if "logit_bias" in top:
        n = _length(top["logit_bias"], dict[str, msgspec.Raw])
        if n is not None and n > MAX_LOGIT_BIAS:  # the rule of `SamplingFields.logit_bias_ids`, earlier
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {n}")


def _loads(raw: bytes) -> Any:
    """json.loads(raw), in about half its time where msgspec can (both hold the GIL while they parse)."""
    try:
        return msgspec.json.decode(raw)  # accepts a subset of what json.loads does, and gives the same values
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return json.loads(raw)  # NaN, 1e400, lone surrogates, a BOM, or the error FastAPI would give


def parse_body(raw: bytes, model: type[BaseModel], limits: RequestLimits) -> BaseModel:
    """`raw` as `model`, with the errors FastAPI itself gives (a RequestValidationError with `body` locs)."""
    check_counts(raw, limits)
    try:
        data = _loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from None
    except UnicodeDecodeError:
        raise APIError(400, "body: not valid UTF-8", code="invalid_request", param="body") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)],
                                     body=data) from None


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would parse this body as JSON (its strict content-type rule)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class PooledBodyRoute(APIRoute):
    """An APIRoute whose pydantic body, when large, is parsed and validated in the app's worker pool."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model: Any = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        async def pooled(request):
            if _is_json(request.headers.get("content-type")):
                raw = await request.body()  # cached on the request: FastAPI's own read gets these bytes
                if len(raw) > INLINE_BODY_BYTES:
                    state = request.app.state.k3
                    # Starlette's Request.json() returns `_json` when set; FastAPI then validates the model
                    # instance, which pydantic passes through without walking it again
                    request._json = await state.pool.run(parse_body, raw, model, state.config.limits)
            return await handler(request)

        return pooled
