"""Endpoints for the verifier's tests, all in process (httpx ASGI transports, no ports):

* ``k3serve_app``: the real k3serve app (validation, rendering, tokenizing, parsers, usage accounting) over a
  scripted engine that emits the K3 answers a trained model gives to the verifier's prompts, token by token,
  with logprobs; ``shift`` adds a logit offset to the alternatives (a sampling bug).
* ``Corrupt``: a transport in front of an app that rewrites requests or response JSON (SSE frames too), for the
  deliberately broken servers.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import httpx

from k3serve.engine.messages import Output

EOS = 163586
CALL = ('<|open|>tools<|sep|><|open|>call tool="book_hotel" index="1"<|sep|><|open|>argument key="city" type="string"'
        '<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="nights" type="number"<|sep|>3<|close|>argument'
        '<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
END = "<|close|>message<|sep|>"


def answer(prompt: str) -> str:
    think = prompt.endswith("<|open|>think<|sep|>")
    if "book the hotel" in prompt:
        reasoning, body = "The user wants to book the hotel.", "<|open|>response<|sep|><|close|>response<|sep|>" + CALL
    elif "Return JSON" in prompt:
        reasoning, body = "I will fill 2 fields.", '{"name":3578,"genre":"Chicago"}<|close|>response<|sep|>'
    else:
        reasoning, body = "No tool does that.", "None of the available tools can do it.<|close|>response<|sep|>"
    if think:
        return reasoning + "<|close|>think<|sep|>" + (body if body.startswith("<|open|>response") else
                                                       "<|open|>response<|sep|>" + body) + END
    return (body[len("<|open|>response<|sep|>"):] if body.startswith("<|open|>response") else body) + END


class ScriptedClient:
    def __init__(self, tok, shift: float = 0.0):
        self.tok, self.shift = tok, shift
        self.ready = SimpleNamespace(supports_images=False, max_model_len=8192, vocab_size=163840, eos_token_ids=[EOS])
        self.alive, self.dead_reason, self.state, self.restarts, self.num_in_flight = True, None, "ready", 0, 0

    def check_admission(self, n: int = 1) -> None:
        pass

    async def generate(self, rid, prompt_ids, params, *, grammar=None, logit_bias=None, images=(), handoff=None):
        text = self.tok.decode(prompt_ids)
        ids = self.tok.encode(answer(text), "all").tolist() + [EOS]
        for i, t in enumerate(ids[:params.max_tokens]):
            # the scripted token leads by 4 nats; a buggy sampler adds `shift` to the runners-up
            logits = {t: 4.0, (t + 1) % 163584: self.shift, (t + 2) % 163584: self.shift - 1.0}
            norm = math.log(sum(math.exp(v) for v in logits.values()))
            lps = {k: v - norm for k, v in logits.items()}
            last = i == len(ids) - 1 or i == params.max_tokens - 1
            reason = None if not last else ("stop" if t == EOS else "length")
            yield Output(rid, [t], finished=last, finish_reason=reason,
                         logprobs=[lps] if params.logprobs is not None else None, num_prompt_tokens=len(prompt_ids))


def k3serve_app(shift: float = 0.0):
    from k3serve.chat import K3
    from k3serve.server.app import build_app
    from k3serve.server.metrics import Metrics
    from k3serve.server.state import ServerConfig
    from k3serve.verify.local import tokenizer

    app = build_app(ServerConfig(model="m", served_model_names=("k3-default",), access_log=False))
    state = app.state.k3
    state.tokenizer = tokenizer()
    state.client = ScriptedClient(state.tokenizer, shift)
    state.fmt, state.contract = K3, "kimi"
    state.metrics = Metrics("k3-default", lambda: None, lambda: 0)
    return app


def transport(app) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is an answer, as over a socket


class Corrupt(httpx.AsyncBaseTransport):
    """``request(body) -> body`` on chat requests; ``response(obj) -> obj`` on every JSON body and SSE frame."""

    def __init__(self, app, request=None, response=None):
        self.inner = transport(app)
        self.on_request, self.on_response = request, response

    async def handle_async_request(self, req: httpx.Request) -> httpx.Response:
        if self.on_request and req.method == "POST":
            try:
                body = json.loads(await req.aread())
                req = httpx.Request(req.method, req.url, headers={"content-type": "application/json"},
                                    json=self.on_request(body))
            except ValueError:
                pass
        r = await self.inner.handle_async_request(req)
        raw = await r.aread()
        if self.on_response is None:
            return httpx.Response(r.status_code, headers=r.headers, content=raw)
        text = raw.decode()
        if text.startswith("data:"):
            frames = []
            for line in text.split("\n"):
                if line.startswith("data: {"):
                    line = "data: " + json.dumps(self.on_response(json.loads(line[6:])))
                frames.append(line)
            out = "\n".join(frames)
        else:
            try:
                out = json.dumps(self.on_response(json.loads(text)))
            except ValueError:
                out = text
        headers = {k: v for k, v in r.headers.items() if k.lower() != "content-length"}
        return httpx.Response(r.status_code, headers=headers, content=out.encode())
