"""A model whose vocabulary cannot hold the chat format's control tokens (the 2,048-id tiny test models):
one WARNING at start-up, and chat requests get a 400 naming that cause, while token-id completions work."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from k3serve.chat import K2_INSTRUCT, K3
from k3serve.server.errors import APIError
from k3serve.server.state import ServerConfig, ServerState
from k3serve.tokenizer import Tokenizer
from tests.server.conftest import Server


@pytest.mark.parametrize("fmt,variant", [(K3, "k3"), (K2_INSTRUCT, "k2")])
def test_chat_needs_the_control_tokens_in_the_vocabulary(fmt, variant):
    state = ServerState(ServerConfig(model="m", served_model_names=("tiny",)))
    state.fmt, state.tokenizer = fmt, Tokenizer.kimi(variant)
    state.client = SimpleNamespace(ready=SimpleNamespace(vocab_size=163_840))
    assert state.check_chat_vocabulary() is None  # the Kimi vocabulary (k3-tiny-fullvocab-random) chats
    state.client.ready.vocab_size = 2048
    state.no_chat = state.check_chat_vocabulary()
    assert state.no_chat == (f"its vocabulary of 2048 ids lacks the chat format's control tokens "
                             f"({fmt.stop_token} is id 163586)")
    with pytest.raises(APIError) as e:
        state.check_chat()
    assert e.value.status == 400 and e.value.param == "model" and e.value.message.startswith(
        "model 'tiny' cannot serve chat: its vocabulary of 2048 ids")


def test_small_vocabulary_server_warns_once_and_refuses_chat_with_the_cause():
    server = Server(None, "kimi-linear-tiny-random", "--max-model-len", "256")
    try:
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        anthropic = httpx.post(server.url + "/v1/messages", timeout=60,
                               json={"model": "kimi-linear-tiny-random", "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi"}]})
        ids = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": [1, 2, 3], "max_tokens": 2})
    finally:
        server.stop()
    for r in (chat, anthropic):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] != "prompt" and err["code"] == "model_cannot_chat"
        assert err["message"].startswith("model 'kimi-linear-tiny-random' cannot serve chat: its vocabulary of "
                                         "2048 ids lacks the chat format's control tokens (<|im_end|> is id 163586)")
        assert "/v1/completions with token ids" in err["message"]
    assert ids.status_code == 200, ids.text
    warnings = [line for line in server.log.read_text().splitlines() if "chat endpoints disabled" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING") and "2048 ids" in warnings[0]
