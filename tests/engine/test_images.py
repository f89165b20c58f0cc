"""Image inputs through the engine (tiny K3 with a vision tower, fp32, greedy): outputs equal a straight
full-prefill forward of the model with the same image embeddings, whatever the chunk size (chunks split
images), with prefix caching on and off and under preemption; different images never share cache; the
tower runs once per request; bad image inputs are refused with a clear ValueError."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.multimodal import ImageInput, chain_hashes, placeholder_runs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.cache import cache_spec
from k3serve.models.generate import SimpleRunner

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def k3(eh):
    return eh.get_model("k3-tiny-random")


def _pixels(seed: int, h: int, w: int) -> torch.Tensor:
    return torch.randn(h * w, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def _text(seed: int, n: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(pad: int, parts: list) -> tuple[list[int], list[ImageInput]]:
    """``parts``: token lists and (seed, h, w) images (grid (1, h, w) -> h*w/4 placeholders)."""
    ids: list[int] = []
    images = []
    for p in parts:
        if isinstance(p, tuple):
            seed, h, w = p
            n = h * w // 4
            images.append(ImageInput(len(ids), n, pixel_patches=_pixels(seed, h, w), grid_thw=(1, h, w)))
            ids += [pad] * n
        else:
            ids += p
    return ids, images


def _reference(model, ids: list[int], images: list[ImageInput]) -> list[int]:
    """Straight greedy decode: one full-prefill forward with the request's image embeddings, then decode."""
    with torch.inference_mode():
        emb = None
        if images:
            emb = model.embed_images(torch.cat([im.pixel_patches for im in images]),
                                     torch.tensor([im.grid_thw for im in images]))
        runner = SimpleRunner(model, max_seqs=1, max_len=len(ids) + MAX_NEW)
        logits = runner.step({0: ids}, image_embeds=emb)
        out = []
        while True:
            out.append(int(logits[0].argmax()))
            if len(out) == MAX_NEW:
                return out
            logits = runner.step({0: [out[-1]]})


@pytest.fixture(scope="module")
def cases(k3):
    model, cfg = k3
    pad = cfg.media_placeholder_token_id
    specs = {
        "x": [_text(1, 10), (11, 8, 8), _text(2, 14)],  # 10 + 16 + 14 = 40 tokens
        "y": [_text(1, 10), (12, 8, 8), _text(2, 14)],  # same ids, another image
        "two": [_text(3, 5), (13, 4, 4), _text(4, 3), (14, 4, 8), _text(5, 20)],
        "text": [_text(6, 23)],
        "pad-without-image": [_text(7, 4), [pad, pad], _text(8, 5)],  # placeholder ids used as plain text
    }
    out = {}
    for name, parts in specs.items():
        ids, images = _request(pad, parts)
        out[name] = (ids, images, _reference(model, ids, images))
    return out


def _run(engine, cases, names, prefix=""):
    for name in names:
        ids, images, _ = cases[name]
        engine.add_request(prefix + name, ids, GREEDY, images=images)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return {name: done[prefix + name] for name in names}


def test_images_change_the_output(cases):
    assert cases["x"][0] == cases["y"][0] and cases["x"][2] != cases["y"][2]


@pytest.mark.parametrize(("chunk", "caching"), [(7, True), (13, False), (512, True), (512, False)])
def test_matches_full_prefill(k3, cases, eh, monkeypatch, chunk, caching):
    model, _ = k3
    calls = []
    real = model.embed_images
    monkeypatch.setattr(model, "embed_images", lambda *a: calls.append(1) or real(*a), raising=False)
    engine = eh.make_engine(k3, max_num_batched_tokens=chunk, enable_prefix_caching=caching)
    names = list(cases)
    got = _run(engine, cases, names)
    assert {n: o.token_ids for n, o in got.items()} == {n: cases[n][2] for n in names}
    assert len(calls) == 3  # once per request with pixel images, however many chunks it took


