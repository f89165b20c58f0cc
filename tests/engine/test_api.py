"""Offline ``LLM`` API, the async client of the engine-core process (streaming, abort, the ``n`` fan-out),
abort leaks on the real engine, and bad input."""

from __future__ import annotations

import asyncio
import random

import pytest

from k3serve import LLM, SamplingParams
from k3serve.engine.client import EngineClient
from k3serve.engine.sampling_params import fan_out

ENGINE = {"model": "kimi-linear-tiny-random", "dtype": "float32", "kv_cache_memory": 16 * 2**20,
          "max_model_len": 512}


@pytest.fixture(scope="module")
def llm():
    return LLM(model=ENGINE["model"], dtype="float32", kv_cache_memory=16 * 2**20, max_model_len=512)


async def _idle(client: EngineClient) -> None:
    for _ in range(500):  # up to 10 s: an abort lands on the engine loop, slow on a loaded CI box
        if client.stats.num_running == 0 and client.stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)


def test_generate_ids_and_strings(llm):
    ids = [[1, 2, 3, 4], [100, 200]]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6] and all(o.finish_reason == "length" for o in outs)
    single = llm.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert single[0].token_ids == outs[0].token_ids
    if llm.tokenizer is not None:
        text_ids = [t for t in llm.tokenizer.encode("a b c") if t < 2048]
        if len(text_ids) == 3:
            out = llm.generate("a b c", SamplingParams(max_tokens=4, ignore_eos=True))[0]
            assert len(out.token_ids) == 4 and out.text == llm.tokenizer.decode(out.token_ids)
        with pytest.raises(ValueError, match="^prompt:.*outside"):
            llm.generate("Kimi 月之暗面", SamplingParams(max_tokens=2))


def test_params_per_prompt_n_and_seeds(llm):
    p = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
         SamplingParams(temperature=1.0, seed=11, max_tokens=5, n=3, ignore_eos=True)]
    a = llm.generate([[5, 6, 7], [8, 9]], p)
    b = llm.generate([[8, 9]], p[1])
    assert len(a[0].token_ids) == 3 and len(a[1].outputs) == 3
    assert [o.token_ids for o in a[1].outputs] == [o.token_ids for o in b[0].outputs]
    assert len({tuple(o.token_ids) for o in a[1].outputs}) > 1
    with pytest.raises(ValueError, match="^params:"):
        llm.generate([[1], [2]], p * 2)
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[1, 5000]], p[0])
    with pytest.raises(ValueError, match="^max_num_seqs:"):
        LLM(model="kimi-linear-tiny-random", max_num_seqs=0)


def test_eos_and_stop_token_ids_finish_with_stop(llm):
    first = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_at = first.token_ids[3]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1]
    assert out.outputs[0].stop_reason == stop_at


def test_random_aborts_on_the_real_engine_leave_pools_full(llm):
    engine = llm.engine
    rng = random.Random(0)
    live = []
    for i in range(60):
        rid = f"ab{i}"
        engine.add_request(rid, [rng.randrange(2000) for _ in range(rng.randrange(1, 60))],
                           SamplingParams(temperature=0.8, max_tokens=rng.randrange(1, 40), ignore_eos=True))
        live.append(rid)
        for _ in range(rng.randrange(3)):
            engine.step()
        while live and rng.random() < 0.5:
            engine.abort_request(live.pop(rng.randrange(len(live))))
    for rid in live:
        engine.abort_request(rid)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_blocks_used == 0
    assert engine.states.num_running_free == engine.states.max_running
    assert all(r == 0 for r in engine.states._refs.values())


def test_async_stream_and_abort(llm):
    async def main():
        client = EngineClient(dict(ENGINE))
        await client.start()
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        try:
            async def collect(rid, prompt):
                outs = [o async for o in client.generate(rid, prompt, params)]
                assert outs[-1].finished and outs[-1].finish_reason == "length"
                return [t for o in outs for t in o.token_ids]

            async def abort_early():
                got = 0
                async for _ in client.generate("gone", [9, 9, 9], SamplingParams(max_tokens=200, ignore_eos=True)):
                    got += 1
                    if got == 2:
                        break  # closing the iterator aborts the request
                return got

            a, b, n = await asyncio.gather(collect("a", [1, 2, 3, 4]), collect("b", [100, 200]), abort_early())
            with pytest.raises(ValueError, match="^prompt:"):
                await anext(client.generate("empty", [], params))
            await _idle(client)
            return a, b, n, client.stats
        finally:
            await client.shutdown()

    a, b, n, stats = asyncio.run(main())
    sync = llm.generate([[1, 2, 3, 4], [100, 200]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [a, b] == [o.token_ids for o in sync] and n == 2
    assert stats.num_running == 0 and stats.num_blocks_used == 0


def test_stop_string_through_the_engine(llm):
    if llm.tokenizer is None:
        pytest.skip("k3serve.tokenizer is not available")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate([[7, 8, 9]], params)[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    # a stop string that starts inside token 3's text and ends inside token 5's
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    start = len("".join(pieces[:3])) + len(pieces[3]) // 2
    stop = full.text[start:len("".join(pieces[:5])) - len(pieces[4]) // 2]
    cut = full.text.index(stop)
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert out.text == full.text[:cut] and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)


def test_fan_out_is_the_offline_n():
    """One expansion of n: ids and derived seeds, the same for the server and the offline LLM."""
    p = SamplingParams(n=3, seed=5, max_tokens=4)
    subs = fan_out("g", p)
    assert [rid for rid, _ in subs] == ["g-0", "g-1", "g-2"]
    assert [sp.seed for _, sp in subs] == [p.for_sample(k).seed for k in range(3)] and all(sp.n == 1 for _, sp in subs)
    assert fan_out("g", SamplingParams(seed=5)) == [("g", SamplingParams(seed=5))]


def test_client_n_samples_match_the_offline_llm(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)

    async def main():
        client = EngineClient(dict(ENGINE))
        await client.start()
        try:
            async def one(rid, sp):
                return [t async for o in client.generate(rid, [5, 6, 7], sp) for t in o.token_ids]

            samples = await asyncio.gather(*(one(rid, sp) for rid, sp in fan_out("g", params)))
            got = 0
            async for _ in client.generate("h-0", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)):
                got += 1
                if got == 3:
                    break  # closing aborts it
            with pytest.raises(ValueError, match="^n:"):
                await anext(client.generate("whole", [5, 6, 7], params))  # the engine takes one sample a request
            await _idle(client)
            return samples, client.stats
        finally:
            await client.shutdown()

    samples, stats = asyncio.run(main())
    assert samples == [o.token_ids for o in llm.generate([[5, 6, 7]], params)[0].outputs]
    assert len(set(map(tuple, samples))) > 1  # distinct derived seeds
    assert stats.num_running == 0 and stats.num_blocks_used == 0
