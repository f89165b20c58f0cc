"""The live router's prefill/decode mode: every request runs on a prefill worker, then on a decode worker.

    k3serve route --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 [--decode ...]

Per request (``/v1/completions``, ``/v1/chat/completions``; one prompt, one choice):
  1. the least-loaded prefill worker (``serve --role prefill``) gets the body as a non-streaming request; it
     runs the prompt to its first token, holds the caches and answers with ``kv_transfer_params``;
  2. a decode worker (``serve --role decode``) chosen by load and by the prefix its cache holds
     (``router/decode_choice.py``) gets the original body plus those ``kv_transfer_params``; it fetches the
     caches from the prefill worker (engine/pd), decodes, and its answer (JSON or SSE) goes back to the client
     unchanged.
An error answer of either worker is passed back as it is; a worker that refuses the connection is skipped for
this request. When the decode side answers with an error, fails (mid-stream included), or no decode worker takes
the request, the router nacks the hand-off (``engine/pd/wire.Nacker``: a negative ``Ack`` to the prefill
worker's sender address), so its slot and blocks are freed at once; the prefill worker's
``--handoff-timeout`` is the last resort (a router that dies in between).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3serve.core.errors import error_body
from k3serve.engine.pd.wire import Nacker
from k3serve.router.decode_choice import DecodeChoice

log = logging.getLogger("k3serve.router")
_FORWARD_HEADERS = ("authorization", "x-api-key", "content-type")
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_DECODE_TOKENS = 256  # decode-KV estimate when a request sets no max_tokens


def _token_prompt(path: str, body: dict) -> list[int] | None:
    """The prompt's token ids when the body gives them (a token-id completion prompt), else None."""
    p = body.get("prompt") if path == "/v1/completions" else None
    ok = isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    return p if ok else None


def _max_tokens(body: dict) -> int:
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else DEFAULT_DECODE_TOKENS


@dataclass(frozen=True)
class DisaggConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for flag, urls in (("--prefill", self.prefill), ("--decode", self.decode)):
            if not urls:
                raise ValueError(f"{flag}: give at least one worker URL")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{flag} must be an http(s) URL, got {url!r}")
        if len({*self.prefill, *self.decode}) != len(self.prefill) + len(self.decode):
            raise ValueError("--prefill/--decode: the same URL is given twice")
        if not self.request_timeout_s > 0:
            raise ValueError("the request timeout must be positive")


class Workers:
    """One role's workers and the requests this router has in flight on each (its load)."""

    def __init__(self, urls: tuple[str, ...]):
        self.urls = urls
        self.active = [0] * len(urls)
        self.served = [0] * len(urls)
        self._turn = itertools.count()

    def order(self, first: int | None = None) -> list[int]:
        """Workers to try: ``first``, then the rest least loaded first (ties rotate)."""
        t = next(self._turn)
        n = len(self.urls)
        return sorted(range(n), key=lambda i: (i != first, self.active[i], (i - t) % n))


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status)