def test_different_images_never_share_cache(k3, cases, eh):
    engine = eh.make_engine(k3)
    first = _run(engine, cases, ["x"], "1-")["x"]
    other = _run(engine, cases, ["y"], "2-")["y"]  # same token ids, another image
    ids, images, want = cases["x"]
    again = [ImageInput(im.offset, im.length, pixel_patches=im.pixel_patches.clone(), grid_thw=im.grid_thw)
             for im in images]  # equal content in fresh tensors
    engine.add_request("3-x", ids, GREEDY, images=again)
    same = eh.drain(engine)["3-x"]
    assert first.token_ids == same.token_ids == want and other.token_ids == cases["y"][2]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert same.num_cached_tokens == 32  # the snapshot at the prompt's last full block, past the image


def test_preemption_with_images(k3, cases, eh):
    spec = cache_spec(k3[0], torch.float32)
    engine = eh.make_engine(k3, max_num_seqs=8, max_model_len=64, enable_prefix_caching=False,
                            max_num_batched_tokens=24,
                            kv_cache_memory=8 * spec.kda_bytes_per_slot + 7 * 16 * spec.mla_bytes_per_token)
    names = ["x", "y", "two", "text", "x"]
    for i, name in enumerate(names):
        ids, images, _ = cases[name]
        engine.add_request(f"{i}", ids, GREEDY, images=images)
    done = eh.drain(engine)
    assert [done[f"{i}"].token_ids for i in range(len(names))] == [cases[n][2] for n in names]
    assert engine.stats().num_preemptions > 0


def test_image_hashes(cases):
    ids, images, _ = cases["x"]
    _, other, _ = cases["y"]
    a, b = chain_hashes(ids, 0, 16, None, images), chain_hashes(ids, 0, 16, None, other)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # both blocks overlap the image at [10, 26)
    assert chain_hashes(ids, 1, 16, a[0], images) == a[1:]  # incremental extension agrees
    text_ids, _, _ = cases["text"]
    from k3serve.core.hashing import hash_blocks

    assert chain_hashes(text_ids, 0, 4, None, []) == hash_blocks(text_ids, 4)
    # content hash: equal content in another tensor gives the same key, the grid is part of it
    im = images[0]
    assert ImageInput(im.offset, im.length, pixel_patches=im.pixel_patches.clone(), grid_thw=(1, 8, 8)).hash == im.hash
    assert ImageInput(im.offset, im.length, pixel_patches=im.pixel_patches, grid_thw=(1, 4, 16)).hash != im.hash
    assert placeholder_runs([1, 9, 9, 2, 9], 9) == [(1, 2), (4, 1)]


def test_bad_image_inputs(k3, cases, eh):
    engine = eh.make_engine(k3)
    ids, images, _ = cases["x"]
    im = images[0]
    bad = {
        "must all be the media placeholder": ImageInput(im.offset + 1, im.length, im.pixel_patches, im.grid_thw),
        "is not inside": ImageInput(30, 16, im.pixel_patches, im.grid_thw),
        "gives 16 vision tokens": ImageInput(im.offset, 8, im.pixel_patches, im.grid_thw),
        "pixel_patches must be": ImageInput(im.offset, im.length, im.pixel_patches[:10], im.grid_thw),
        "embeds must be": ImageInput(im.offset, im.length, embeds=torch.zeros(16, 7)),
    }
    for msg, image in bad.items():
        with pytest.raises(ValueError, match=msg):
            engine.add_request("bad", ids, GREEDY, images=[image])
    with pytest.raises(ValueError, match="not both or neither"):
        ImageInput(0, 1)
    text_engine = eh.make_engine(eh.get_model("kimi-linear-tiny-random"))
    with pytest.raises(ValueError, match="no vision tower"):
        text_engine.add_request("t", [1, 2, 3], GREEDY, images=[ImageInput(0, 1, embeds=torch.zeros(1, 8))])
    assert not engine.has_unfinished_requests()


def test_precomputed_embeddings(k3, cases, eh):
    model, _ = k3
    ids, images, want = cases["two"]
    with torch.inference_mode():
        emb = model.embed_images(torch.cat([im.pixel_patches for im in images]),
                                 torch.tensor([im.grid_thw for im in images]))
    rows = emb.split([im.length for im in images])
    engine = eh.make_engine(k3, max_num_batched_tokens=7)
    engine.add_request("e", ids, GREEDY, images=[ImageInput(im.offset, im.length, embeds=r)
                                                 for im, r in zip(images, rows)])
    assert eh.drain(engine)["e"].token_ids == want
