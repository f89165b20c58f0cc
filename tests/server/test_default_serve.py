"""`k3serve serve` with no argument: the README's first command serves the trained default model, and the
README's example request gets the tool call the README shows (issue 6, acceptance 3)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from k3serve.models.registry import TRAINED_MODELS
from tests.server.conftest import Server

pytestmark = pytest.mark.skipif("k3-default" not in TRAINED_MODELS, reason="k3-default weights are not shipped")
README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_example() -> tuple[dict, dict]:
    """The README's first example: the curl request body and the assistant message shown after it."""
    text = README.read_text()
    body = re.search(r"-d '(\{.*?\})'\n```", text)
    shown = re.search(r"```json\n(.*?)```", text, flags=re.S)
    assert body and shown, "README lost its example request/response"
    return json.loads(body.group(1)), json.loads(shown.group(1))


def test_default_serve_answers_the_readme_example():
    body, shown = _readme_example()
    server = Server(None)
    try:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["k3-default"]
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in shown["tool_calls"]]
        assert got == want
        assert msg["reasoning_content"] == shown["reasoning_content"]
    finally:
        server.stop()


def test_readme_thinking_off_request_turns_thinking_off():
    """The API section's per-request switch, as written there, gives an answer without reasoning."""
    body, shown = _readme_example()
    switch = re.search(r'`"chat_template_kwargs": (\{.*?\})`', README.read_text())
    assert switch, "README lost how to turn thinking off"
    server = Server(None)
    try:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={**body, "chat_template_kwargs": json.loads(switch.group(1))}, timeout=120)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert not msg.get("reasoning_content")
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["book_hotel"]
    finally:
        server.stop()
