"""Hand-offs of requests with images and with logits processors (json_schema grammar, logit_bias), in one
process (fp32, tiny models): the same tokens and logprobs as one engine doing both. The decode side keys its
blocks with the images' content as the prefill side does, so a prefix hit skips only what it really holds
and two images behind the same placeholder ids never share latents; its grammar continues from the first
token the prefill side sampled under it."""

from __future__ import annotations

import json

import pytest
import torch

from k3serve.engine.guided import GuidedDecoding
from k3serve.engine.multimodal import ImageInput
from k3serve.engine.pd.manifest import HandoffError
from k3serve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=20)


def _image_prompt(config, seed: int, text: list[int], tail: list[int]) -> tuple[list[int], list[ImageInput]]:
    """``text``, one 16-placeholder image (grid 1x8x8) made from ``seed``, then ``tail``."""
    pixels = torch.randn(64, 3, 14, 14, generator=torch.Generator().manual_seed(seed))
    image = ImageInput(len(text), 16, pixel_patches=pixels, grid_thw=(1, 8, 8))
    return text + [config.media_placeholder_token_id] * 16 + tail, [image]


def test_images_hand_off_and_key_the_decode_prefix_cache(tiny, pd):
    _, config = tiny
    both, p, d = (pd.make_engine(tiny, max_num_batched_tokens=16) for _ in range(3))
    text, tail, more = pd.prompts(3, 20, 20, seed=31)
    a, a_images = _image_prompt(config, 1, text, tail)  # 56 tokens: block 0 text, blocks 1-2 hold the image
    pd.same(pd.disaggregated(p, d, "a", a, GREEDY, images=a_images),
            pd.colocated(both, "a", a, GREEDY, images=a_images))

    # a second turn: d holds a's 3 full blocks (image included), so only the rest crosses
    b, b_images = _image_prompt(config, 1, text, tail + more)
    pd.prefill(p, "b", b, GREEDY, images=b_images)
    first, manifest, _ = pd.transfer(p, d, "b", b, GREEDY, images=tuple(b_images))
    assert manifest.start == 48
    pd.same(pd.drain(d, {"b": [first]})["b"], pd.colocated(both, "b", b, GREEDY, images=b_images))

    # another image behind the same placeholder ids: only the text block before it is a hit
    c, c_images = _image_prompt(config, 2, text, tail)
    assert c == a
    pd.prefill(p, "c", c, GREEDY, images=c_images)
    first, manifest, _ = pd.transfer(p, d, "c", c, GREEDY, images=tuple(c_images))
    assert manifest.start == 16
    want = pd.colocated(both, "c", c, GREEDY, images=c_images)
    assert want[-1].token_ids != pd.colocated(both, "a2", a, GREEDY, images=a_images)[-1].token_ids
    pd.same(pd.drain(d, {"c": [first]})["c"], want)

    # a decode request naming other images than the prefill side used is refused, and frees what it took
    pd.prefill(p, "x", c, GREEDY, images=c_images)
    with pytest.raises(HandoffError, match="its images differ"):
        pd.transfer(p, d, "x", c, GREEDY, images=tuple(a_images))
    assert pd.pools_full(p) and not d.scheduler.held and not d.scheduler.requests


def test_logit_bias_continues_on_the_decode_side(tiny, pd):
    both, p, d = (pd.make_engine(tiny) for _ in range(3))
    gd = GuidedDecoding(both.vocab_size, both.eos_token_ids[0], enabled=False)
    bias = {7: 30.0, 11: 29.0}
    prompt = pd.prompts(1, 30, 30, seed=32)[0]
    want = pd.colocated(both, "r", prompt, GREEDY, logits_processor=gd.processor(None, bias, "r"))
    assert set(want[-1].token_ids) <= {7, 11}
    got = pd.disaggregated(p, d, "r", prompt, GREEDY,
                           processors=(gd.processor(None, bias, "p"), gd.processor(None, bias, "d")))
    pd.same(got, want)


def test_json_schema_continues_on_the_decode_side(fullvocab, pd):
    both, p, d = (pd.make_engine(fullvocab, max_num_batched_tokens=16) for _ in range(3))
    gd = GuidedDecoding(both.vocab_size, both.eos_token_ids[0], enabled=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    grammar = json.dumps({"grammars": [{"json_schema": schema}]})
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    prompt = pd.prompts(1, 37, 37, seed=33)[0]
    want = pd.colocated(both, "r", prompt, params, logits_processor=gd.processor(grammar, {}, "r"))
    plain = pd.colocated(both, "plain", prompt, params)
    assert want[-1].token_ids != plain[-1].token_ids  # the grammar shapes this output
    got = pd.disaggregated(p, d, "r", prompt, params,
                           processors=(gd.processor(grammar, {}, "p"), gd.processor(grammar, {}, "d")))
    pd.same(got, want)
    assert not gd.take_failures()