class DisaggProxy:
    def __init__(self, config: DisaggConfig):
        self.config = config
        self.prefill, self.decode = Workers(config.prefill), Workers(config.decode)
        self.choice = DecodeChoice(len(config.decode))
        self._ids = itertools.count()
        self.nacker = Nacker()
        self.nacks = 0  # hand-offs this router told a prefill worker to free
        self.client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(config.request_timeout_s, connect=2.0),
                                        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))

    async def handle(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_json")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params: set by the router, not by clients", "invalid_request")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        first = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        resp = await self._post(self.prefill, path, first, headers, stream=False)
        if isinstance(resp, Response):
            return resp
        w, r = resp
        try:
            content = await r.aread()
        finally:
            await r.aclose()
            self.prefill.active[w] -= 1
        if r.status_code != 200:
            return Response(content, r.status_code, media_type="application/json")
        try:
            kv = json.loads(content)["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            return _error(502, f"prefill worker {self.prefill.urls[w]} gave no kv_transfer_params "
                          "(is it running with --role prefill?)", "bad_prefill_worker")
        stream = bool(body.get("stream"))
        rid = next(self._ids)
        chosen = self.choice.pick(rid, _token_prompt(path, body), _max_tokens(body))
        try:
            resp = await self._post(self.decode, path, body | {"kv_transfer_params": kv}, headers, stream=stream,
                                    first=chosen)
        except BaseException:  # the client went away: nobody will continue this hand-off
            self.choice.finished(rid)
            self._nack(kv, "the request ended at the router before a decode worker answered")
            raise
        if isinstance(resp, Response):
            self.choice.finished(rid)
            self._nack(kv, "no decode worker took the request")
            return resp
        self.choice.started(rid)
        w, r = resp
        out_headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
        if not stream or r.status_code != 200:
            try:
                content = await r.aread()
            except httpx.HTTPError as e:  # the decode worker died before it answered
                self._nack(kv, f"the decode worker failed ({type(e).__name__})")
                return _error(502, f"decode worker {self.decode.urls[w]} failed: {type(e).__name__}", "worker_failed")
            finally:
                await r.aclose()
                self.decode.active[w] -= 1
                self.choice.finished(rid)
            if r.status_code != 200:
                self._nack(kv, f"the decode worker answered {r.status_code}")
            return Response(content, r.status_code, headers=out_headers)
        return StreamingResponse(self._relay(r, w, rid, kv), r.status_code, headers=out_headers)

    def _nack(self, kv: object, reason: str) -> None:
        """Tell the prefill worker to free the hand-off ``kv`` (its ``kv_transfer_params``) now. Harmless when
        the decode side already took or released it (the prefill worker ignores acks of what it no longer
        holds)."""
        if isinstance(kv, dict) and isinstance(kv.get("request_id"), str):
            if self.nacker.nack(kv.get("address"), kv["request_id"], reason):
                self.nacks += 1

    async def _post(self, workers: Workers, path: str, body: dict, headers: dict[str, str], *, stream: bool,
                    first: int | None = None):
        """(worker, open response) from the first worker that takes the request (``first``, if given, is
        tried first), or an error response. The worker's load counter is raised; the caller lowers it when
        the response is done."""
        for w in workers.order(first):
            workers.active[w] += 1
            try:
                req = self.client.build_request("POST", workers.urls[w] + path, json=body, headers=headers)
                r = await self.client.send(req, stream=True)
            except httpx.ConnectError as e:
                workers.active[w] -= 1
                log.warning("worker %s refused: %s", workers.urls[w], e)
                continue
            except httpx.HTTPError as e:
                workers.active[w] -= 1
                return _error(502, f"worker {workers.urls[w]} failed: {type(e).__name__}", "worker_failed")
            except BaseException:
                workers.active[w] -= 1
                raise
            workers.served[w] += 1
            return w, r
        return _error(503, "no worker of that role could take the request", "no_worker")

    async def _relay(self, r: httpx.Response, w: int, rid: int, kv: dict) -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self._nack(kv, f"the decode worker failed mid-stream ({type(e).__name__})")
            msg = error_body(502, f"the decode worker failed mid-stream ({type(e).__name__})", "worker_failed")
            yield b"data: " + json.dumps(msg).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            await r.aclose()
            self.decode.active[w] -= 1
            self.choice.finished(rid)


def build_app(config: DisaggConfig) -> FastAPI:
    proxy = DisaggProxy(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await proxy.client.aclose()
            proxy.nacker.close()

    app = FastAPI(title="k3serve router (prefill/decode)", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy.handle(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle(request, "/v1/completions")

    @app.get("/router/workers", summary="Prefill and decode workers and their load as the router sees it")
    async def workers():
        return {role: [{"url": u, "active_requests": ws.active[i], "served_requests": ws.served[i]}
                       for i, u in enumerate(ws.urls)]
                for role, ws in (("prefill", proxy.prefill), ("decode", proxy.decode))} | {"nacks": proxy.nacks}

    @app.get("/health")
    async def health():
        return {"prefill_workers": len(config.prefill), "decode_workers": len(config.decode)}

    return app


def serve(config: DisaggConfig, host: str, port: int, log_level: str = "warning",
          beside: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run the router until stopped; ``beside()`` (``serve --prefill-replicas``' supervisor) runs on its loop."""
    from k3serve.router.proxy import run_app

    run_app(build_app(config), host, port, log_level, beside)
