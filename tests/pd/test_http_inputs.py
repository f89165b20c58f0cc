"""Prefill/decode through HTTP with the inputs that change what a hand-off carries: images and structured
outputs (json_schema), on k3-tiny with the full Kimi vocabulary (random weights, a vision tower; its chat
template and grammar need the real special ids). Through 1P1D (`route --prefill --decode`) and 2P2D
(`serve --prefill-replicas 2 --decode-replicas 2`) the answers equal a single `both` server's: the same text and
tokens, top-20 logprobs within 1e-5, with chunked prefill (16-token chunks on every server). A second turn
sharing the image's prefix is a prefix hit on the decode worker (its handoff_cached_tokens metric grows: those
positions' latents did not cross). After every request the prefill workers hold nothing.

Requests go one at a time: what is compared is the hand-off, not batching (a batch of other shapes may move
logprobs by a few ulps on any server, P/D or not)."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from tests.pd.cluster import chat, cluster, metric, pools_back, prefill_workers, same_chat

pytestmark = pytest.mark.slow  # 4 servers + a 2P2D set (16 processes): a minute idle, several on a loaded box
MODEL = "k3-tiny-fullvocab-random"
ENGINE = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
          "--gpu-memory-utilization", "0.05"]
GREEDY = {"model": MODEL, "temperature": 0, "logprobs": True, "top_logprobs": 20, "thinking": {"type": "disabled"}}


def _png(seed: int, size: int = 112) -> str:
    g = torch.Generator().manual_seed(seed)
    px = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_turn(seed: int, question: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "Here is a picture of a market street taken early in the morning."},
        {"type": "image_url", "image_url": {"url": _png(seed)}},
        {"type": "text", "text": question}]}]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    with cluster(MODEL, ENGINE, tmp_path_factory.mktemp("pd_inputs") / "servers.log") as u:
        yield u


@pytest.mark.parametrize("setup", ["router", "pd22"])
def test_images_equal_one_server(urls, setup):
    first = GREEDY | {"messages": _image_turn(1, "What is in it?"), "max_tokens": 6, "ignore_eos": True}
    # the same image and text, then more: the decode worker that ran `first` holds its full blocks
    second = GREEDY | {"messages": _image_turn(1, "What is in it? Answer with the colour of the awning, "
                                                  "then the number of people you can see."),
                       "max_tokens": 6, "ignore_eos": True}
    other = GREEDY | {"messages": _image_turn(2, "What is in it?"), "max_tokens": 6, "ignore_eos": True}
    decode = urls["decode"]
    before = metric(decode, "k3serve:handoff_cached_tokens_total") if setup == "router" else 0
    for body in (first, second, other):
        got, want = chat(urls[setup], body), chat(urls["both"], body)
        same_chat(got, want)
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        pools_back(prefill_workers(urls, setup))
        if setup == "router" and body is first:
            after_first = metric(decode, "k3serve:handoff_cached_tokens_total")
        if setup == "router" and body is second:  # a prefix hit on the decode side: fewer positions crossed
            after_second = metric(decode, "k3serve:handoff_cached_tokens_total")
    if setup == "router":
        assert after_first == before  # nothing of this image was held yet
        assert after_second - after_first >= 16  # at least one full block (the prompt's start) stayed home
    # the other image behind the same placeholder ids changed the answer's distribution: the pixels crossed
    a = chat(urls[setup], first)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    b = chat(urls[setup], other)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert a != b


@pytest.mark.parametrize("setup", ["router", "pd22"])
def test_json_schema_equals_one_server(urls, setup):
    import json

    body = GREEDY | {"messages": [{"role": "user", "content": "Give me a fruit and how many you have, as JSON."}],
                     "max_tokens": 40,
                     "response_format": {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA}}}
    got, want = chat(urls[setup], body), chat(urls["both"], body)
    same_chat(got, want)
    if got["choices"][0]["finish_reason"] == "stop":  # the grammar ended it: the whole object is there
        out = json.loads(got["choices"][0]["message"]["content"])
        assert set(out) == {"name", "count"} and isinstance(out["count"], int)
    pools_back(prefill_workers(urls, setup))
