"""Prefill on one engine, decode on another, in one process: the same tokens and logprobs as one engine
doing both (fp32, k3-tiny), with chunked prefill, seeded sampling and decode-side prefix hits; a corrupt,
zeroed, partial or foreign hand-off fails with a clear error and frees what it took."""

from __future__ import annotations

import re

import msgspec
import pytest

from k3serve.engine.pd.handoff import export, held_hashes, import_manifest, reserve
from k3serve.engine.pd.manifest import checksum
from k3serve.engine.pd.manifest import HandoffError
from k3serve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20)


def assert_same(a: list, b: list) -> None:
    assert a[-1].token_ids == b[-1].token_ids
    assert [o.delta_token_ids for o in a] == [o.delta_token_ids for o in b]
    la, lb = a[-1].logprobs, b[-1].logprobs
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert list(x) == list(y)  # same top-20 ids, same order
        assert max(abs(x[k] - y[k]) for k in x) <= 1e-5


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=8,
                                                           ignore_eos=True, logprobs=3)], ids=["greedy", "seeded"])
def test_disaggregated_equals_colocated_with_chunked_prefill(tiny, pd, params):
    both = pd.make_engine(tiny, max_num_batched_tokens=16)
    p, d = pd.make_engine(tiny, max_num_batched_tokens=16), pd.make_engine(tiny, max_num_batched_tokens=16)
    for i, prompt in enumerate(pd.prompts(3, 5, 70, seed=1)):
        want = pd.colocated(both, f"r{i}", prompt, params)
        got = pd.disaggregated(p, d, f"r{i}", prompt, params)
        assert_same(got, want)
    assert pd.pools_full(p)


def test_k3_default_disaggregated_equals_colocated(default, pd):
    """The trained model, chunked prefill, and a second turn that hits the decode side's prefix cache."""
    both = pd.make_engine(default, max_num_batched_tokens=16)
    p, d = pd.make_engine(default, max_num_batched_tokens=16), pd.make_engine(default, max_num_batched_tokens=16)
    first = pd.prompts(1, 45, 45, seed=21)[0]
    second = first + pd.prompts(1, 20, 20, seed=22)[0]
    assert_same(pd.disaggregated(p, d, "a", first, GREEDY), pd.colocated(both, "a", first, GREEDY))
    pd.prefill(p, "b", second, GREEDY)
    out, manifest, _ = pd.transfer(p, d, "b", second, GREEDY)
    assert manifest.start == 32  # d holds the 2 full blocks it imported for "a"
    assert_same(pd.drain(d, {"b": [out]})["b"], pd.colocated(both, "b", second, GREEDY))


def test_a_prompt_of_zero_embeddings_hands_off(default, pd):
    """k3-default leaves unused vocabulary rows at zero: such a prompt zeroes every KDA layer's state and
    window legitimately, and must not be refused as a lost state."""
    emb = next(m.weight for n, m in default[0].named_modules() if n.endswith("embed_tokens"))
    zero_ids = (emb.abs().sum(1) == 0).nonzero().flatten()[:40].tolist()
    assert len(zero_ids) == 40
    both, p, d = (pd.make_engine(default) for _ in range(3))
    assert_same(pd.disaggregated(p, d, "z", zero_ids, GREEDY), pd.colocated(both, "z", zero_ids, GREEDY))


def _zero_one_layer(manifest, payloads):
    # state and window of one layer zeroed at the source (checksums recomputed): the other layers give it away
    items, payloads = list(manifest.items), list(payloads)
    layer = next(it.name for it in items if it.name.startswith("kda_state.")).removeprefix("kda_state.")
    for k, it in enumerate(items):
        if it.name in (f"kda_state.{layer}", f"kda_conv.{layer}"):
            payloads[k] = bytes(len(payloads[k]))
            items[k] = type(it)(it.name, it.dtype, it.shape, checksum(payloads[k]))
    return msgspec.structs.replace(manifest, items=items), payloads


def test_decode_side_prefix_hit_skips_the_blocks_it_holds(tiny, pd):
    both, p, d = (pd.make_engine(tiny) for _ in range(3))
    first, second = pd.prompts(2, 40, 40, seed=2)
    second = first + second  # shares 2 full blocks (of 16) with the first prompt
    pd.colocated(both, "a", first, GREEDY)
    pd.disaggregated(p, d, "a", first, GREEDY)
    want = pd.colocated(both, "b", second, GREEDY)
    pd.prefill(p, "b", second, GREEDY)
    out, manifest, _ = pd.transfer(p, d, "b", second, GREEDY)
    assert manifest.start == 32
    mla = next(it for it in manifest.items if it.name.startswith("mla."))
    assert mla.shape[0] == len(second) - 32
    got = pd.drain(d, {"b": [out]})["b"]
    assert_same(got, want)


