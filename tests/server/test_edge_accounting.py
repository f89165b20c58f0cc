"""Issue 50 finding 9: every error status a client gets is counted in /metrics (401s refused before any
route, and 500s, which FastAPI answers outside every middleware); the API key can come from the
environment, so `ps` never shows it (also not in the replicas' argv). The app runs in-process (httpx's
ASGI transport) with a stand-in engine client."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from k3serve.server.metrics import Metrics
from k3serve.server.state import ServerConfig
from tests.server.conftest import in_process_app


def _app(api_key: str | None = None):
    app = in_process_app(ServerConfig(model="m", served_model_names=("tiny",), access_log=False, api_key=api_key))
    app.state.k3.metrics = Metrics("tiny", lambda: None, lambda: 0)
    return app


async def _calls(app, calls):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://test") as c:
        out = [await c.request(method, path, **kw) for method, path, kw in calls]
        return out, (await c.get("/metrics")).text


def _count(metrics: str, status: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("k3serve:http_errors_total{") and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_500_is_an_error_object_and_counted():
    app = _app()

    def broken(*a, **kw):
        raise RuntimeError("a bug")

    app.state.k3.tokenizer = SimpleNamespace(encode=broken)
    (r,), metrics = asyncio.run(_calls(app, [("POST", "/tokenize", {"json": {"prompt": "hi"}})]))
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "a bug" not in r.text  # the exception's type is named, its text (maybe input) is not
    assert _count(metrics, "500") == 1


def test_401s_and_400s_are_counted():
    app = _app(api_key="k")
    app.state.k3.tokenizer = SimpleNamespace(encode=lambda s, special: np.array([1, 2], dtype=np.uint32))
    calls = [("POST", "/tokenize", {"json": {"prompt": "hi"}}),
             ("POST", "/tokenize", {"json": {"prompt": "hi"}, "headers": {"Authorization": "Bearer wrong"}}),
             ("POST", "/tokenize", {"json": {"prompt": 5}, "headers": {"Authorization": "Bearer k"}}),
             ("POST", "/tokenize", {"json": {"prompt": "hi"}, "headers": {"x-api-key": "k"}})]
    rs, metrics = asyncio.run(_calls(app, calls))
    assert [r.status_code for r in rs] == [401, 401, 400, 200]
    assert _count(metrics, "401") == 2 and _count(metrics, "400") == 1


def _args(argv):
    from k3serve.entrypoints.serve_cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("env, argv, key", [("from-env", [], "from-env"), ("from-env", ["--api-key", "flag"], "flag"),
                                            (None, [], None), ("", [], None)])
def test_the_api_key_comes_from_the_environment(monkeypatch, env, argv, key):
    from k3serve.entrypoints.serve_cli import API_KEY_ENV, server_config

    if env is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env)
    assert server_config(_args(["k3-tiny-random", *argv])).api_key == key
