"""OpenAI-style error objects for every failure (the body itself: `core.errors.error_body`).

Handlers only translate: `ValueError` from validation/rendering -> 400 (a prompt beyond the context
too, code `context_length_exceeded`: OpenAI, vLLM and KVV use 400, not 413), request-body schema
errors -> 400 (not FastAPI's 422; KVV expects 400), a body nested too deeply for the JSON parser
-> 400, unknown routes -> 404, engine gone -> 503, queue full -> 429, both with Retry-After. No
traceback ever reaches a client; every 500 is counted in /metrics (`k3serve:http_errors`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3serve.core.errors import error_body
from k3serve.engine.client import EngineBusy, EngineDead

log = logging.getLogger("k3serve.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def value_error(e: ValueError) -> APIError:
    """400 naming the leading field (`param`); a prompt that does not fit the context is a 400 too (OpenAI's
    and vLLM's status, which KVV clients expect; frontend.md 4.5), with code `context_length_exceeded`."""
    msg = str(e) or "invalid request"
    head = msg.split(":", 1)[0]
    param = head if head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum() else None
    if "max_model_len" in msg or "context length" in msg:
        return APIError(400, msg, code="context_length_exceeded", param=param)
    return APIError(400, msg, code="invalid_request", param=param)


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return error_response(e.status, e.message, code=e.code, param=e.param, retry_after=e.retry_after)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        cause = first.get("ctx", {}).get("error")
        if not first.get("loc", ())[1:] and isinstance(cause, ValueError):  # a whole-body check names its field
            a = value_error(cause)
            return error_response(a.status, a.message, code=a.code, param=a.param)
        field = _field(tuple(first.get("loc", ())))
        return error_response(400, f"{field}: {first.get('msg', 'invalid value')}", code="invalid_request",
                              param=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)

    @app.exception_handler(EngineDead)
    async def _dead(_: Request, e: EngineDead):
        return error_response(503, f"the engine is unavailable: {e}", code="engine_unavailable", retry_after=5)

    @app.exception_handler(EngineBusy)
    async def _busy(_: Request, e: EngineBusy):
        return error_response(429, f"the server is overloaded: {e}", code="rate_limit_exceeded", retry_after=1)

    @app.exception_handler(ValueError)
    async def _value(_: Request, e: ValueError):
        a = value_error(e)
        return error_response(a.status, a.message, code=a.code, param=a.param)

    @app.exception_handler(RecursionError)
    async def _deep(_: Request, e: RecursionError):
        # only a body nested thousands deep gets here (the JSON parser recurses before any validation runs)
        return error_response(400, "body: nested too deeply", code="invalid_request", param="body")

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception):
        log.exception("unhandled error")
        # this handler answers outside every middleware, so the error counter would not see the 500
        metrics = getattr(request.app.state.k3, "metrics", None)
        if metrics is not None:
            metrics.http_errors.labels("500").inc()
        return error_response(500, f"internal error ({type(e).__name__})", code="internal_error")