def _flip(name_prefix: str):
    def tamper(manifest, payloads):
        i = next(k for k, it in enumerate(manifest.items) if it.name.startswith(name_prefix))
        data = bytearray(payloads[i])
        data[len(data) // 2] ^= 0x01
        return manifest, [*payloads[:i], bytes(data), *payloads[i + 1:]]
    return tamper


def _zero_state(manifest, payloads):
    # zeroed at the source: the checksum is recomputed, so only the state check can see it
    items = list(manifest.items)
    i = next(k for k, it in enumerate(items) if it.name.startswith("kda_state."))
    zero = bytes(len(payloads[i]))
    items[i] = type(items[i])(items[i].name, items[i].dtype, items[i].shape, checksum(zero))
    return msgspec.structs.replace(manifest, items=items), [*payloads[:i], zero, *payloads[i + 1:]]


def _drop(prefix: str):
    def tamper(manifest, payloads):
        drop = next(k for k, it in enumerate(manifest.items) if it.name.startswith(prefix))
        keep = [k for k in range(len(manifest.items)) if k != drop]
        return (msgspec.structs.replace(manifest, items=[manifest.items[k] for k in keep]),
                [payloads[k] for k in keep])
    return tamper


def _foreign(manifest, payloads):
    return msgspec.structs.replace(manifest, fingerprint="0" * 32), payloads


@pytest.mark.parametrize("tamper,message", [
    (_flip("kda_state."), "corrupt (checksum mismatch)"), (_flip("kda_conv."), "corrupt"),
    (_flip("mla."), "corrupt"), (_zero_state, "arrived all zeros"), (_zero_one_layer, "arrived all zeros"),
    (_drop("kda_conv."), "missing ['kda_conv."), (_foreign, "another model"),
], ids=["state-bit", "conv-bit", "mla-bit", "zeroed-state", "zeroed-layer", "missing-conv", "foreign"])
def test_a_bad_handoff_fails_closed_and_frees_the_reservation(tiny, pd, tamper, message):
    p, d = pd.make_engine(tiny), pd.make_engine(tiny)
    prompt = pd.prompts(1, 37, 37, seed=3)[0]
    pd.prefill(p, "r", prompt, GREEDY)
    with pytest.raises(HandoffError, match=re.escape(message)):
        pd.transfer(p, d, "r", prompt, GREEDY, tamper=tamper)
    assert pd.pools_full(d) and pd.pools_full(p)


def test_zeroed_state_negative_control_changes_the_output(tiny, pd):
    """The parity check can see a lost state: decoding from a zeroed KDA state (skipping the checks) differs."""
    both, p, d = (pd.make_engine(tiny) for _ in range(3))
    prompt = pd.prompts(1, 37, 37, seed=4)[0]
    want = pd.colocated(both, "r", prompt, GREEDY)
    pd.prefill(p, "r", prompt, GREEDY)
    out, _, _ = pd.transfer(p, d, "r", prompt, GREEDY)
    for t in d.runner.caches.kda_state.values():
        t.zero_()
    got = pd.drain(d, {"r": [out]})["r"]
    assert got[-1].token_ids != want[-1].token_ids or any(
        abs(x[k] - y.get(k, 0.0)) > 1e-3 for x, y in zip(got[-1].logprobs, want[-1].logprobs) for k in x)


def test_export_refuses_a_state_that_was_never_written(tiny, pd):
    p, d = pd.make_engine(tiny), pd.make_engine(tiny)
    prompt = pd.prompts(1, 20, 20, seed=5)[0]
    pd.prefill(p, "r", prompt, GREEDY)
    for t in p.runner.caches.kda_state.values():
        t.zero_()
    with pytest.raises(HandoffError, match="all zeros after 20 tokens"):
        pd.transfer(p, d, "r", prompt, GREEDY)


def test_prompt_mismatch_and_unknown_request_fail(tiny, pd):
    p, d = pd.make_engine(tiny), pd.make_engine(tiny)
    prompt = pd.prompts(1, 20, 20, seed=6)[0]
    pd.prefill(p, "r", prompt, GREEDY)
    with pytest.raises(HandoffError, match="no such request"):
        pd.transfer(p, d, "nope", prompt, GREEDY)
    assert pd.pools_full(d)
    other = [*prompt[:-1], prompt[-1] + 1]
    req = reserve(d, "r", other, GREEDY)
    manifest, payloads = export(p, "r", held_hashes(req), d.blocks.block_size)
    with pytest.raises(HandoffError, match="prompt differs"):
        import_manifest(d, req, manifest, payloads)
    d.abort_request("r")
    assert pd.pools_full(d)


def test_first_token_stop_finishes_on_the_decode_side(tiny, pd):
    both, p, d = (pd.make_engine(tiny) for _ in range(3))
    prompt = pd.prompts(1, 30, 30, seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    want = pd.colocated(both, "r", prompt, params)
    got = pd.disaggregated(p, d, "r", prompt, params)
    assert got[-1].finished and got[-1].finish_reason == want[-1].finish_reason == "length"
    assert_same(got, want)
    assert pd.pools_full(d) and pd.pools_full(p)
