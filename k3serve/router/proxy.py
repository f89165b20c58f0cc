"""The live router: an OpenAI-compatible HTTP proxy in front of k3serve replicas.

    app = build_app(RouterConfig(replicas=("http://127.0.0.1:8001", "http://127.0.0.1:8002")))

Per request (``/v1/chat/completions``, ``/v1/completions``): get the prompt's token ids exactly as a
replica will compute them (its ``/tokenize`` endpoint runs the same chat renderer and tokenizer; a
token-id completion prompt needs no call), hash its blocks with ``core.hashing``, ask ``Router.route``
for a replica among the healthy ones, forward the body untouched and pass the answer back (SSE
streams chunk by chunk). ``on_first_token`` / ``on_finished`` keep the load counters honest.

Failures: a request whose replica refuses the connection, or answers 503, before any byte went to the client
is retried on another replica (the replica is taken out until its health check passes again). A connection
that breaks before any answer is first retried once on a fresh connection to the same replica (a replica
closes its keep-alive connection after its own 5xx; the pool may hand out that dead connection once), and
counts against the replica only if that fails too; REQUEST_FAILURES such failures in a row remove it. A
replica that answers nothing within ``request_timeout_s`` (hung) counts as failed and the request fails
over once; then the client gets a 504 error object, never a bare-text 500. A stream
whose replica dies after bytes went out ends with an ``{"error": ...}`` SSE frame and ``[DONE]`` (the
convention the replicas use for their own mid-stream errors).
``/v1/messages`` (Anthropic) is forwarded by load only (no prefix lookup).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3serve.core.errors import error_body
from k3serve.core.hashing import hash_blocks
from k3serve.core.kv_auth import KVEventsKey, check_secret
from k3serve.router.policy import POLICIES, PolicyConfig, make_policy
from k3serve.router.prefix_index import SnapshotRule
from k3serve.router.replicas import ReplicaSet
from k3serve.router.router import Router
from k3serve.router.router_metrics import RouterMetrics

log = logging.getLogger("k3serve.router")
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
_FORWARD_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type")
DEFAULT_DECODE_TOKENS = 256  # decode-KV estimate when a request sets no max_tokens
_POLICY_DEFAULTS = PolicyConfig()


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]
    policy: str = "kv"
    session_header: str = "x-session-id"
    temperature: float = 0.0
    weight: float = _POLICY_DEFAULTS.weight
    cache_weight: float = _POLICY_DEFAULTS.cache_weight
    block_size: int = 16  # must equal the replicas' (checked against /kv_events/info)
    # the engine snapshots KDA state at prompt ends only (EngineConfig.state_cache_interval = 0)
    snapshot_interval_blocks: int = 0
    health_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    # the replicas' KV events secret (core.kv_auth): subscribe with its CURVE key, hash prompts with its key
    kv_events_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("--replica: give at least one replica URL")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--replica must be an http(s) URL, got {url!r}")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError("--replica: the same URL is given twice")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.health_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("health interval and request timeout must be positive")
        if self.kv_events_secret is not None:
            check_secret(self.kv_events_secret)


class ReplicaUnavailable(Exception):
    """The chosen replica could not take the request; try another."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


_BROKEN = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)  # a connection that died under us


def error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status)  # what the replicas send


def sse_error(message: str) -> bytes:
    """The end of a broken stream: what the replicas send for their own mid-stream errors."""
    return b"data: " + json.dumps(error_body(500, message, "replica_failed")).encode() + b"\n\ndata: [DONE]\n\n"


