"""The router's own refusals carry the same OpenAI error object a replica sends (``core.errors``)."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from k3serve.core.errors import error_body
from k3serve.router.proxy import RouterConfig, build_app, sse_error


def test_router_refusals_are_openai_error_objects():
    app = build_app(RouterConfig(replicas=("http://127.0.0.1:9",)))
    client = TestClient(app)  # no lifespan: no health checks run, so no replica is routable
    bad = client.post("/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400
    assert bad.json() == error_body(400, "the request body is not valid JSON", "invalid_json")
    assert bad.json()["error"]["type"] == "invalid_request_error"
    down = client.post("/v1/chat/completions", json={"messages": []})
    assert down.status_code == 503
    assert down.json() == {"error": {"message": "no healthy replica", "type": "service_unavailable",
                                     "param": None, "code": "no_replica"}}


def test_mid_stream_failure_frame():
    frame = sse_error("boom")
    head, done = frame.split(b"\n\n")[:2]
    assert json.loads(head.removeprefix(b"data: ")) == error_body(500, "boom", "replica_failed")
    assert done == b"data: [DONE]"
