"""Issue 50: no single request may stall the others. The frontend's CPU work (chat rendering, tokenizing,
image decoding) runs in its worker pool, so `/health` answers while a heavy request is still being
prepared; oversized requests get 413 naming the limit before any costly work.

The app runs in-process (httpx's ASGI transport, same event loop) with a stand-in engine client. The heavy
step is made to block on a `threading.Event` until the test releases it: if that step ran on the event loop,
`/health` could not answer before it, and the in-flight assertion fails (ordering, not timing)."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from types import SimpleNamespace

import httpx
import pytest
from PIL import Image

from k3serve.chat import K3
from k3serve.server import media
from k3serve.server.limits import RequestLimits
from k3serve.server.media import MediaLimits
from k3serve.server.state import ServerConfig
from tests.server.conftest import in_process_app

NO_THINK = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def tokenizer():
    from k3serve.tokenizer import Tokenizer

    return Tokenizer.kimi("k3")


def _app(tokenizer, **limits):
    media_limits = MediaLimits(max_pixels=limits.pop("max_pixels")) if "max_pixels" in limits else MediaLimits()
    app = in_process_app(ServerConfig(model="m", served_model_names=("tiny",), access_log=False,
                                      limits=RequestLimits(**limits), media=media_limits))
    app.state.k3.tokenizer = tokenizer
    return app


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


class Gate:
    """Wraps a function so that each call signals `entered` and then waits for `release`."""

    def __init__(self, fn):
        self.fn, self.entered, self.release = fn, threading.Event(), threading.Event()

    def __call__(self, *args, **kw):
        self.entered.set()
        self.release.wait(timeout=20)  # on the event loop (the bug) this wait is what stalls /health
        return self.fn(*args, **kw)


async def _health_while_held(app, gate: Gate, path: str, body: dict) -> httpx.Response:
    async with _client(app) as c:
        heavy = asyncio.create_task(c.post(path, json=body))
        await asyncio.to_thread(gate.entered.wait, 20)
        health = await c.get("/health")
        in_flight = not heavy.done()
        gate.release.set()
        r = await heavy
    assert health.status_code == 200 and in_flight, "/health waited for the heavy request"
    return r


def test_health_answers_while_a_chat_renders(tokenizer, monkeypatch):
    app = _app(tokenizer)
    gate = Gate(K3.render)
    monkeypatch.setattr(app.state.k3, "fmt", SimpleNamespace(**{**{k: getattr(K3, k) for k in ("is_k3", "k2_style",
                                                             "stop_token")}, "render": gate}))
    r = asyncio.run(_health_while_held(app, gate, "/tokenize",
                                       {"messages": [{"role": "user", "content": "hi"}] * 50, **NO_THINK}))
    assert r.status_code == 200 and r.json()["count"] > 100


def test_health_answers_while_a_prompt_tokenizes(tokenizer):
    app = _app(tokenizer)
    gate = Gate(tokenizer.encode)
    app.state.k3.tokenizer = SimpleNamespace(encode=gate)
    r = asyncio.run(_health_while_held(app, gate, "/tokenize", {"prompt": "hello world " * 1000}))
    assert r.status_code == 200 and r.json()["count"] == len(tokenizer.encode("hello world " * 1000))


def _png_url(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            **NO_THINK}


def test_health_answers_while_an_image_decodes(tokenizer, monkeypatch):
    app = _app(tokenizer)
    gate = Gate(media.open_image)
    monkeypatch.setattr(media, "open_image", gate)
    r = asyncio.run(_health_while_held(app, gate, "/tokenize", _image_chat(_png_url(56, 56))))
    assert r.status_code == 200 and r.json()["tokens"].count(media.MEDIA_PAD_ID) == 4


def test_huge_declared_image_is_413_before_decoding(tokenizer, monkeypatch):
    """A 60,000,000-pixel PNG compresses to a few dozen KiB; its header says so, and nothing is decoded."""
    big = _png_url(10_000, 6_000)
    assert len(big) < 1 << 20
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self.size))
    r = asyncio.run(_post(_app(tokenizer), "/tokenize", _image_chat(big)))
    assert r.status_code == 413 and not loads
    err = r.json()["error"]
    assert "10000x6000" in err["message"] and "--max-image-pixels" in err["message"]


async def _post(app, path: str, body=None, **kw) -> httpx.Response:
    async with _client(app) as c:
        return await c.post(path, json=body, **kw) if body is not None else await c.post(path, **kw)


def test_body_over_the_limit_is_413_before_parsing(tokenizer):
    app = _app(tokenizer, max_body_bytes=1000)
    r = asyncio.run(_post(app, "/tokenize", {"prompt": "x" * 2000}))
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]

    async def chunked():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 200

    r = asyncio.run(_post(app, "/tokenize", content=chunked(), headers={"content-type": "application/json"}))
    assert r.status_code == 413
    r = asyncio.run(_post(app, "/tokenize", {"prompt": "small"}))  # under the limit: served as before
    assert r.status_code == 200 and r.json()["count"] == 1


def test_too_many_messages_or_characters_is_413(tokenizer, monkeypatch):
    app = _app(tokenizer, max_messages=100, max_prompt_chars=5000)
    rendered = []
    monkeypatch.setattr(app.state.k3, "fmt", SimpleNamespace(is_k3=True, k2_style=None, stop_token="<|im_end|>",
                                                             render=lambda *a: rendered.append(a)))
    r = asyncio.run(_post(app, "/tokenize", {"messages": [{"role": "user", "content": "hi"}] * 101}))
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages"
    assert "--max-messages" in r.json()["error"]["message"]
    long = [{"role": "user", "content": [{"type": "text", "text": "y" * 3000}]}, {"role": "user", "content": "z" * 3000}]
    r = asyncio.run(_post(app, "/tokenize", {"messages": long}))
    assert r.status_code == 413 and "--max-prompt-chars" in r.json()["error"]["message"]
    r = asyncio.run(_post(app, "/tokenize", {"prompt": "w" * 5001}))
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"
    assert not rendered  # refused before rendering


def test_logit_bias_is_bounded_and_named():
    """A 160,000-entry logit_bias slowed every request batched with it; beyond 300 entries it is a 400."""
    from k3serve.server.errors import value_error
    from k3serve.server.protocol import ChatCompletionRequest

    ok = ChatCompletionRequest(messages=[], logit_bias={str(t): -1.0 for t in range(300)})
    assert len(ok.logit_bias_ids("openai")) == 300
    big = ChatCompletionRequest(messages=[], logit_bias={str(t): -1.0 for t in range(301)})
    with pytest.raises(ValueError, match="logit_bias: at most 300") as e:
        big.logit_bias_ids("openai")
    err = value_error(e.value)
    assert err.status == 400 and err.param == "logit_bias"


def test_health_answers_while_a_long_tokenize_answer_is_encoded(tokenizer, monkeypatch):
    """A 10 MB prompt's answer holds millions of ids; encoding it to JSON on the loop held /health for seconds."""
    import msgspec

    from k3serve.server import app as app_module

    app = _app(tokenizer)
    gate = Gate(msgspec.json.encode)
    monkeypatch.setattr(app_module, "msgspec", SimpleNamespace(json=SimpleNamespace(encode=gate)))
    r = asyncio.run(_health_while_held(app, gate, "/tokenize", {"prompt": "hello"}))
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("hello").tolist()


def test_serve_flags_set_the_limits():
    import argparse

    from k3serve.entrypoints import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    config = serve_cli.server_config(p.parse_args(["--max-request-body-bytes", "1000", "--max-messages", "7",
                                                   "--max-prompt-chars", "99", "--max-image-pixels", "640000",
                                                   "--frontend-workers", "3"]))
    assert config.limits == RequestLimits(max_body_bytes=1000, max_messages=7, max_prompt_chars=99,
                                          frontend_workers=3)
    assert config.media.max_pixels == 640_000
    default = serve_cli.server_config(p.parse_args([]))
    assert default.limits == RequestLimits() and default.media.max_pixels == MediaLimits().max_pixels
    with pytest.raises(ValueError, match="--max-messages must be >= 1"):
        serve_cli.server_config(p.parse_args(["--max-messages", "0"]))
