"""Pieces without a server: typed messages, request models, media, the serve CLI's flag checks."""

from __future__ import annotations

import asyncio
import base64
import io

import msgspec
import pytest
from PIL import Image

from k3serve.engine.messages import (
    AbortRequest,
    AddRequest,
    Output,
    Outputs,
    Stats,
    encode,
    from_engine_decoder,
    to_engine_decoder,
)
from k3serve.engine.sampling_params import SamplingParams
from k3serve.server.media import MediaLimits, expand_media_pads, load_images
from k3serve.server.protocol import ChatCompletionRequest


def test_messages_round_trip_without_pickle():
    add = AddRequest("r-1", [1, 2, 3], SamplingParams(temperature=0.6, seed=5, max_tokens=9, stop=["x"]), grammar="start: \"a\"",
                     logit_bias={7: 1.5})
    raw = encode(add)
    assert b"pickle" not in raw and raw[:1] != b"\x80"  # msgpack map, not a pickle stream
    assert to_engine_decoder.decode(raw) == add
    assert to_engine_decoder.decode(encode(AbortRequest(["a", "b"]))) == AbortRequest(["a", "b"])
    out = Outputs([Output("r-1", [5], logprobs=[{5: -0.1, 6: -2.0}], finished=True, finish_reason="stop",
                          stop_reason=5)], Stats(num_running=1))
    assert from_engine_decoder.decode(encode(out)) == out
    with pytest.raises(msgspec.ValidationError):
        to_engine_decoder.decode(msgspec.msgpack.encode({"type": "add", "request_id": 3}))
    assert type(add.params) is SamplingParams and add.params.seed == 5 and add.params.stop == ("x",)


def test_sampling_params_cross_the_boundary_checked():
    """The engine's own SamplingParams is the wire form; decoding it runs its checks again."""
    good = encode(AddRequest("r", [1], SamplingParams(top_k=3)))
    bad = good.replace(b"\xa5top_k\x03", b"\xa5top_k\xfe")  # top_k -2 on the wire
    assert bad != good and to_engine_decoder.decode(good).params.top_k == 3
    with pytest.raises(msgspec.ValidationError, match="top_k:"):
        to_engine_decoder.decode(bad)


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw)


def test_kimi_contract_fixes_sampling():
    s = chat().to_sampling_params("kimi", thinking=True, prompt_len=10, max_model_len=100)
    assert (s.temperature, s.top_p, s.max_tokens) == (1.0, 0.95, 90)
    assert chat().to_sampling_params("kimi", thinking=False, prompt_len=10, max_model_len=100).temperature == 0.6
    for bad in ({"temperature": 0.7}, {"top_p": 0.9}, {"n": 3}, {"presence_penalty": 0.1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            chat(**bad).to_sampling_params("kimi", thinking=True, prompt_len=1, max_model_len=100)
    s = chat(temperature=1.7, top_p=0.5, n=3).to_sampling_params("openai", thinking=True, prompt_len=1,
                                                                  max_model_len=100)
    assert (s.temperature, s.top_p) == (1.7, 0.5)


def test_thinking_controls():
    assert chat().thinking_mode(True) == (True, "max")
    assert chat(thinking={"type": "disabled"}).thinking_mode(True)[0] is False
    assert chat(thinking={"effort": "low"}, reasoning_effort="high").thinking_mode(False) == (True, "low")
    assert chat(reasoning_effort="high").thinking_mode(True) == (True, "high")
    assert chat(chat_template_kwargs={"thinking": False}).thinking_mode(True)[0] is False
    with pytest.raises(ValueError, match="keep"):
        chat(thinking={"type": "enabled", "keep": "none"}).thinking_mode(True)
    with pytest.raises(ValueError, match="max_tokens"):
        chat(max_tokens=3, max_completion_tokens=4).completion_budget()


def _data_url(w, h, fmt="PNG"):
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def test_media_limits():
    asyncio.run(_media_limits())


async def _media_limits():
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(30, 20)}}]}]
    imgs = await load_images(msg, MediaLimits())
    assert imgs[0].size == (30, 20)
    with pytest.raises(ValueError, match="at most 0 images"):
        await load_images(msg, MediaLimits(max_images=0))
    with pytest.raises(ValueError, match="larger than"):
        await load_images(msg, MediaLimits(max_image_bytes=10))
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x.org/a.png"}}]}]
    with pytest.raises(ValueError, match="not allowed"):
        await load_images(bad, MediaLimits())
    assert expand_media_pads([1, 163605, 2, 163605], [3, 1]) == [1, 163605, 163605, 163605, 2, 163605]
    with pytest.raises(ValueError):
        expand_media_pads([163605], [])


def test_cli_help_and_unsupported_flags(capsys):
    from k3serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--api-contract" in out and "--max-model-len" in out and "--allowed-media-domains" in out
    for flags, why in ((["--pipeline-parallel-size", "2"], "not supported yet"),
                       (["--kv-cache-dtype", "fp8"], "not supported yet"),
                       (["--tensor-parallel-size", "3"], "cannot be split over 3 ranks"),
                       (["--nnodes", "2"], "cannot be spread evenly"),
                       (["-tp", "2", "--nnodes", "2"], "needs --master-addr"),
                       (["-tp", "2", "--nnodes", "2", "-dp", "3"], "-size 3 cannot be spread evenly over --nnodes 2"),
                       (["-tp", "2", "--nnodes", "2", "-dp", "2", "--enable-expert-parallel"], "needs --master-addr"),
                       (["-dp", "2", "--data-parallel-rpc-port", "29550"], "need --data-parallel-size D and --nnodes"),
                       (["-dp", "4", "--nnodes", "2", "--data-parallel-rpc-port", "65533"], "ports 65533..65536"),
                       (["-tp", "2", "--nnodes", "2", "--master-addr", "h", "--node-rank", "2"], "--node-rank 2"),
                       (["-tp", "2", "--eplb-interval", "8"], "need --enable-expert-parallel"),
                       (["-tp", "2", "--tp-pieces", "3"], "--tp-pieces 3: must be 1 or a multiple"),
                       (["-tp", "2", "--enable-expert-parallel", "--eplb-redundant-experts", "2"],
                        "needs --eplb-interval"),
                       (["-tp", "2", "--enable-expert-parallel", "--eplb-interval", "8", "--eplb-redundant-experts",
                         "1"], "cannot be split evenly over 2 ranks")):
        assert main(["serve", *flags]) != 0
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (flags, err)
    assert main(["serve", "/no/such/model"]) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
