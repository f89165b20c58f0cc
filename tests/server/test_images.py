"""Images end to end: `image_url` data URLs are preprocessed, cross the process boundary as raw pixel bytes
and reach the vision tower of the tiny K3 (which has one): another image with the same token ids changes the
output distribution, the same image does not, the prefix cache never confuses two images, and
`usage.prompt_tokens` counts the placeholder ids the engine saw. Models without a vision tower answer 400."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import msgspec
import pytest
import torch
from PIL import Image

from k3serve.chat import K2_INSTRUCT, K3
from k3serve.engine.core import image_input
from k3serve.engine.messages import AddRequest, ImageData, encode, to_engine_decoder
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.vision_preprocess import K3_MEDIA_PROC
from k3serve.server.chat_request import prepare_chat
from k3serve.server.media import MediaLimits, engine_images, expand_media_spans
from k3serve.server.protocol import ChatCompletionRequest
from k3serve.server.state import ServerConfig, ServerState

MODEL = "tiny"
PAD = 163605
NO_THINK = {"thinking": {"type": "disabled"}}


def _png(w: int, h: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    px = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "in one word, please."}]}]


def _ask(server, url: str) -> dict:
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": _messages(url), "max_tokens": 1,
                                             "temperature": 0, "logprobs": True, "top_logprobs": 5, **NO_THINK})
    assert r.status_code == 200, r.text
    return r.json()


def _top(body: dict) -> dict[str, float]:
    return {t["token"]: t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_images_reach_the_vision_tower(openai_server):
    s = openai_server
    red, blue = _png(112, 112, 1), _png(112, 112, 2)  # 4x4 cells of 28 px: 16 vision tokens each
    tok = s.post("/tokenize", {"model": MODEL, "messages": _messages(red), **NO_THINK}).json()
    ids = tok["tokens"]
    first, n_pads = ids.index(PAD), ids.count(PAD)
    assert n_pads == 16 and ids[first:first + 16] == [PAD] * 16

    a = _ask(s, red)
    b = _ask(s, blue)  # the same token ids, another image
    again = _ask(s, red)
    assert a["usage"]["prompt_tokens"] == len(ids) == b["usage"]["prompt_tokens"]
    top_a, top_b, top_again = _top(a), _top(b), _top(again)
    assert top_a != top_b  # the pixels changed the model's distribution
    assert top_a.keys() == top_again.keys()
    assert all(abs(top_a[k] - top_again[k]) < 1e-4 for k in top_a)
    # the prefix cache: the repeat reuses blocks past the image; the other image could reuse none of it
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] <= first
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first + n_pads


def _state(fmt, supports_images: bool) -> ServerState:
    from k3serve.tokenizer import Tokenizer

    ready = SimpleNamespace(supports_images=supports_images, max_model_len=4096, vocab_size=163840)
    return ServerState(config=ServerConfig(model="m", media=MediaLimits()), client=SimpleNamespace(ready=ready),
                       tokenizer=Tokenizer.kimi("k3" if fmt is K3 else "k2"), fmt=fmt, contract="openai")


@pytest.mark.parametrize("fmt", [K2_INSTRUCT, K3])
def test_text_only_models_refuse_images(fmt):
    req = ChatCompletionRequest(messages=_messages(_png(28, 28, 0)))
    with pytest.raises(ValueError, match="takes text only"):
        asyncio.run(prepare_chat(_state(fmt, supports_images=False), req))


def test_chat_job_carries_pixels_to_the_engine_message():
    job = asyncio.run(prepare_chat(_state(K3, supports_images=True),
                                   ChatCompletionRequest(messages=_messages(_png(56, 84, 3)))))
    (img,) = job.images
    assert job.prompt_ids[img.offset:img.offset + img.length] == [PAD] * 6 and job.prompt_ids.count(PAD) == 6
    assert img.grid_thw == [1, 6, 4] and img.shape == [24, 3, 14, 14] and img.dtype == "float32"
    msg = AddRequest("r", job.prompt_ids, SamplingParams(), images=job.images)
    raw = encode(msg)
    back = to_engine_decoder.decode(raw)
    assert back == msg and raw[:1] != b"\x80"  # msgpack, no pickle
    engine_side = image_input(back.images[0])
    assert engine_side.pixel_patches.shape == (24, 3, 14, 14) and engine_side.grid_thw == (1, 6, 4)
    with pytest.raises(ValueError, match="do not fill shape"):
        image_input(msgspec.structs.replace(img, shape=[25, 3, 14, 14]))
    with pytest.raises(ValueError, match="pixel dtype"):
        image_input(msgspec.structs.replace(img, dtype="int8"))


def test_expand_spans_and_preprocess_agree():
    ids, spans = expand_media_spans([1, PAD, 2, PAD], [3, 2])
    assert ids == [1, PAD, PAD, PAD, 2, PAD, PAD] and spans == [(1, 3), (5, 2)]
    img = Image.new("RGB", (56, 84))
    (data,) = asyncio.run(engine_images([img], [(0, 6)], K3_MEDIA_PROC))
    assert isinstance(data, ImageData) and len(data.pixels) == 24 * 3 * 14 * 14 * 4
    with pytest.raises(ValueError, match="vision tokens after preprocessing"):
        asyncio.run(engine_images([img], [(0, 5)], K3_MEDIA_PROC))
