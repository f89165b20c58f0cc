"""Prefill and decode as engine-core processes talking over the ZMQ/TCP transport: the same stream as a
`both` engine; refusals reach the client as errors; a decode side that vanishes after taking the manifest
(no ack) leaves the prefill side's pools full again after the hand-off timeout."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from k3serve.engine.client import EngineClient
from k3serve.engine.messages import HandoffSource
from k3serve.engine.pd.transport import Fetch
from k3serve.engine.sampling_params import SamplingParams

ENGINE = {"model": "k3-tiny-random", "dtype": "float32", "kv_cache_memory": 16 * 2**20, "max_model_len": 256,
          "max_num_seqs": 4, "max_num_batched_tokens": 16}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=20)


async def _collect(stream) -> list:
    return [o async for o in stream]


def _flat(outs: list) -> tuple[list[int], list[dict]]:
    return [t for o in outs for t in o.token_ids], [lp for o in outs for lp in (o.logprobs or [])]


async def _wait_for(client: EngineClient, cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond(client.stats):
        assert time.monotonic() < deadline, f"timed out; stats {client.stats}"
        await asyncio.sleep(0.1)


@pytest.mark.slow  # three engine processes: ~20 s on an idle machine, minutes on a loaded one
def test_prefill_and_decode_processes():
    async def main():
        both = EngineClient(dict(ENGINE))
        pre = EngineClient(dict(ENGINE, role="prefill", handoff_timeout_s=1.0))
        dec = EngineClient(dict(ENGINE, role="decode"))
        try:
            await asyncio.gather(both.start(), pre.start(), dec.start())
            prompt = list(range(100, 137))
            want = _flat(await _collect(both.generate("r", prompt, PARAMS)))
            first = await _collect(pre.generate("r", prompt, PARAMS))
            assert len(first) == 1 and first[0].finished and first[0].handoff is not None
            got = _flat(await _collect(dec.generate("r", prompt, PARAMS, handoff=first[0].handoff)))
            assert got[0] == want[0]
            for a, b in zip(got[1], want[1]):
                assert list(a) == list(b) and max(abs(a[k] - b[k]) for k in a) <= 1e-5
            await _wait_for(pre, lambda s: s.num_held == 0 and s.handoff_transfers == 1 and s.num_blocks_used == 0)
            await _wait_for(dec, lambda s: s.handoff_transfers == 1 and s.handoff_bytes > 0)

            # the ticket was used: a second fetch is refused, and the decode client hears why
            with pytest.raises(ValueError, match="refused the hand-off: .*no such request"):
                await _collect(dec.generate("again", prompt, PARAMS, handoff=first[0].handoff))
            await _wait_for(dec, lambda s: s.num_blocks_used == 0 and s.num_held == 0)

            # a decode side that takes the manifest and dies before acking: released on the timeout
            first = await _collect(pre.generate("lost", prompt, PARAMS))
            await _wait_for(pre, lambda s: s.num_held == 1 and s.num_blocks_used > 0)
            ctx = zmq.Context()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(first[0].handoff.address)
            dealer.send(msgspec.msgpack.encode(Fetch("lost", [], 16)))
            assert dealer.poll(10_000) and dealer.recv_multipart()[0] == b"m"
            dealer.close(0)
            ctx.term()
            await _wait_for(pre, lambda s: s.num_held == 0 and s.num_blocks_used == 0
                            and s.num_free_slots == s.num_slots and s.handoff_failures == 2)  # + the refusal
        finally:
            await asyncio.gather(both.shutdown(), pre.shutdown(), dec.shutdown())

    asyncio.run(main())