class Proxy:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        policy = make_policy(config.policy, PolicyConfig(config.weight, config.cache_weight, config.temperature))
        self.router = Router(policy, len(config.replicas), config.block_size,
                             SnapshotRule(interval=config.snapshot_interval_blocks, branch=False))
        self.client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(config.request_timeout_s, connect=2.0),
                                        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        # for the one retry after a broken connection: never a pooled (perhaps equally stale) one
        self.fresh = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(config.request_timeout_s, connect=2.0),
                                       limits=httpx.Limits(max_keepalive_connections=0))
        self.kv_key = KVEventsKey.from_secret(config.kv_events_secret) if config.kv_events_secret else None
        self.hash_key = self.kv_key.hash_key if self.kv_key is not None else b""
        self.replicas = ReplicaSet(list(config.replicas), self.router, self.client, config.health_interval_s,
                                   self.kv_key)
        self.metrics = RouterMetrics(self)
        self._tokenize_turn = 0

    # prompt -> block hashes -----------------------------------------------------------------------

    async def prompt_ids(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> list[int] | Response:
        """The prompt's token ids, or the replica's error response when it refuses the request."""
        if path == "/v1/completions":
            p = body.get("prompt")
            if isinstance(p, list) and p and isinstance(p[0], list):
                p = p[0]  # a batch of prompts: route by the first
            if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                return p
            if isinstance(p, list) and p and isinstance(p[0], str):
                p = p[0]
            if not isinstance(p, str):
                return []  # malformed: the replica will say so
            query = {"model": body.get("model"), "prompt": p}
        elif path == "/v1/chat/completions":
            query = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        else:
            return []
        for _ in range(len(self.config.replicas)):
            ids = self.replicas.routable()
            if not ids:
                break
            self._tokenize_turn += 1
            rid = ids[self._tokenize_turn % len(ids)]
            try:
                resp = await self.client.post(self.config.replicas[rid] + "/tokenize", json=query, headers=headers)
            except httpx.ConnectError as e:
                self.replicas.mark_failed(rid, f"tokenize: {type(e).__name__}")
                continue
            except httpx.HTTPError as e:  # a stale keep-alive connection or a slow replica: not a removal yet
                self.replicas.report_failure(rid, f"tokenize: {type(e).__name__}")
                continue
            if resp.status_code == 503:
                continue
            if resp.status_code != 200:
                return Response(resp.content, resp.status_code, media_type="application/json")
            return list(resp.json()["tokens"])
        return []

    # forwarding -----------------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return error(400, "the request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "invalid_json")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        if not self.replicas.routable():
            return error(503, "no healthy replica", "no_replica")
        ids = await self.prompt_ids(path, body, headers)
        if isinstance(ids, Response):
            return ids
        bs = self.config.block_size
        try:
            hashes = hash_blocks(ids, bs, key=self.hash_key)[: max(0, len(ids) - 1) // bs]  # the engine never hits the last token
        except ValueError:  # ids out of any vocabulary: no prefix to look up, the replica will refuse them
            hashes = []
        budget = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_DECODE_TOKENS
        prompt_blocks = max(1, -(-len(ids) // bs))
        decode_blocks = -(-(len(ids) + int(budget if isinstance(budget, int) else 0)) // bs)
        session = request.headers.get(self.config.session_header)
        stream = bool(body.get("stream"))
        tried: set[int] = set()
        timeouts = 0
        while True:
            routable = [r for r in self.replicas.routable() if r not in tried]
            if not routable or timeouts > 1:  # a hung replica's request fails over once, not round the fleet
                self.metrics.failed.inc()
                if timeouts:
                    return error(504, f"no replica answered within {self.config.request_timeout_s:g} s",
                                 "replica_timeout")
                return error(503, "no healthy replica could take the request", "no_replica")
            rid = uuid.uuid4().hex
            decision = self.router.route(rid, hashes, prompt_blocks, decode_blocks, session, routable)
            self.metrics.routed(decision, len(hashes), len(ids))
            tried.add(decision.replica)
            try:
                return await self._send(path, raw, headers, decision.replica, rid, stream)
            except ReplicaUnavailable as e:
                self.router.on_finished(rid)
                self.metrics.retries.inc()
                timeouts += e.timed_out
                log.warning("retrying a request elsewhere: %s", e)

    async def _send(self, path: str, raw: bytes, headers: dict[str, str], replica: int, rid: str,
                    stream: bool) -> Response:
        url = self.config.replicas[replica] + path
        try:
            try:
                resp = await self.client.send(self.client.build_request("POST", url, content=raw, headers=headers),
                                              stream=True)
            except _BROKEN:  # perhaps a keep-alive connection the replica had closed: once more, fresh
                resp = await self.fresh.send(self.fresh.build_request("POST", url, content=raw, headers=headers),
                                             stream=True)
        except httpx.ConnectError as e:  # refused: nothing is listening there
            self.replicas.mark_failed(replica, f"{type(e).__name__} on {path}")
            raise ReplicaUnavailable(f"replica {replica}: {type(e).__name__}") from None
        except httpx.HTTPError as e:
            self.replicas.report_failure(replica, f"{type(e).__name__} on {path}")
            raise ReplicaUnavailable(f"replica {replica}: {type(e).__name__}",
                                     timed_out=isinstance(e, httpx.TimeoutException)) from None
        except BaseException:
            self.router.on_finished(rid)
            raise
        if resp.status_code != 503:
            self.replicas.report_ok(replica)  # it answered: whatever the status, its connection works
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            if resp.status_code == 503:  # its engine is gone: someone else serves it
                await resp.aclose()
                self.replicas.mark_failed(replica, "503 from the replica")
                raise ReplicaUnavailable(f"replica {replica} answered 503")
            if not stream or resp.status_code != 200:
                content = await resp.aread()
                await resp.aclose()
                self.router.on_first_token(rid)
                self.router.on_finished(rid)
                self.metrics.done(replica, resp.status_code)
                return Response(content, resp.status_code, headers=out_headers)
            chunks = resp.aiter_raw()
            first = await chunks.__anext__()  # nothing sent to the client yet: a failure here is retried
        except (httpx.HTTPError, StopAsyncIteration) as e:
            await resp.aclose()
            self.replicas.report_failure(replica, f"{type(e).__name__} before the first byte")
            raise ReplicaUnavailable(f"replica {replica} failed before answering",
                                     timed_out=isinstance(e, httpx.TimeoutException)) from None
        except ReplicaUnavailable:
            raise
        except BaseException:
            await resp.aclose()
            self.router.on_finished(rid)
            raise
        return StreamingResponse(self._relay(resp, first, chunks, replica, rid), resp.status_code,
                                 headers=out_headers)

    async def _relay(self, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes], replica: int,
                     rid: str) -> AsyncIterator[bytes]:
        status = 200
        try:
            yield first
            self.router.on_first_token(rid)
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            status = 502
            if isinstance(e, (*_BROKEN, httpx.TimeoutException)):
                self.replicas.report_failure(replica, f"{type(e).__name__} mid-stream")
            yield sse_error(f"the replica serving this stream failed mid-stream ({type(e).__name__}); "
                            "the response is incomplete")
        finally:
            await resp.aclose()
            self.router.on_finished(rid)
            self.metrics.done(replica, status)

    async def forward_get(self, path: str, headers: dict[str, str]) -> Response:
        for rid in self.replicas.routable():
            try:
                resp = await self.client.get(self.config.replicas[rid] + path, headers=headers)
            except httpx.HTTPError:
                continue
            return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
        return error(503, "no healthy replica", "no_replica")


def build_app(config: RouterConfig) -> FastAPI:
    proxy = Proxy(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.replicas.start()
        try:
            yield
        finally:
            await proxy.replicas.stop()
            await proxy.client.aclose()
            await proxy.fresh.aclose()

    app = FastAPI(title="k3serve router", lifespan=lifespan,
                  description="KV-cache-aware router in front of k3serve replicas (OpenAI-compatible).")
    app.state.proxy = proxy

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy.handle(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await proxy.handle(request, "/v1/messages")

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        return await proxy.forward_get("/v1/models", headers)

    @app.get("/health")
    async def health():
        up = proxy.replicas.routable()
        return JSONResponse({"healthy_replicas": len(up), "replicas": len(config.replicas)},
                            status_code=200 if up else 503)

    @app.get("/router/replicas", summary="Replica states as the router sees them")
    async def replicas():
        r = proxy.router
        return {"policy": config.policy, "replicas": [
            {"id": x.id, "url": x.url, "healthy": x.healthy, "kv_events": x.events, "kv_events_note": x.events_note,
             "down_reason": x.down_reason,
             "resyncs": x.resyncs, "cached_blocks": r.index.num_blocks(x.id),
             "cached_snapshots": r.index.num_snapshots(x.id), "stale": r.index.is_stale(x.id),
             "active_requests": int(r.load.active_requests[x.id]),
             "routed_requests": int(r.load.routed_requests[x.id])} for x in proxy.replicas.replicas]}

    @app.get("/metrics")
    async def metrics():
        return Response(proxy.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def serve(config: RouterConfig, host: str, port: int, log_level: str = "warning",
          beside: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run the router until stopped; ``beside()`` (e.g. a replica supervisor) runs on the same event loop,
    in this (the main) thread, and is cancelled when the router stops."""
    run_app(build_app(config), host, port, log_level, beside)


def run_app(app, host: str, port: int, log_level: str = "warning",
            beside: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve a router app (this one or the prefill/decode one) with uvicorn until a stop signal; SIGHUP stops it
    gracefully; ``beside()`` runs on its loop and is cancelled at the end."""
    import asyncio

    import uvicorn

    from k3serve.core.process import graceful_sighup

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))

    async def main() -> None:
        task = asyncio.create_task(beside()) if beside is not None else None
        try:
            await server.serve()
        finally:
            if task is not None:
                task.cancel()

    with graceful_sighup(server.handle_exit):
        asyncio.run(main())

