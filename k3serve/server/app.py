"""The FastAPI app factory. Routes only translate HTTP <-> handlers; startup spawns the engine
process and loads the tokenizer and chat format; shutdown stops the engine process.

    app = build_app(ServerConfig(model="k3-tiny-random"))
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from k3serve.chat import chat_format_for
from k3serve.engine.client import EngineClient
from k3serve.engine.dp_client import DataParallelClient
from k3serve.server.access_log import AccessLog
from k3serve.server.anthropic import (CountTokensRequest, MessagesRequest, anthropic_error_frame, messages_response,
                                      messages_stream)
from k3serve.server.body import PooledBodyRoute
from k3serve.server.chat_request import prepare_chat
from k3serve.server.chat_serving import chat_response, chat_stream
from k3serve.server.completion_serving import completion_response, completion_stream, prepare_completion
from k3serve.server.errors import error_response, install_handlers
from k3serve.server.generation import EventStream, until_disconnected
from k3serve.server.limits import BodyLimit, check_prompt_chars
from k3serve.server.metrics import Metrics
from k3serve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from k3serve.server.state import ServerConfig, ServerState

log = logging.getLogger("k3serve.server")
VERSION = "0.1.0"
_OPEN_PATHS = ("/health", "/version", "/metrics", "/kv_events/info", "/openapi.json", "/docs", "/redoc",
               "/docs/oauth2-redirect")


def _load_tokenizer(k3: bool):
    from k3serve.tokenizer import Tokenizer

    return Tokenizer.kimi("k3" if k3 else "k2")


async def start_state(state: ServerState) -> None:
    cfg = state.config
    kwargs = dict(max_queued_requests=cfg.max_queued_requests, startup_timeout_s=cfg.startup_timeout_s,
                  max_restarts=cfg.max_engine_restarts)
    spec = {"model": cfg.model, **cfg.engine}
    if cfg.data_parallel_size > 1:
        client = DataParallelClient(spec, cfg.data_parallel_size, **kwargs)
    else:
        client = EngineClient(spec, **kwargs)
    state.client = client
    tok_k3 = asyncio.create_task(asyncio.to_thread(_load_tokenizer, True))
    ready = await client.start()
    state.fmt = chat_format_for(ready.model_type, cfg.chat_format)
    state.tokenizer = await tok_k3 if state.fmt.is_k3 else await asyncio.to_thread(_load_tokenizer, False)
    state.contract = cfg.api_contract or ("kimi" if state.fmt.is_k3 else "openai")
    state.no_chat = state.check_chat_vocabulary()
    if state.no_chat is not None:
        log.warning("chat endpoints disabled for %s: %s; /v1/completions with token ids still works",
                    cfg.names[0], state.no_chat)
    state.metrics = Metrics(cfg.names[0], lambda: client.stats, lambda: client.num_in_flight)


def _tokenize_chat(body: TokenizeRequest) -> ChatCompletionRequest:
    extra = body.model_extra or {}
    return ChatCompletionRequest(messages=body.messages, **{k: v for k, v in extra.items()
                                                            if k in ChatCompletionRequest.model_fields})


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    # a 32 MB body holds millions of ids: checked in a worker thread, not on the loop
    bad = next((t for t in tokens if not 0 <= t < max(state.vocab_size, 163840)), None)
    if bad is not None:
        raise ValueError(f"tokens: id {bad} is outside the vocabulary")
    return state.tokenizer.decode(tokens)


class _AuthAndErrors:
    """Pure ASGI middleware (no body buffering, disconnects pass through): API key check in
    constant time (`Authorization: Bearer` or `x-api-key`), and a counter of error statuses."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        if state.config.api_key is not None and scope["path"] not in _OPEN_PATHS:
            headers = dict(scope["headers"])
            header = headers.get(b"authorization")
            if header is None and b"x-api-key" in headers:
                header = b"Bearer " + headers[b"x-api-key"]
            if not state.check_api_key(header.decode("latin-1") if header is not None else None):
                if state.metrics:
                    state.metrics.http_errors.labels("401").inc()
                return await error_response(401, "invalid or missing API key", code="invalid_api_key")(
                    scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400 and state.metrics:
                state.metrics.http_errors.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def build_app(config: ServerConfig) -> FastAPI:
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            if state.client is None:  # `k3serve serve` starts the engine before the HTTP server
                await start_state(state)
            yield
        finally:
            if state.client is not None:
                await state.client.shutdown()
            state.pool.shutdown()

    app = FastAPI(title="k3serve", version=VERSION, lifespan=lifespan,
                  description="OpenAI- and Anthropic-compatible server for Kimi K3-class models.")
    app.state.k3 = state
    app.router.route_class = PooledBodyRoute  # a large body is parsed in the worker pool (server/body.py)
    install_handlers(app)

    app.add_middleware(BodyLimit, limit=config.limits.max_body_bytes)  # inside the key check: 401 before 413
    app.add_middleware(_AuthAndErrors, state=state)
    if config.access_log:
        app.add_middleware(AccessLog)  # added last: outermost, so refused (401) requests are logged too

    def model_name(name: str | None) -> str:
        state.check_model(name)
        return name or config.names[0]

    @app.post("/v1/chat/completions", summary="OpenAI chat completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = model_name(body.model)
        state.admit(body.n or 1)
        job = await prepare_chat(state, body)
        if body.stream:
            return EventStream(chat_stream(state, job, model))
        return await until_disconnected(request, chat_response(state, job, model))

    @app.post("/v1/completions", summary="OpenAI text completions")
    async def completions(body: CompletionRequest, request: Request):
        model = model_name(body.model)
        state.admit(body.n or 1)
        job = await state.pool.run(prepare_completion, state, body)
        # every prompt's choices run at once (completion_stream): admit them all or none (on the loop: the
        # reservation belongs to this request's task)
        state.admit(len(job.prompts) * job.n, "prompt" if len(job.prompts) > 1 else "n")
        if body.stream:
            return EventStream(completion_stream(state, job, model))
        return await until_disconnected(request, completion_response(state, job, model))

    @app.post("/v1/messages", summary="Anthropic messages")
    async def messages(body: MessagesRequest, request: Request):
        model = model_name(body.model)
        state.admit(1)
        job = await prepare_chat(state, body.to_chat())
        if body.stream:
            return EventStream(messages_stream(state, job, model), error_frame=anthropic_error_frame)
        return await until_disconnected(request, messages_response(state, job, model))

    @app.post("/v1/messages/count_tokens", summary="Anthropic token count")
    async def count_tokens(body: CountTokensRequest):
        model_name(body.model)
        job = await prepare_chat(state, body.to_chat())
        return {"input_tokens": job.usage_prompt_tokens}

    @app.get("/v1/models", summary="Served models")
    async def models():
        created = int(state.started)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "k3serve", "root": config.model,
             "max_model_len": state.max_model_len} for name in config.names]}

    @app.post("/tokenize", summary="Tokenize a prompt or chat messages")
    async def tokenize(body: TokenizeRequest):
        model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if body.messages is not None:
            # validating up to --max-messages messages again: in the pool, like the body's first validation
            ids = (await prepare_chat(state, await state.pool.run(_tokenize_chat, body))).prompt_ids
        else:
            check_prompt_chars(len(body.prompt), config.limits, "prompt")
            ids = (await state.pool.run(state.tokenizer.encode, body.prompt,
                                        "all" if body.add_special_tokens else ())).tolist()
        # a long prompt's ids are millions of ints: encoded to JSON in a worker thread, not by FastAPI on the loop
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        return Response(await state.pool.run(msgspec.json.encode, body), media_type="application/json")

    @app.post("/detokenize", summary="Token ids to text")
    async def detokenize(body: DetokenizeRequest):
        model_name(body.model)
        return {"prompt": await state.pool.run(_detokenize, state, body.tokens)}

    @app.get("/health", summary="200 when the engine process is up, 503 otherwise (starting, restarting, dead)")
    async def health():
        client = state.client
        status = "starting" if client is None else client.state
        if client is None or not client.alive or status != "ready":
            reason = (client.dead_reason if client is not None else None) or "starting"
            return error_response(503, f"the engine is {status}: {reason}", code=f"engine_{status}",
                                  retry_after=5)
        return JSONResponse({"status": status, "engine_restarts": client.restarts})

    @app.get("/kv_events/info", summary="Where the engine publishes KV cache events (for a KV-aware router)")
    async def kv_events_info():
        info = state.client.ready.kv_events if state.client is not None and state.client.ready else None
        if info is None:
            return {"enabled": False}
        # server_key: the CURVE public key of keyed events (None: unkeyed), for a router to spot a mismatch
        return {"enabled": True, "block_size": info.block_size, "pub_port": info.pub_port,
                "snapshot_port": info.snapshot_port, "host": info.host, "server_key": info.server_key}

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def root():
        return JSONResponse({"name": "k3serve", "version": VERSION, "models": list(config.names),
                             "uptime_s": round(time.time() - state.started, 1)})

    return app
